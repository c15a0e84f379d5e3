#!/usr/bin/env bash
# End to end: a receiver with --metrics-listen lands a file's tensors, and a scrape of its
# /metrics shows them, with the memory budget of where they landed; on a GPU, the pools'
# families too. Exits non-zero, saying which metric, when one is missing or wrong.
#
#   scripts/metrics-e2e.sh [BIN_DIR]    # BIN_DIR holds receiver and sender (default target/release)
#
# DEVICE (default: cuda:0 where nvidia-smi lists a GPU, else host) is where tensors land.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
bin=${1:-$here/target/release}
work=$(mktemp -d)
receiver_pid=
trap '[ -z "$receiver_pid" ] || kill "$receiver_pid" 2>/dev/null || true; rm -rf "$work"' EXIT
device=${DEVICE:-$(nvidia-smi -L > /dev/null 2>&1 && echo cuda:0 || echo host)}
tensors=6

# Six tensors of 3 MiB, random bytes.
python3 - "$work/sent.safetensors" "$tensors" <<'PY'
import json, os, struct, sys
n, size = int(sys.argv[2]), 3 << 20
header = {f"t{i}": {"dtype": "U8", "shape": [size], "data_offsets": [i * size, (i + 1) * size]} for i in range(n)}
raw = json.dumps(header).encode()
raw += b" " * (-len(raw) % 8)
with open(sys.argv[1], "wb") as f:
    f.write(struct.pack("<Q", len(raw)) + raw + os.urandom(n * size))
PY

"$bin/receiver" --listen 127.0.0.1:0 --device "$device" --metrics-listen 127.0.0.1:0 \
  > "$work/receiver.log" 2>&1 &
receiver_pid=$!
for _ in $(seq 100); do grep -q "^metrics at " "$work/receiver.log" && break; sleep 0.1; done
addr=$(sed -n 's/^listening on //p' "$work/receiver.log")
url=$(sed -n 's/^metrics at //p' "$work/receiver.log")
[ -n "$addr" ] && [ -n "$url" ] || { cat "$work/receiver.log" >&2; exit 1; }
"$bin/sender" --connect "$addr" --quiet "$work/sent.safetensors"

python3 - "$url" "$device" "$tensors" <<'PY'
import sys, urllib.request
url, device, tensors = sys.argv[1], sys.argv[2], int(sys.argv[3])
with urllib.request.urlopen(url, timeout=10) as response:
    kind = response.headers.get("Content-Type", "")
    text = response.read().decode()
assert kind.startswith("application/openmetrics-text"), kind
samples = {}
for line in text.splitlines():
    if line and not line.startswith("#"):
        series, value = line.rsplit(" ", 1)
        samples[series] = float(value)
def need(series, check, what):
    value = samples.get(series)
    if value is None or not check(value):
        sys.exit(f"metrics-e2e: {series} = {value}: expected {what}")
    print(f"ok {series} {value:g}")
need('tensorwire_received_tensors_total{outcome="completed"}', lambda v: v == tensors, tensors)
need("tensorwire_received_payload_bytes_total", lambda v: v == tensors * (3 << 20), "every byte")
need('tensorwire_receive_latency_seconds_bucket{le="+Inf"}', lambda v: v == tensors, tensors)
memory = "host" if device == "host" else device
need(f'tensorwire_memory_limit_bytes{{memory="{memory}"}}', lambda v: v > 0, "a limit")
if device != "host":
    need('tensorwire_pool_requests_total{pool="device",outcome="miss"}', lambda v: v >= 1, "allocations")
    need('tensorwire_pool_bytes{pool="staging",state="allocated"}', lambda v: v > 0, "pinned staging")
    need('tensorwire_pinned_datagrams_total{outcome="served"}', lambda v: v >= 0, "a count")
print(f"metrics-e2e: {len(samples)} samples, {tensors} tensors into {device}: ok")
PY
