#!/usr/bin/env bash
# tensorwire (cubic and bbr) beside TCP + TLS on one long lossy path, with no netem: in a
# private network namespace, scripts/tun-path.py delays and drops IP packets of every
# protocol alike. Needs unprivileged user namespaces (or root), /dev/net/tun, `ip`, openssl
# and python3.
#
#   scripts/lossy-tun.sh [BIN_DIR] [MIB] [DELAY_MS_EACH_WAY] [LOSS_PERCENT]
#
# BIN_DIR holds receiver and sender (cargo build --release -p tensorwire-examples). TCP + TLS
# is Python's ssl over the kernel's TCP (its default congestion control, usually cubic),
# TLS 1.3 with a throwaway self-signed certificate. LIMIT_S bounds each transfer
# (default 600). Prints one line per measurement.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin=$(cd "${1:-target/release}" && pwd)
mib=${2:-16}
delay=${3:-50}
loss=${4:-1}
limit=${LIMIT_S:-600}
if [ "${TW_IN_NETNS:-}" != 1 ]; then
  exec unshare -rn env TW_IN_NETNS=1 bash "$0" "$bin" "$mib" "$delay" "$loss"
fi
ip link set lo up
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
python3 "$here/tun-path.py" tw0 "$delay" "$loss" > "$work/path.log" 2>&1 &
for _ in $(seq 50); do grep -q ready "$work/path.log" && break; sleep 0.1; done
grep -q ready "$work/path.log" || { cat "$work/path.log"; exit 1; }
head -c $((mib << 20)) /dev/urandom > "$work/t.bin"
path="$mib MiB over RTT $((2 * delay)) ms, $loss% loss each way"

report() { # what, start, end, result
  awk -v w="$1" -v s="$2" -v e="$3" -v r="$4" -v p="$path" -v m="$mib" \
    'BEGIN { printf "%s, %s: %s in %.1f s (%.2f MiB/s)\n", w, p, r, e - s, m / (e - s) }'
}

for cc in cubic bbr; do
  port=$((30000 + RANDOM % 10000))
  "$bin/receiver" --listen "10.9.0.1:$port" --device host --count 1 --endpoints 1 \
    --congestion "$cc" > "$work/receiver-$cc.log" 2>&1 &
  receiver=$!
  for _ in $(seq 100); do grep -q "listening on" "$work/receiver-$cc.log" && break; sleep 0.1; done
  ca="${TMPDIR:-/tmp}/tensorwire-dev-$(id -u)/receiver-10.9.0.1-$port.pem"
  start=$(date +%s.%N)
  if timeout "$limit" "$bin/sender" --connect "10.9.0.2:$port" --ca "$ca" --quiet \
      --congestion "$cc" --dtype U8 --shape $((mib << 20)) "$work/t.bin" \
      > "$work/sender-$cc.log" 2>&1; then
    result=completed
  else
    result="FAILED: $(grep -h "failed:\|Error" "$work/sender-$cc.log" | head -1)"
  fi
  report "tensorwire programs, $cc" "$start" "$(date +%s.%N)" "$result"
  wait "$receiver" 2>/dev/null || true
done

# TCP + TLS 1.3: a server on 10.9.0.1 reads MIB MiB and answers one byte; the client on the
# other end of the path sends them.
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 1 -subj /CN=localhost \
  -addext subjectAltName=DNS:localhost -keyout "$work/key.pem" -out "$work/cert.pem" 2>/dev/null
available=$(cat /proc/sys/net/ipv4/tcp_available_congestion_control 2>/dev/null || echo cubic)
for cc in cubic bbr; do
  case " $available " in *" $cc "*) ;; *) echo "TCP + TLS 1.3 ($cc): not available in this kernel"; continue ;; esac
  python3 "$here/tls-sink.py" serve "$work/cert.pem" "$work/key.pem" 10.9.0.1 31999 $((mib << 20)) \
    > "$work/tls-server.log" 2>&1 &
  server=$!
  sleep 0.5
  start=$(date +%s.%N)
  if timeout "$limit" python3 "$here/tls-sink.py" send "$work/cert.pem" 10.9.0.2 31999 \
      "$work/t.bin" "$cc" > "$work/tls-client.log" 2>&1; then
    result=completed
  else
    result="FAILED: $(tail -1 "$work/tls-client.log")"
  fi
  report "TCP + TLS 1.3, $cc" "$start" "$(date +%s.%N)" "$result"
  kill "$server" 2>/dev/null || true
  wait "$server" 2>/dev/null || true
done
