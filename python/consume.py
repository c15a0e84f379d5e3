#!/usr/bin/env python3
"""List a producer's tensors, or read one, as an example of the Python consumer.

    python3 python/consume.py SOCKET                # list
    python3 python/consume.py SOCKET NAME           # show the first bytes of a tensor
    python3 python/consume.py SOCKET NAME --triple  # multiply every byte by 3 in place
"""

import sys

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from tensorwire_ipc import Client  # noqa: E402


def main(argv):
    if len(argv) < 2:
        print(__doc__)
        return 2
    with Client(argv[1]) as client:
        if len(argv) == 2:
            for t in client.list():
                print(t["name"], t["dtype"], t["shape"], t["byte_len"], "leases", t["leases"])
            return 0
        with client.open(argv[2]) as tensor:
            data = tensor.bytes()
            if "--triple" in argv:
                for i in range(len(data)):
                    data[i] = (data[i] * 3) & 0xFF
                print("TRIPLED", len(data))
            else:
                print(tensor.name, tensor.dtype, tensor.shape, bytes(data[:16]).hex())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
