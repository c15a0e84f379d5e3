#!/usr/bin/env bash
# The shipped programs as users run them, beside raw quinn in the same run: one `receiver`
# (N endpoints, one budget) fed by S `sender` processes on loopback, each sending one file.
#
#   benches/scale.sh BIN_DIR [SENDERS] [MIB_PER_SENDER] [DEVICE] [ENDPOINTS]
#
# RECEIVER_FLAGS adds receiver flags (e.g. "--stream-window-mib 64"), SENDER_FLAGS each
# sender's (e.g. "--endpoint-threads caller"); BUDGET_MIB sets its
# budget (default 512). RECEIVER_ENV and SENDER_ENV set environment variables for each side
# (e.g. SENDER_ENV="TOKIO_WORKER_THREADS=2"). BIN_DIR holds receiver, sender and bench (cargo build --release -p
# tensorwire-examples -p tensorwire-bench). DEVICE: cuda:0 (default) or host. Prints one line
# per measurement: the rate, each side's CPU seconds per GiB, how busy the machine was, and
# UDP datagrams the kernel dropped for want of socket buffer; then raw quinn's rate and CPU,
# both sides in one process (bench: endpoints on threads of their own, then on one shared
# runtime), and as processes like the programs', each sending the same files and, as the
# anchors of earlier figures did, a cache-hot buffer; last, the programs' ratio to each.
set -euo pipefail
. "$(dirname "$0")/common.sh"
bin=$(cd "$1" && pwd)
senders=${2:-8}
mib=${3:-2048}
device=${4:-cuda:0}
endpoints=${5:-0}
budget_mib=${BUDGET_MIB:-512}
work=$(mktemp -d)
trap 'stop_jobs; rm -rf "$work"' EXIT

for i in $(seq "$senders"); do
  head -c $((mib << 20)) /dev/urandom > "$work/t$i.bin"
done
# CPU seconds of each process (`with_cpu_time`), the whole machine's busy share
# (/proc/stat), and UDP datagrams the kernel dropped for want of socket buffer
# (/proc/net/snmp).
busy() { awk '/^cpu /{print $2+$3+$4+$7+$8, $5+$6}' /proc/stat 2>/dev/null; }
udp_drops() { awk '/^Udp:/ && $2 ~ /^[0-9]/ {print $6}' /proc/net/snmp 2>/dev/null; }
with_cpu_time "$work/receiver.cpu" "$work/receiver.log" \
  env ${RECEIVER_ENV:-} "$bin/receiver" --listen 127.0.0.1:0 --mtu "$MTU" --device "$device" \
  --endpoints "$endpoints" --budget-mib "$budget_mib" --count "$senders" ${RECEIVER_FLAGS:-} &
receiver=$!
addr=$(listening_address "$work/receiver.log")
read -r busy0 idle0 < <(busy) || true
drops0=$(udp_drops)
start=$(date +%s.%N)
pids=()
for i in $(seq "$senders"); do
  with_cpu_time "$work/sender-$i.cpu" "$work/sender-$i.log" \
    env ${SENDER_ENV:-} "$bin/sender" --connect "$addr" --mtu "$MTU" --quiet --connections 1 --dtype U8 \
    --shape $((mib << 20)) ${SENDER_FLAGS:-} "$work/t$i.bin" &
  pids+=($!)
done
failed=0
for pid in "${pids[@]}"; do wait "$pid" || failed=$((failed + 1)); done
end=$(date +%s.%N)
read -r busy1 idle1 < <(busy) || true
drops1=$(udp_drops)
wait "$receiver" || failed=$((failed + 1))
total=$((senders * mib))
gbit=$(awk -v b="$total" -v s="$start" -v e="$end" 'BEGIN { print b * 1048576 * 8 / (e - s) / 1e9 }')
printf 'programs: 1 receiver (%s, endpoints %s) <- %d senders x %d MiB: %.1f Gbit/s, %d failed\n' \
  "$device" "$(sed -n 's/ endpoints.*//p' "$work/receiver.log")" "$senders" "$mib" "$gbit" "$failed"
