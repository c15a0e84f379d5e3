#!/usr/bin/env python3
"""Many small tensors from Python: N `tensorwire.send()` calls (each opens its connections)
beside one `tensorwire.Sender` making the same N sends over connections it keeps, into one
receiver in this process, rounds taking turns. Prints each round's seconds and the ratio.

    python3 benches/python-sender.py [--tensors 1000] [--kib 4] [--rounds 3]

Needs the tensorwire package (a release build: `pip install ./python`).
"""

import argparse
import statistics
import threading
import time

import numpy as np

import tensorwire


def drain(rx, count, done):
    for _ in range(count):
        rx.recv(timeout=120).release()
    done.set()


def timed(rx, count, send_all):
    """Seconds for `send_all` to send `count` tensors and the receiver to take them all."""
    done = threading.Event()
    taker = threading.Thread(target=drain, args=(rx, count, done))
    taker.start()
    started = time.perf_counter()
    send_all()
    done.wait()
    seconds = time.perf_counter() - started
    taker.join()
    return seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=1000)
    parser.add_argument("--kib", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    tensor = np.ones(args.kib * 256, np.float32)
    n = args.tensors
    ratios = []
    with tensorwire.Receiver("127.0.0.1:0", device="host") as rx:

        def one_call_each():
            for i in range(n):
                tensorwire.send(rx.address, {f"t{i}": tensor}, connections=1)

        def one_sender():
            with tensorwire.Sender(rx.address, connections=1) as sender:
                for i in range(n):
                    sender.send({f"t{i}": tensor})

        for round in range(args.rounds):
            order = [("send()", one_call_each), ("Sender", one_sender)]
            if round % 2:
                order.reverse()
            seconds = {name: timed(rx, n, run) for name, run in order}
            ratio = seconds["send()"] / seconds["Sender"]
            ratios.append(ratio)
            print(
                f"round {round + 1}: {n} x {args.kib} KiB: {n} send() calls {seconds['send()']:.2f} s, "
                f"one Sender {seconds['Sender']:.2f} s ({seconds['Sender'] / n * 1e3:.2f} ms a send): {ratio:.1f}x"
            )
    print(f"median: one Sender is {statistics.median(ratios):.1f}x faster than send() calls "
          f"(spread {min(ratios):.1f}-{max(ratios):.1f})")


if __name__ == "__main__":
    main()
