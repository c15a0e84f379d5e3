#!/usr/bin/env python3
"""A UDP relay between one client and a server that delays every datagram and drops some:
a long lossy path on one host, no root or netem needed.

    udp-relay.py LISTEN_PORT SERVER_PORT DELAY_MS LOSS_PERCENT
"""
import asyncio
import random
import sys


class Relay(asyncio.DatagramProtocol):
    def __init__(self, server, delay, loss):
        self.server, self.delay, self.loss = server, delay, loss
        self.client = None
        self.transport = None

    def connection_made(self, transport):
        self.transport = transport

    def datagram_received(self, data, addr):
        if addr == self.server:
            dest = self.client
        else:
            self.client, dest = addr, self.server
        if dest is None or random.random() < self.loss:
            return
        asyncio.get_running_loop().call_later(self.delay, self.transport.sendto, data, dest)


async def main():
    listen, server, delay_ms, loss = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
    loop = asyncio.get_running_loop()
    await loop.create_datagram_endpoint(
        lambda: Relay(("127.0.0.1", server), delay_ms / 1000, loss / 100),
        local_addr=("127.0.0.1", listen),
    )
    print(f"relaying 127.0.0.1:{listen} -> :{server}, {delay_ms} ms each way, {loss}% loss", flush=True)
    await asyncio.Event().wait()


asyncio.run(main())
