#!/usr/bin/env bash
# One `sender` command with N connections into one `receiver`, as a user pushing a model runs
# them, beside raw quinn over the same number of connections in the same run.
#
#   benches/one-sender.sh BIN_DIR [CONNECTIONS] [TENSORS] [MIB_PER_TENSOR] [DEVICE]
#
# Generates a safetensors file of TENSORS × MIB_PER_TENSOR random U8 tensors (default
# 16 × 256 MiB = 4 GiB), starts `receiver --device DEVICE` (default cuda:0; host for host
# memory), sends the file with `sender --connections CONNECTIONS` (default 8), and prints
# the rate beside raw quinn's (both sides in one process, and as two processes like the
# programs), each sending the same file and, as the anchors of earlier figures did, a
# cache-hot buffer, and the ratios, with the CPU seconds per GiB both sides of each spent
# (all threads of each process). Every tensor is checked end to end by its
# CRC-32C before the receiver says COMPLETE. BIN_DIR holds receiver, sender and bench.
# RECEIVER_FLAGS adds receiver flags (e.g. "--steering address"), SENDER_FLAGS the sender's
# (e.g. "--no-split"), RAW_SERVER_FLAGS the raw quinn server's. With one tensor
# (TENSORS=1), the sender splits it over its connections (spec §15) unless told not to.
# ROUNDS=N (default 1) repeats the programs and the anchors N times on the same file, and
# then prints the median rate and the median of the rounds' ratios: on one host, single
# runs of a few seconds spread by 20% or more.
set -euo pipefail
. "$(dirname "$0")/common.sh"
bin=$(cd "$1" && pwd)
connections=${2:-8}
tensors=${3:-16}
mib=${4:-256}
device=${5:-cuda:0}
rounds=${ROUNDS:-1}
work=$(mktemp -d)
trap 'stop_jobs; rm -rf "$work"' EXIT

random_safetensors "$work/model.safetensors" "$tensors" "$mib"

