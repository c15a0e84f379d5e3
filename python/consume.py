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
                print(t["name"], t["dtype"], t["shape"], t["byte_len"], t["export"], "leases", t["leases"])
            return 0
        with client.open(argv[2]) as tensor:
            where = f"GPU {tensor.device}" if tensor.is_gpu else "host memory"
            if "--triple" in argv:
                if tensor.is_gpu:
                    tensor.write(bytes((b * 3) & 0xFF for b in tensor.read()))
                else:
                    data = tensor.bytes()  # in place, no copy
                    for i in range(len(data)):
                        data[i] = (data[i] * 3) & 0xFF
                print("TRIPLED", tensor.byte_len)
            else:
                first = tensor.read()[:16] if tensor.is_gpu else bytes(tensor.bytes()[:16])
                print(tensor.name, tensor.dtype, tensor.shape, tensor.export, where, first.hex())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
