#!/usr/bin/env python3
"""A long lossy IP path on one host, for any protocol: a TUN device whose packets are delayed,
dropped at random, and reflected back to this host.

Run it inside a private network namespace (scripts/lossy-tun.sh does). It creates the device
DEV with address 10.9.0.1/24; a packet sent to 10.9.0.2 leaves through DEV, waits DELAY_MS,
is dropped with probability LOSS_PERCENT, and comes back with its source and destination
addresses swapped (which leaves the IP, TCP and UDP checksums valid). So a server listening on
10.9.0.1 and a client connecting to 10.9.0.2 talk over a path of 2 x DELAY_MS round trip with
LOSS_PERCENT loss each way: TCP and QUIC see the same path.

    tun-path.py DEV DELAY_MS LOSS_PERCENT
"""

import fcntl
import heapq
import os
import random
import struct
import subprocess
import sys
import threading
import time

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000


def open_tun(name):
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def main():
    dev, delay_ms, loss = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]) / 100
    fd = open_tun(dev)
    subprocess.run(["ip", "addr", "add", "10.9.0.1/24", "dev", dev], check=True)
    subprocess.run(["ip", "link", "set", dev, "up"], check=True)
    queue, ready = [], threading.Condition()
    counts = {"passed": 0, "dropped": 0}

    def writer():
        while True:
            with ready:
                while not queue or queue[0][0] > time.monotonic():
                    ready.wait(None if not queue else queue[0][0] - time.monotonic())
                _, _, packet = heapq.heappop(queue)
            try:
                os.write(fd, packet)
            except OSError:
                pass

    threading.Thread(target=writer, daemon=True).start()
    print("ready", flush=True)
    seq = 0
    while True:
        packet = os.read(fd, 65536)
        if len(packet) < 20 or packet[0] >> 4 != 4:
            continue
        if random.random() < loss:
            counts["dropped"] += 1
            continue
        counts["passed"] += 1
        reflected = packet[:12] + packet[16:20] + packet[12:16] + packet[20:]
        seq += 1
        with ready:
            heapq.heappush(queue, (time.monotonic() + delay_ms / 1000, seq, reflected))
            ready.notify()


if __name__ == "__main__":
    main()
