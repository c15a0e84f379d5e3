#!/usr/bin/env bash
# End to end: a receiver shares what it receives over QUIC; the Python consumer (with
# PyTorch and CuPy where installed) reads back exactly the bytes that were sent.
#
#   scripts/share-e2e.sh [BIN_DIR]     # BIN_DIR holds receiver and sender (default target/release)
#
# Then the C and C++ consumers of crates/tensorwire-c read the same tensors: the C example
# and, where g++ and PyTorch's LibTorch are installed, the LibTorch one (torch::from_blob);
# on a GPU, the LibTorch producer shares PyTorch's own CUDA memory for a Python consumer,
# built here against libtensorwire_c.so from C_LIB_DIR (default: BIN_DIR) and the sources in
# C_SRC_DIR (default crates/tensorwire-c). REQUIRE_CPP=1 makes a missing g++ or LibTorch an
# error.
#
# On a GPU host, tensors land on the GPU and are shared with no copy (VMM fds); elsewhere in
# host memory. Set DEVICE=host to force host memory, REQUIRE_GPU=1 to fail without a GPU.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
bin=${1:-$here/target/release}
work=$(mktemp -d)
trap 'kill $receiver_pid ${producer_pid:-} 2>/dev/null || true; rm -rf "$work"' EXIT
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

# The C and C++ consumers: byte sums of what they read, against the sent file's
# (first: verify.py below writes a.u8 in place).
c_lib=${C_LIB_DIR:-$bin}
c_src=${C_SRC_DIR:-$here/crates/tensorwire-c}
python3 - "$work/sent.safetensors" > "$work/expected-sums.txt" <<'PY'
import json, struct, sys
data = open(sys.argv[1], "rb").read()
n = struct.unpack("<Q", data[:8])[0]
header = json.loads(data[8:8 + n])
for name, info in sorted(header.items()):
    start, end = info["data_offsets"]
    print(name, sum(data[8 + n + start:8 + n + end]))
PY
cc "$c_src/examples/consumer.c" -I "$c_src/include" -L "$c_lib" -ltensorwire_c \
  -Wl,-rpath,"$c_lib" -o "$work/c-consumer"
"$work/c-consumer" "$work/share/share.sock" c.f32
c_sum=$("$work/c-consumer" "$work/share/share.sock" c.f32 | sed -n 's/^sum //p')
grep -qx "c.f32 $c_sum" "$work/expected-sums.txt" || { echo "C consumer: byte sum $c_sum differs" >&2; exit 1; }
echo "C consumer: c.f32 byte sum $c_sum matches what was sent"
# LibTorch's flags from the PyTorch python3 imports (C++ standard, ABI, paths, libraries).
torch_flags=$(python3 "$c_src/examples/torch_flags.py" 2>/dev/null || true)
if command -v g++ >/dev/null && [ -n "$torch_flags" ]; then
  # shellcheck disable=SC2086 # the flags are words
  g++ -O1 "$c_src/examples/torch_consumer.cpp" $torch_flags -I "$c_src/include" \
    -L "$c_lib" -ltensorwire_c -Wl,-rpath,"$c_lib" -o "$work/torch-consumer"
  "$work/torch-consumer" "$work/share/share.sock" a.u8 b.bf16 c.f32 d.i64 | tee "$work/torch.txt"
  sed -n 's/^\([^ ]*\) .* byte sum \([0-9]*\)$/\1 \2/p' "$work/torch.txt" | sort > "$work/torch-sums.txt"
  if ! diff "$work/expected-sums.txt" "$work/torch-sums.txt"; then
    echo "LibTorch consumer: byte sums differ from what was sent" >&2; exit 1
  fi
  echo "LibTorch consumer: every tensor's bytes match what was sent"
  # The LibTorch producer: a tensor in PyTorch's own CUDA memory (a slice inside a larger
  # allocation) shared with no copy; a Python consumer doubles it and the producer sees it.
  if python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    # shellcheck disable=SC2086
    g++ -O1 "$c_src/examples/torch_producer.cpp" $torch_flags -I "$c_src/include" \
      -L "$c_lib" -ltensorwire_c -Wl,-rpath,"$c_lib" -o "$work/torch-producer"
    "$work/torch-producer" "$work/producer/share.sock" framework 60 > "$work/producer.log" 2>&1 &
    producer_pid=$!
    for _ in $(seq 300); do grep -q "^published" "$work/producer.log" && break; sleep 0.1; done
    python3 - "$work/producer/share.sock" "$here/python" <<'PY'
import sys
sys.path.insert(0, sys.argv[2])
import torch
from tensorwire_ipc import Client
with Client(sys.argv[1]) as client, client.open("framework", wait=30) as t:
    x = torch.from_dlpack(t)
    assert x.shape == (256, 256) and x[0, 0].item() == 4096.0, (x.shape, x[0, 0].item())
    assert x[255, 255].item() == 4096.0 + 65535, x[255, 255].item()
    assert t.attributes == {"producer": "torch_producer", "layout": "row-major"}, t.attributes
    x.mul_(2)
    torch.cuda.synchronize()
    del x
print("Python consumer: doubled the LibTorch producer's tensor in place")
PY
    wait "$producer_pid" || { cat "$work/producer.log"; echo "LibTorch producer: failed" >&2; exit 1; }
    cat "$work/producer.log"
    grep -q "consumer write seen" "$work/producer.log"
    echo "LibTorch producer: PyTorch's own memory shared with no copy, written by a consumer"
  elif [ "${REQUIRE_GPU:-0}" = 1 ]; then
    echo "LibTorch producer: needs PyTorch with CUDA, and REQUIRE_GPU=1" >&2; exit 1
  fi
elif [ "${REQUIRE_CPP:-0}" = 1 ]; then
  echo "LibTorch consumer: needs g++ and PyTorch (LibTorch), and REQUIRE_CPP=1" >&2; exit 1
else
  echo "LibTorch consumer: skipped (no g++ or no PyTorch here)"
fi


python3 "$here/python/verify.py" "$work/share/share.sock" "$work/sent.safetensors"
# The example consumer: list, then show a tensor's first bytes.
python3 "$here/python/consume.py" "$work/share/share.sock"
python3 "$here/python/consume.py" "$work/share/share.sock" c.f32
