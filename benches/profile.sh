#!/usr/bin/env bash
# Where the programs spend their CPU under load: `perf record` of the receiver and of one of
# SENDERS sender processes while they move SENDERS × MIB MiB on loopback (as benches/scale.sh),
# then each one's hottest symbols.
#
#   benches/profile.sh BIN_DIR [SENDERS] [MIB_PER_SENDER] [DEVICE] [OUT_DIR]
#
# Needs `perf` (PERF names another binary) and kernel.perf_event_paranoid ≤ 2. BIN_DIR holds
# receiver and sender built with symbols (cargo build --release keeps them; stripped binaries
# work if `perf report` runs where the unstripped ones are in its build-id cache). The
# profiles stay in OUT_DIR (default: a new temporary directory) for `perf report -i`.
set -euo pipefail
. "$(dirname "$0")/common.sh"
bin=$(cd "$1" && pwd)
senders=${2:-8}
mib=${3:-1024}
device=${4:-cuda:0}
out=${5:-$(mktemp -d)}
perf=${PERF:-perf}
mkdir -p "$out"
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
for i in $(seq "$senders"); do head -c $((mib << 20)) /dev/urandom > "$work/t$i.bin"; done
"$perf" record -F 499 -o "$out/receiver.data" -- "$bin/receiver" --listen 127.0.0.1:0 \
  --mtu "$MTU" --device "$device" --budget-mib 512 --count "$senders" > "$work/receiver.log" 2>&1 &
receiver=$!
addr=$(listening_address "$work/receiver.log")
pids=()
for i in $(seq "$senders"); do
  profile=()
  [ "$i" = 1 ] && profile=("$perf" record -F 499 -o "$out/sender.data" --)
  "${profile[@]}" "$bin/sender" --connect "$addr" --mtu "$MTU" --quiet --connections 1 --dtype U8 \
    --shape $((mib << 20)) "$work/t$i.bin" > "$work/sender-$i.log" 2>&1 &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done
wait "$receiver"
for side in receiver sender; do
  echo "== $side: hottest symbols (share of its CPU samples)"
  "$perf" report -i "$out/$side.data" --no-children --sort dso,sym 2>/dev/null \
    | grep -v '^#' | grep '%' | head -15
done
echo "profiles: $out/receiver.data, $out/sender.data"
