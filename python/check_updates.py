#!/usr/bin/env python3
"""Checks the Python consumer's live-sharing calls against a producer (used by the tests):
watch a prefix, wait for a name with open(wait=...), and read the metadata and generations.

    python3 python/check_updates.py SOCKET

Prints READY once watching; the producer then publishes `live.w` twice (generation 1 and 2)
and `late` once.
"""

import sys

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from tensorwire_ipc import Client, ShareError  # noqa: E402


def main(argv):
    with Client(argv[1]) as client:
        try:
            client.open("late", wait=0.05)
            print("late opened before it was published")
            return 1
        except ShareError as e:
            assert e.code_name == "not_found", e
        with client.watch("live.") as watch:
            print("READY", flush=True)
            events = [watch.next(timeout=10) for _ in range(2)]
            assert all(events), events
            seen = [(e["event"], e["tensor"]["name"], e["tensor"]["generation"]) for e in events]
            assert seen == [("published", "live.w", 1), ("updated", "live.w", 2)], seen
            assert watch.next(timeout=0.2) is None, "nothing else"
        with client.open("late", wait=10) as late:
            assert late.generation == 1 and late.attributes == {"sample_rate": "16000"}, late.descriptor
            assert late.numel == 4 and late.element_size == 4 and late.device_info is None
            print("UPDATES-OK", seen, late.attributes)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
