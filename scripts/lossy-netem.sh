#!/usr/bin/env bash
# A long lossy path in a private network namespace: netem on its loopback delays and drops
# packets of every protocol alike, so tensorwire (cubic and bbr), raw quinn and TCP + TLS
# are measured on the same path. Needs unprivileged user namespaces (or root) and the
# kernel's netem qdisc (sch_netem); scripts/lossy-path.sh is the UDP-only fallback.
#
#   scripts/lossy-netem.sh [BIN_DIR] [MIB] [DELAY_MS_EACH_WAY] [LOSS_PERCENT]
#
# BIN_DIR holds receiver, sender and bench (cargo build --release -p tensorwire-examples
# -p tensorwire-bench); LIMIT_S bounds each transfer (default 600). Prints one line per
# measurement.
set -euo pipefail
bin=$(cd "${1:-target/release}" && pwd)
mib=${2:-16}
delay=${3:-50}
loss=${4:-1}
if [ "${TW_IN_NETNS:-}" != 1 ]; then
  exec unshare -rn env TW_IN_NETNS=1 bash "$0" "$bin" "$mib" "$delay" "$loss"
fi
ip link set lo up
tc qdisc add dev lo root netem delay "${delay}ms" loss "${loss}%" || {
  echo "netem is not available here (kernel module sch_netem); use scripts/lossy-path.sh" >&2
  exit 1
}
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
head -c $((mib << 20)) /dev/urandom > "$work/t.bin"
path="$mib MiB over RTT $((2 * delay)) ms, $loss% loss each way"

for cc in cubic bbr; do
  "$bin/receiver" --listen 127.0.0.1:0 --device host --count 1 --endpoints 1 \
    --congestion "$cc" > "$work/receiver-$cc.log" 2>&1 &
  for _ in $(seq 100); do grep -q "listening on" "$work/receiver-$cc.log" && break; sleep 0.1; done
  addr=$(sed -n 's/^listening on //p' "$work/receiver-$cc.log")
  start=$(date +%s.%N)
  if timeout "${LIMIT_S:-600}" "$bin/sender" --connect "$addr" --quiet --congestion "$cc" --dtype U8 \
      --shape $((mib << 20)) "$work/t.bin" > "$work/sender-$cc.log" 2>&1; then
    result=completed
  else
    result="FAILED: $(grep -h "failed:\|Error" "$work/sender-$cc.log" | head -1)"
  fi
  end=$(date +%s.%N)
  awk -v cc="$cc" -v s="$start" -v e="$end" -v r="$result" -v p="$path" -v m="$mib" \
    'BEGIN { printf "tensorwire programs, %s: %s: %s in %.1f s (%.2f MiB/s)\n", cc, p, r, e - s, m / (e - s) }'
  wait 2>/dev/null || true
done
for transport in raw-quinn tcp-tls; do
  echo "bench $transport (cubic), $path:"
  timeout "${LIMIT_S:-600}" "$bin/bench" --only "$transport" --connections 1 --mib "$mib" --runs 1 2>&1 \
    | grep -E "^ +(raw quinn|TCP\+TLS) +[0-9]+ " | grep -v NaN || echo "  did not finish in ${LIMIT_S:-600} s"
done