gib=$(awk -v m="$total" 'BEGIN { print m / 1024 }')
# CPU seconds, and per GiB moved: "LABEL: S s (P per GiB)".
print_cpu() {
  awk -v l="$1" -v c="$2" -v g="$gib" 'BEGIN { printf "CPU: %s %.2f s (%.2f per GiB)\n", l, c, c / g }'
}
print_cpu receiver "$(cpu_seconds "$work/receiver.cpu")"
print_cpu senders "$(cpu_seconds "$work"/sender-*.cpu)"
if [ -n "${busy0:-}" ] && [ -n "${busy1:-}" ]; then
  awk -v b="$((busy1 - busy0))" -v i="$((idle1 - idle0))" -v n="$(nproc)" \
    'BEGIN { printf "machine busy while sending: %.0f%% of %d cores\n", 100 * b / (b + i), n }'
fi
[ -n "$drops0" ] && echo "UDP datagrams dropped for want of socket buffer: $((drops1 - drops0))"
grep -h "failed:" "$work"/sender-*.log || true
grep -o "peak credit held.*" "$work/receiver.log" || true
grep -E "tensors land|Error|error" "$work/receiver.log" | head -5 || true
# Raw quinn sends the senders' files, mapped as `sender` maps them (in one process, each
# connection its own part of the first file), and, as the anchors of earlier figures did,
# one 4 MiB buffer again and again, which stays in the CPU's cache ("hot").
with_cpu_time "$work/bench.cpu" "$work/raw-one" raw_quinn_in_process "$bin" "$senders" "$mib" "$work/t1.bin"
read -r raw_one raw_one_hot < "$work/raw-one"
printf 'raw quinn, both sides in one process, endpoints on threads of their own: %s Gbit/s; hot %s\n' \
  "$raw_one" "$raw_one_hot"
# Raw quinn with every endpoint's work on the bench's one runtime (`--endpoint-threads
# caller`), as quinn applications often run it: the faster anchor on some hosts.
read -r raw_shared raw_shared_hot < <(raw_quinn_in_process "$bin" "$senders" "$mib" \
  "$work/t1.bin" --endpoint-threads caller)
printf 'raw quinn, endpoints on one shared runtime: %s Gbit/s; hot %s\n' \
  "$raw_shared" "$raw_shared_hot"
awk -v g="$gib" -v c="$(cpu_seconds "$work/bench.cpu")" 'BEGIN { printf "CPU: raw quinn, both sides in one process, both sources %.2f s (%.2f per GiB, setup included)\n", c, c / g / 2 }'

# Raw quinn the way the programs run: one client process per sender, timed the same way.
files=()
for i in $(seq "$senders"); do files+=("$work/t$i.bin"); done
raw_gbit=$(raw_quinn_as_processes "$bin" "$work" "$senders" 1 "$mib" "${files[@]}")
raw_cpu=$(cpu_seconds "$work"/raw-*.cpu)
raw_gbit_hot=$(raw_quinn_as_processes "$bin" "$work" "$senders" 1 "$mib" hot)
printf 'raw quinn as processes: 1 server (%d endpoints) <- %d clients x %d MiB: %.1f Gbit/s; hot %.1f\n' \
  "$senders" "$senders" "$mib" "$raw_gbit" "$raw_gbit_hot"
print_cpu "raw quinn as processes, clients and server, sending the same files" "$raw_cpu"
printf 'programs / raw quinn sending the same files: %s in one process, %s on one shared runtime, %s as processes\n' \
  "$(ratio_to "$gbit" "$raw_one")" "$(ratio_to "$gbit" "$raw_shared")" "$(ratio_to "$gbit" "$raw_gbit")"
printf 'programs / raw quinn, hot: %s in one process, %s on one shared runtime, %s as processes\n' \
  "$(ratio_to "$gbit" "$raw_one_hot")" "$(ratio_to "$gbit" "$raw_shared_hot")" "$(ratio_to "$gbit" "$raw_gbit_hot")"
[ "$failed" -eq 0 ]
