#!/usr/bin/env bash
# Python `tensorwire.send` of a CUDA tensor beside the Rust `sender` of the same bytes from a
# file, into one `receiver --device cuda:0`, on one GPU host (loopback, MTU 6000, one
# connection each, then Python again over 8 connections, the tensor split over them).
#
#   benches/python-send.sh BIN_DIR [MIB]       # the tensorwire package importable by python3
set -euo pipefail
bin=$(cd "$1" && pwd)
mib=${2:-4096}
work=$(mktemp -d)
pid=
cleanup() {
  if [ -n "$pid" ]; then kill "$pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT
"$bin/receiver" --listen 127.0.0.1:0 --mtu 6000 --device cuda:0 --require-gpu --count 3 \
  --max-tensor-mib $((mib + 1)) > "$work/receiver.log" 2>&1 &
pid=$!
for _ in $(seq 100); do
  addr=$(sed -n 's/^listening on //p' "$work/receiver.log" | head -1)
  [ -n "$addr" ] && break
  sleep 0.1
done
python3 - "$addr" "$mib" "$work/x.bin" <<'PY'
import sys, time
import torch
import tensorwire

addr, mib, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
x = torch.randint(0, 255, (mib << 20,), dtype=torch.uint8, device="cuda:0")
torch.cuda.synchronize()
start = time.perf_counter()
tensorwire.send(addr, {"from_python": x}, mtu=6000, connections=1)
seconds = time.perf_counter() - start
print(f"python tensorwire.send, {mib} MiB CUDA tensor: {seconds:.2f} s, "
      f"{mib * 1.048576 / 1000 / seconds:.2f} GB/s")
# The same tensor over 8 connections, in parts of consecutive bytes (spec §15).
start = time.perf_counter()
tensorwire.send(addr, {"from_python_split": x}, mtu=6000, connections=8)
seconds = time.perf_counter() - start
print(f"python tensorwire.send, {mib} MiB CUDA tensor split over 8 connections: "
      f"{seconds:.2f} s, {mib * 1.048576 / 1000 / seconds:.2f} GB/s")
x.cpu().numpy().tofile(path)
PY
start=$(date +%s.%N)
"$bin/sender" --connect "$addr" --mtu 6000 --connections 1 --quiet --dtype U8 \
  --shape $((mib << 20)) "$work/x.bin"
end=$(date +%s.%N)
awk -v m="$mib" -v s="$start" -v e="$end" 'BEGIN {
  printf "rust sender, the same %d MiB from a file: %.2f s, %.2f GB/s\n", m, e - s, m * 1.048576 / 1000 / (e - s)
}'
wait "$pid"
