#!/usr/bin/env python3
"""Checks that every tensor of a .safetensors file, as a producer shares it, has exactly the
file's bytes: read through the consumer, and (where installed) through PyTorch and CuPy with
no copy. Then multiplies the first tensor by 3 in place through PyTorch (or the consumer) and
checks the write is visible. Exit status 0 only if everything matched.

    python3 python/verify.py SOCKET FILE.safetensors
"""

import json
import struct
import sys

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from tensorwire_ipc import Client  # noqa: E402


def safetensors(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    header.pop("__metadata__", None)
    return {name: (t["dtype"], t["shape"], data[t["data_offsets"][0]:t["data_offsets"][1]])
            for name, t in header.items()}


def torch_bytes(tensor):
    import torch

    t = tensor.torch()
    assert t.is_cuda == tensor.is_gpu, (t.device, tensor.export)
    return bytes(t.contiguous().view(torch.uint8).cpu().numpy()), str(t.dtype)


def cupy_bytes(tensor):
    import cupy

    return cupy.asarray(tensor).view(cupy.uint8).get().tobytes()


def optional(name):
    try:
        __import__(name)
        return True
    except ImportError:
        return False


def main(argv):
    if len(argv) != 3:
        print(__doc__)
        return 2
    expected = safetensors(argv[2])
    have_torch, have_cupy = optional("torch"), optional("cupy")
    failures, exports = 0, set()
    with Client(argv[1]) as client:
        for name, (dtype, shape, data) in expected.items():
            with client.open(name) as tensor:
                exports.add(tensor.export)
                checks = {"consumer": tensor.read()}
                if have_torch:
                    checks["torch"], torch_dtype = torch_bytes(tensor)
                if have_cupy and tensor.is_gpu:
                    checks["cupy"] = cupy_bytes(tensor)
                for via, got in checks.items():
                    if got != data:
                        failures += 1
                        print(f"MISMATCH {name} via {via}: {len(got)} bytes, expected {len(data)}")
                assert list(tensor.shape) == shape and tensor.dtype == dtype, (tensor.shape, shape)
        first = next(iter(expected))
        with client.open(first, all_gpus=True) as tensor:  # VMM: mapped for every GPU here
            if tensor.read() != expected[first][2]:
                failures += 1
                print(f"MISMATCH {first} opened for all GPUs")
        with client.open(first) as tensor:
            before = tensor.read()
            if have_torch and tensor.dtype == "U8":
                tensor.torch().mul_(3)  # in place, on the GPU for a GPU tensor
            else:
                tensor.write(bytes((b * 3) & 0xFF for b in before))
        with client.open(first) as tensor:
            if tensor.read() != bytes((b * 3) & 0xFF for b in before):
                failures += 1
                print(f"MISMATCH {first}: an in-place multiply is not visible to a new mapping")
    via = ", ".join(["consumer"] + (["torch"] if have_torch else []) + (["cupy"] if have_cupy else []))
    print(f"{'VERIFIED' if failures == 0 else 'FAILED'} {len(expected)} tensors "
          f"(export {', '.join(sorted(exports))}) via {via}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
