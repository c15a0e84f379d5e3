#!/usr/bin/env bash
# The shipped programs as users run them, beside raw quinn in the same run: one `receiver`
# (N endpoints, one budget) fed by S `sender` processes on loopback, each sending one file.
#
#   benches/scale.sh BIN_DIR [SENDERS] [MIB_PER_SENDER] [DEVICE] [ENDPOINTS]
#
# RECEIVER_FLAGS adds receiver flags (e.g. "--stream-window-mib 64"); BUDGET_MIB sets its
# budget (default 512). BIN_DIR holds receiver, sender and bench (cargo build --release -p tensorwire-examples
# -p tensorwire-bench). DEVICE: cuda:0 (default) or host. Prints one line per measurement.
set -euo pipefail
bin=$(cd "$1" && pwd)
senders=${2:-8}
mib=${3:-2048}
device=${4:-cuda:0}
endpoints=${5:-0}
budget_mib=${BUDGET_MIB:-512}
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT

for i in $(seq "$senders"); do
  head -c $((mib << 20)) /dev/urandom > "$work/t$i.bin"
done
"$bin/receiver" --listen 127.0.0.1:0 --mtu 6000 --device "$device" --endpoints "$endpoints" \
  --budget-mib "$budget_mib" --count "$senders" ${RECEIVER_FLAGS:-} > "$work/receiver.log" 2>&1 &
receiver=$!
for _ in $(seq 100); do grep -q "listening on" "$work/receiver.log" && break; sleep 0.1; done
addr=$(sed -n 's/^listening on //p' "$work/receiver.log")
[ -n "$addr" ] || { cat "$work/receiver.log"; exit 1; }
start=$(date +%s.%N)
pids=()
for i in $(seq "$senders"); do
  "$bin/sender" --connect "$addr" --mtu 6000 --quiet --dtype U8 --shape $((mib << 20)) \
    "$work/t$i.bin" > "$work/sender-$i.log" 2>&1 &
  pids+=($!)
done
failed=0
for pid in "${pids[@]}"; do wait "$pid" || failed=$((failed + 1)); done
end=$(date +%s.%N)
wait "$receiver" || failed=$((failed + 1))
total=$((senders * mib))
gbit=$(awk -v b="$total" -v s="$start" -v e="$end" 'BEGIN { print b * 1048576 * 8 / (e - s) / 1e9 }')
printf 'programs: 1 receiver (%s, endpoints %s) <- %d senders x %d MiB: %.1f Gbit/s, %d failed\n' \
  "$device" "$(sed -n 's/ endpoints.*//p' "$work/receiver.log")" "$senders" "$mib" "$gbit" "$failed"
grep -h "failed:" "$work"/sender-*.log || true
grep -o "peak credit held.*" "$work/receiver.log" || true
grep -E "tensors land|Error|error" "$work/receiver.log" | head -5 || true
"$bin/bench" --only raw-quinn --connections "$senders" --mtu 6000 --runs 1 --mib "$mib" 2>&1 \
  | grep -iE "raw.quinn|gbit" | head -5
[ "$failed" -eq 0 ]
