#!/usr/bin/env bash
# A long lossy path on one host: a UDP relay (scripts/udp-relay.py) delays every datagram and
# drops some. Sends one tensor with each congestion controller and reports time and rate; a
# tensor that still makes progress must not fail (the sender's progress timeout counts
# acknowledgements, not only frames).
#
#   scripts/lossy-path.sh [BIN_DIR] [MIB] [DELAY_MS_EACH_WAY] [LOSS_PERCENT]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin=$(cd "${1:-target/release}" && pwd)
mib=${2:-16}
delay=${3:-50}
loss=${4:-1}
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
head -c $((mib << 20)) /dev/urandom > "$work/t.bin"
status=0
for cc in cubic bbr; do
  port=$((30000 + RANDOM % 10000)); relay=$((port + 1))
  "$bin/receiver" --listen "127.0.0.1:$port" --device host --count 1 --endpoints 1 \
    --congestion "$cc" > "$work/receiver-$cc.log" 2>&1 &
  for _ in $(seq 100); do grep -q "listening on" "$work/receiver-$cc.log" && break; sleep 0.1; done
  python3 "$here/udp-relay.py" "$relay" "$port" "$delay" "$loss" > "$work/relay-$cc.log" 2>&1 &
  relay_pid=$!
  sleep 0.5
  ca="${TMPDIR:-/tmp}/tensorwire-dev-$(id -u)/receiver-$port.pem"
  start=$(date +%s.%N)
  if timeout 900 "$bin/sender" --connect "127.0.0.1:$relay" --ca "$ca" --quiet \
      --congestion "$cc" --dtype U8 --shape $((mib << 20)) "$work/t.bin" > "$work/sender-$cc.log" 2>&1; then
    result=completed
  else
    result="FAILED: $(grep -h "failed:" "$work/sender-$cc.log" | head -1)"; status=1
  fi
  end=$(date +%s.%N)
  awk -v cc="$cc" -v m="$mib" -v s="$start" -v e="$end" -v r="$result" -v d="$delay" -v l="$loss" \
    'BEGIN { printf "%s: %d MiB over RTT %d ms, %s%% loss each way: %s in %.1f s (%.2f MiB/s)\n", cc, m, 2 * d, l, r, e - s, m / (e - s) }'
  kill "$relay_pid" 2>/dev/null || true
  wait 2>/dev/null || true
done
exit $status
