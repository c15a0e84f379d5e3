#!/usr/bin/env bash
# Hostile peers against one receiver on loopback, one case at a time: for each, the
# receiver's peak and settled memory (VmHWM and VmRSS from /proc), whether a legitimate
# 16 MiB send from another peer address still succeeds during the attack, and how long it
# took. The receiver runs with --budget-mib 64 --host-memory-mib 256, so its documented
# bound is about 64 + 256 + 64 (METADATA) + 512 connections x 0.5 MiB, plus QUIC buffers.
#
#   scripts/hostile-suite.sh [BIN_DIR] [SECONDS]
#
# BIN_DIR holds receiver, sender and hostile-peer (cargo build --release -p
# tensorwire-examples). Every loop is bounded; the exit status is 0 only if every
# legitimate send succeeded and the receiver stayed up.
set -uo pipefail
bin=$(cd "${1:-target/release}" && pwd)
seconds=${2:-10}
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null; wait 2>/dev/null; rm -rf "$work"' EXIT
head -c $((16 << 20)) /dev/urandom > "$work/legit.bin"
status=0

mib() { awk -v k="$1" 'BEGIN { printf "%.0f", k / 1024 }'; }
field() { awk -v f="$2:" '$1 == f { print $2 }' "/proc/$1/status" 2>/dev/null; }

start_receiver() {
  port=$((20000 + RANDOM % 20000))
  addr=127.0.0.1:$port
  "$bin/receiver" --listen "$addr" --device host --budget-mib 64 --host-memory-mib 256 \
    "$@" > "$work/receiver.log" 2>&1 &
  receiver=$!
  for _ in $(seq 100); do grep -q "listening on" "$work/receiver.log" && return; sleep 0.1; done
  echo "the receiver did not start" >&2; exit 1
}

# A legitimate sender (from 127.0.0.1; the attackers use 127.0.0.3 and up), during the attack.
legit() {
  local started=$SECONDS
  if "$bin/sender" --connect "$addr" --quiet --dtype U8 --shape $((16 << 20)) \
    "$work/legit.bin" > "$work/legit.log" 2>&1; then
    echo "ok in $((SECONDS - started)) s"
  else
    echo "FAILED after $((SECONDS - started)) s: $(grep -v WARN "$work/legit.log" | tail -1)"
  fi
}

report() { # CASE: one row, then the receiver stops
  local row=$1 outcome=$2
  case "$outcome" in FAILED*) status=1 ;; esac
  sleep 8 # past the idle timeout (6 s): the burst's connections end; memory is counted after
  local peak rss
  peak=$(mib "$(field "$receiver" VmHWM)")
  rss=$(mib "$(field "$receiver" VmRSS)")
  if ! kill -0 "$receiver" 2>/dev/null; then
    outcome="$outcome; RECEIVER DIED"
    status=1
  fi
  printf '| %s | %s MiB | %s MiB | %s |\n' "$row" "$peak" "$rss" "$outcome"
  kill "$receiver" 2>/dev/null
  wait "$receiver" 2>/dev/null
}

echo "| case | peak RSS | RSS 8 s after | legitimate 16 MiB send |"
echo "| --- | --- | --- | --- |"

# CASE SETUP: a fresh receiver, SETUP (a function that starts the attackers in the
# background), a legitimate send halfway through, then the row once the attackers are done.
attack() {
  local row=$1 setup=$2 outcome
  start_receiver
  "$setup"
  sleep $((seconds / 2))
  outcome=$(legit)
  wait $(jobs -p | grep -v "^$receiver$") 2>/dev/null
  report "$row" "$outcome"
}

# 2000 idle connections from 32 peer addresses (64 per peer, 512 in all, peers in turn).
idle_connections() {
  for i in $(seq 3 34); do
    "$bin/hostile-peer" --connect "$addr" --from "127.0.0.$i" --mode silent \
      --connections 63 --seconds "$seconds" > "$work/silent-$i.log" 2>&1 &
  done
}
# METADATA with 64 x 1000-byte attributes on 8 connections, from 8 peers.
large_metadata() {
  for i in $(seq 3 10); do
    "$bin/hostile-peer" --connect "$addr" --from "127.0.0.$i" --mode metadata-flood \
      --claim 1 --attributes 64 --attribute-bytes 1000 --seconds "$seconds" \
      > "$work/metadata-$i.log" 2>&1 &
  done
}
# Streams claiming 1 GiB each, never sending DATA, from one peer.
large_claims() {
  "$bin/hostile-peer" --connect "$addr" --from 127.0.0.3 --mode metadata-flood \
    --claim $((1 << 30)) --seconds "$seconds" > "$work/claims.log" 2>&1 &
}
# METADATA claiming 1 MiB each (accepted, granted credit, never sent) on 10 connections of
# one peer: its share of credit and memory, not all of it.
idle_claims() {
  for i in $(seq 10); do
    "$bin/hostile-peer" --connect "$addr" --from 127.0.0.3 --mode metadata-flood \
      --claim $((1 << 20)) --seconds "$seconds" > "$work/idle-claims-$i.log" 2>&1 &
  done
}
# CANCEL flood: the connection is closed with CANCEL_FLOOD.
cancel_flood() {
  "$bin/hostile-peer" --connect "$addr" --from 127.0.0.3 --mode cancel-flood \
    --seconds "$seconds" > "$work/cancel.log" 2>&1 &
}

# Not an attack: 64 sender processes at once, 3 x 16 MiB each, all from one address.
many_senders() {
  for i in $(seq 64); do
    "$bin/sender" --connect "$addr" --quiet --dtype U8 --shape $((16 << 20)) \
      "$work/legit.bin" "$work/legit.bin" "$work/legit.bin" > "$work/many-$i.log" 2>&1 &
  done
}

attack "2000 idle connections, 32 peers" idle_connections
attack "8 peers x METADATA floods, 64 KB each" large_metadata
attack "1 GiB claims without DATA" large_claims
attack "1 MiB claims without DATA, 10 connections of one peer" idle_claims
attack "CANCEL flood" cancel_flood
attack "64 senders x 3 x 16 MiB at once" many_senders
failed_senders=$(grep -L "sent 3 of 3" "$work"/many-*.log 2>/dev/null | wc -l)
echo "64 senders: $failed_senders did not deliver all 3 tensors"
[ "$failed_senders" = 0 ] || status=1

for log in "$work"/silent-3.log "$work"/metadata-3.log "$work"/cancel.log; do
  echo "--- $(basename "$log")"; cat "$log"
done
exit $status
