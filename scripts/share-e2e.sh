#!/usr/bin/env bash
# End to end: a receiver shares what it receives over QUIC; the Python consumer (with
# PyTorch and CuPy where installed) reads back exactly the bytes that were sent.
#
#   scripts/share-e2e.sh [BIN_DIR]     # BIN_DIR holds receiver and sender (default target/release)
#
# On a GPU host, tensors land on the GPU and are shared with no copy (VMM fds); elsewhere in
# host memory. Set DEVICE=host to force host memory, REQUIRE_GPU=1 to fail without a GPU.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
bin=${1:-$here/target/release}
work=$(mktemp -d)
trap 'kill $receiver_pid 2>/dev/null || true; rm -rf "$work"' EXIT
port=$((20000 + RANDOM % 20000))

# Odd sizes and several dtypes; random bytes, so nothing matches by accident.
python3 - "$work/sent.safetensors" <<'PY'
import json, os, struct, sys
tensors = [("a.u8", "U8", [3, 1000003]), ("b.bf16", "BF16", [257, 129]), ("c.f32", "F32", [5, 7, 11]),
           ("d.i64", "I64", [12345])]
size = {"U8": 1, "BF16": 2, "F32": 4, "I64": 8}
header, blobs, offset = {}, [], 0
for name, dtype, shape in tensors:
    n = size[dtype]
    for d in shape:
        n *= d
    header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
    blobs.append(os.urandom(n))
    offset += n
raw = json.dumps(header).encode()
raw += b" " * (-len(raw) % 8)
with open(sys.argv[1], "wb") as f:
    f.write(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))
PY

args=(--listen "127.0.0.1:$port" --share "$work/share/share.sock" --device "${DEVICE:-auto}")
[ "${REQUIRE_GPU:-0}" = 1 ] && args+=(--require-gpu)
"$bin/receiver" "${args[@]}" > "$work/receiver.log" 2>&1 &
receiver_pid=$!
for _ in $(seq 100); do grep -q "listening on" "$work/receiver.log" && break; sleep 0.1; done
"$bin/sender" --connect "127.0.0.1:$port" --quiet "$work/sent.safetensors"
for _ in $(seq 100); do [ "$(grep -c '^shared ' "$work/receiver.log")" -ge 4 ] && break; sleep 0.1; done
cat "$work/receiver.log"
python3 "$here/python/verify.py" "$work/share/share.sock" "$work/sent.safetensors"
# The example consumer: list, then show a tensor's first bytes.
python3 "$here/python/consume.py" "$work/share/share.sock"
python3 "$here/python/consume.py" "$work/share/share.sock" c.f32