total_mib=$((tensors * mib))
each=$((total_mib / connections))
failed=0
# One round: the programs, then the raw quinn anchors on the same file, so that each ratio
# compares runs a few seconds apart. Appends this round's figures to the arrays below.
sent=() ratio_process=() ratio_shared=() ratio_processes=() cpu_ratio=()
one_round() {
  local receiver start end gbit raw raw_hot raw_shared raw_shared_hot raw_procs raw_procs_hot
  local to_process to_shared to_processes
  : > "$work/receiver.log"
  with_cpu_time "$work/receiver.cpu" "$work/receiver.log" \
    "$bin/receiver" --listen 127.0.0.1:0 --mtu "$MTU" --device "$device" --count "$tensors" \
    ${RECEIVER_FLAGS:-} &
  receiver=$!
  addr=$(listening_address "$work/receiver.log")
  start=$(date +%s.%N)
  with_cpu_time "$work/sender.cpu" "$work/sender.log" \
    "$bin/sender" --connect "$addr" --mtu "$MTU" --quiet --connections "$connections" \
    ${SENDER_FLAGS:-} "$work/model.safetensors" || failed=1
  end=$(date +%s.%N)
  wait "$receiver" || failed=1
  cat "$work/sender.log"
  grep -o "peak credit held.*" "$work/receiver.log" || true
  gbit=$(awk -v b="$total_mib" -v s="$start" -v e="$end" 'BEGIN { printf "%.2f", b * 1048576 * 8 / (e - s) / 1e9 }')
  # Raw quinn sends the same file, mapped as `sender` maps it (each connection its own part),
  # and, as the anchors of earlier figures did, one 4 MiB buffer again and again, which stays
  # in the CPU's cache ("hot").
  read -r raw raw_hot < <(raw_quinn_in_process "$bin" "$connections" "$each" "$work/model.safetensors")
  # Raw quinn with every endpoint's work on one shared runtime (`--endpoint-threads caller`).
  read -r raw_shared raw_shared_hot < <(raw_quinn_in_process "$bin" "$connections" "$each" \
    "$work/model.safetensors" --endpoint-threads caller)
  # Raw quinn the way the programs run: one client process opening all the connections.
  raw_procs=$(raw_quinn_as_processes "$bin" "$work" 1 "$connections" "$each" "$work/model.safetensors")
  # CPU seconds per GiB moved, all threads of both processes: what the programs spend beside
  # raw quinn sending the same file as processes.
  local gib cpu_sender cpu_receiver cpu_client cpu_server
  gib=$(awk -v m="$total_mib" 'BEGIN { print m / 1024 }')
  cpu_sender=$(cpu_seconds "$work/sender.cpu")
  cpu_receiver=$(cpu_seconds "$work/receiver.cpu")
  cpu_client=$(cpu_seconds "$work"/raw-client-*.cpu)
  cpu_server=$(cpu_seconds "$work/raw-server.cpu")
  cpu_ratio+=("$(ratio_to "$(cpu_seconds "$work/sender.cpu" "$work/receiver.cpu")" \
    "$(cpu_seconds "$work"/raw-*.cpu)")")
  raw_procs_hot=$(raw_quinn_as_processes "$bin" "$work" 1 "$connections" "$each" hot)
  to_process=$(ratio_to "$gbit" "$raw")
  to_shared=$(ratio_to "$gbit" "$raw_shared")
  to_processes=$(ratio_to "$gbit" "$raw_procs")
  printf 'raw quinn, %d connections, sending the same file (hot): in one process %s (%s) Gbit/s, on one shared runtime %s (%s), as processes (1 server, 1 client) %s (%s)\n' \
    "$connections" "$raw" "$raw_hot" "$raw_shared" "$raw_shared_hot" "$raw_procs" "$raw_procs_hot"
  printf 'one sender / raw quinn sending the same file: %s in one process, %s on one shared runtime, %s as processes\n' \
    "$to_process" "$to_shared" "$to_processes"
  awk -v g="$gib" -v s="$cpu_sender" -v r="$cpu_receiver" -v c="$cpu_client" -v v="$cpu_server" \
    -v ratio="${cpu_ratio[-1]}" 'BEGIN {
    printf "CPU seconds per GiB: sender %.2f + receiver %.2f = %.2f; raw quinn as processes, client %.2f + server %.2f = %.2f; ratio %s\n",
      s / g, r / g, (s + r) / g, c / g, v / g, (c + v) / g, ratio }'
  printf 'one sender / raw quinn, hot: %s in one process, %s on one shared runtime, %s as processes\n' \
    "$(ratio_to "$gbit" "$raw_hot")" "$(ratio_to "$gbit" "$raw_shared_hot")" "$(ratio_to "$gbit" "$raw_procs_hot")"
  printf 'one sender, %d connections -> receiver (%s): %d x %d MiB in %.2f s: %.1f Gbit/s (%.2f GB/s); raw quinn %d connections: %s Gbit/s; ratio %s; %d failed\n' \
    "$connections" "$device" "$tensors" "$mib" "$(awk -v s="$start" -v e="$end" 'BEGIN{print e-s}')" \
    "$gbit" "$(awk -v g="$gbit" 'BEGIN{print g/8}')" "$connections" "${raw:-n/a}" "$to_process" "$failed"
  sent+=("$gbit")
  ratio_process+=("$to_process")
  ratio_shared+=("$to_shared")
  ratio_processes+=("$to_processes")
}

for round in $(seq "$rounds"); do
  [ "$rounds" -eq 1 ] || echo "round $round of $rounds"
  one_round
done
if [ "$rounds" -gt 1 ]; then
  printf 'one sender over %d rounds: median %s Gbit/s (%s to %s); / raw quinn, the median of the rounds'"'"' ratios: %s in one process, %s on one shared runtime, %s as processes\n' \
    "$rounds" "$(median "${sent[@]}")" "$(minimum "${sent[@]}")" "$(maximum "${sent[@]}")" \
    "$(median "${ratio_process[@]}")" "$(median "${ratio_shared[@]}")" "$(median "${ratio_processes[@]}")"
  printf 'CPU per byte, the programs / raw quinn as processes, the median of the rounds: %s\n' \
    "$(median "${cpu_ratio[@]}")"
fi
[ "$failed" -eq 0 ]
