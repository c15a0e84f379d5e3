#!/usr/bin/env bash
# Soak: one receiver for MINUTES under a mix of normal senders, senders killed mid-transfer,
# stopped senders, and hostile peers (floods of METADATA, CANCEL and RESET_STREAM, one-byte
# DATA, silent connections). Samples the receiver's RSS every 10 s; at the end checks that it
# is alive, that every normal sender succeeded, and that a final transfer still works.
#
#   scripts/soak.sh MINUTES [BIN_DIR] [DEVICE]
#
# BIN_DIR holds receiver, sender and hostile-peer (cargo build --release -p
# tensorwire-examples); DEVICE is host (default) or cuda:N. Exit status 0 only if all held.
set -uo pipefail
minutes=${1:?minutes}
bin=$(cd "${2:-target/release}" && pwd)
device=${3:-host}
work=$(mktemp -d)
port=$((20000 + RANDOM % 20000))
addr=127.0.0.1:$port
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$work"' EXIT

"$bin/receiver" --listen "$addr" --device "$device" --budget-mib 64 --host-memory-mib 1024 \
  --admission-timeout-s 5 --progress-timeout-s 10 --connection-idle-timeout-s 10 \
  > "$work/receiver.log" 2>&1 &
receiver=$!
sleep 1
for size in 1 7 33; do head -c $((size << 20)) /dev/urandom > "$work/t$size.bin"; done

rss() { ps -o rss= -p "$receiver" 2>/dev/null | tr -d ' '; }
send() { # size: a normal sender; its failure is a soak failure, logged with its output
  local log="$work/sender-$BASHPID.log"
  if "$bin/sender" --connect "$addr" --quiet --dtype U8 --shape $(($1 << 20)) "$work/t$1.bin" \
    > "$log" 2>&1; then
    echo ok >> "$work/normal-status"
  else
    echo failed >> "$work/normal-status"; { echo "normal sender failed:"; cat "$log"; } >> "$work/failures.log"
  fi
  rm -f "$log"
}
end=$((SECONDS + minutes * 60))
next_sample=0
killed=0; hostile=0; round=0
: > "$work/normal-status"
echo "time_s rss_kib" > "$work/rss.txt"
while [ $SECONDS -lt $end ]; do
  round=$((round + 1))
  if [ $SECONDS -ge $next_sample ]; then
    echo "$SECONDS $(rss)" >> "$work/rss.txt"; next_sample=$((SECONDS + 10))
  fi
  kill -0 "$receiver" 2>/dev/null || { echo "receiver died"; break; }
  # Two normal senders at once.
  pids=()
  for size in 1 33; do send $size & pids+=($!); done
  # One killed mid-transfer, one stopped for a while then killed.
  timeout -s KILL 0.1 "$bin/sender" --connect "$addr" --quiet --dtype U8 --shape $((33 << 20)) \
    "$work/t33.bin" >/dev/null 2>&1 &
  victim=$!
  "$bin/sender" --connect "$addr" --quiet --dtype U8 --shape $((7 << 20)) "$work/t7.bin" >/dev/null 2>&1 &
  stopped=$!
  disown $stopped
  sleep 0.1; kill -STOP $stopped 2>/dev/null
  killed=$((killed + 2))
  # One hostile peer, mode by round.
  modes=(metadata-flood cancel-flood reset-flood tiny-data silent)
  mode=${modes[$((round % 5))]}
  "$bin/hostile-peer" --connect "$addr" --mode "$mode" --seconds 2 --claim $((4 << 20)) \
    >> "$work/hostile.log" 2>&1
  hostile=$((hostile + 1))
  kill -9 $stopped 2>/dev/null
  { wait "${pids[@]}" $victim; } 2>/dev/null
done
normal=$(wc -l < "$work/normal-status")
normal_failed=$(grep -c failed "$work/normal-status")
echo "$SECONDS $(rss)" >> "$work/rss.txt"
alive=no; kill -0 "$receiver" 2>/dev/null && alive=yes
final=failed; before=$(grep -c ok "$work/normal-status"); send 7
[ "$(grep -c ok "$work/normal-status")" -gt "$before" ] && final=ok
echo "soak: $minutes min, $round rounds, $normal normal transfers ($normal_failed failed), $killed killed/stopped senders, $hostile hostile runs"
echo "receiver alive: $alive; final transfer: $final"
[ -s "$work/failures.log" ] && head -40 "$work/failures.log"
awk 'NR > 1 { if (min == "" || $2 < min) min = $2; if ($2 > max) max = $2; last = $2 }
     END { printf "RSS KiB: min %d, max %d, last %d (samples every 10 s)\n", min, max, last }' "$work/rss.txt"
cp "$work/rss.txt" "${SOAK_RSS_OUT:-/dev/null}" 2>/dev/null || true
[ "$alive" = yes ] && [ "$final" = ok ] && [ "$normal_failed" -eq 0 ]
