#!/usr/bin/env bash
# Head-of-line on save: how long a 1 MiB tensor takes on its own, and while a large file
# lands and is being written by `receiver --save` (disk writes must stay off the path that
# admits and lands other tensors).
#
#   scripts/save-latency.sh [BIN_DIR] [BIG_MIB]
#
# BIN_DIR holds receiver and sender (cargo build --release -p tensorwire-examples; default
# target/release); BIG_MIB is the large file's size (default 1024). Prints one line per
# measurement; exit status 0 only if every transfer succeeded.
set -euo pipefail
bin=$(cd "${1:-target/release}" && pwd)
big_mib=${2:-1024}
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT

head -c $((big_mib << 20)) /dev/urandom > "$work/big.bin"
head -c $((1 << 20)) /dev/urandom > "$work/small.bin"
"$bin/receiver" --listen 127.0.0.1:0 --device host --save "$work/out" > "$work/receiver.log" 2>&1 &
for _ in $(seq 100); do grep -q "listening on" "$work/receiver.log" && break; sleep 0.1; done
addr=$(sed -n 's/^listening on //p' "$work/receiver.log")
[ -n "$addr" ] || { cat "$work/receiver.log"; exit 1; }

small() { # prints the 1 MiB tensor's seconds, from starting the sender to its exit
  local start end
  start=$(date +%s.%N)
  "$bin/sender" --connect "$addr" --quiet --dtype U8 --shape $((1 << 20)) "$work/small.bin" \
    > /dev/null 2>&1
  end=$(date +%s.%N)
  awk -v s="$start" -v e="$end" 'BEGIN { printf "%.3f", e - s }'
}

printf '1 MiB alone: %s s\n' "$(small)"
printf '1 MiB alone: %s s\n' "$(small)"
"$bin/sender" --connect "$addr" --quiet --dtype U8 --shape $((big_mib << 20)) "$work/big.bin" \
  > "$work/big.log" 2>&1 &
big=$!
during=()
while kill -0 "$big" 2>/dev/null; do during+=("$(small)"); done
wait "$big"
# The big tensor is complete (spooled and synced); its file is assembled now.
saving=()
while ! grep -q "saved .*big.safetensors" "$work/receiver.log"; do
  saving+=("$(small)")
  [ "${#saving[@]}" -lt 200 ] || break
done
printf '1 MiB while %d MiB lands: %s s\n' "$big_mib" "${during[*]:-none}"
printf '1 MiB while %d MiB is saved: %s s\n' "$big_mib" "${saving[*]:-none}"
grep -q "saved .*big.safetensors" "$work/receiver.log" || { echo "big file not saved"; exit 1; }
