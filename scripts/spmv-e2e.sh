#!/usr/bin/env bash
# The remote-execution walkthrough end to end on one GPU host, timed beside moving the same
# bytes with plain sender/receiver: y = A·x for a random CSR matrix (ROWS rows, NNZ
# non-zeros) run by `receiver --allow-exec`, checked against a CPU reference.
#
#   scripts/spmv-e2e.sh BIN_DIR SPMV_DIR [ROWS] [NNZ]
#
# BIN_DIR holds receiver, sender, tensorwire-exec, tensorwire-exec-worker and spmv;
# SPMV_DIR holds spmv.ptx. MTU (default 1200) is passed to every program as --mtu. Exits
# non-zero if anything fails or y is wrong.
set -euo pipefail
bin=$(cd "$1" && pwd)
spmv_dir=$(cd "$2" && pwd)
rows=${3:-1000000}
nnz=${4:-10000000}
mtu=${MTU:-1200}
work=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

wait_listening() { # LOG: prints the address once the receiver listens
  for _ in $(seq 100); do
    addr=$(sed -n 's/^listening on //p' "$1" | head -1)
    [ -n "$addr" ] && { echo "$addr"; return; }
    sleep 0.1
  done
  echo "the receiver did not start: $(cat "$1")" >&2
  return 1
}

"$bin/spmv" gen --rows "$rows" --nnz "$nnz" --out "$work/data"
"$bin/receiver" --listen 127.0.0.1:0 --mtu "$mtu" --device cuda:0 --require-gpu --allow-exec \
  --exec-worker "$bin/tensorwire-exec-worker" > "$work/exec-receiver.log" 2>&1 &
pids+=($!)
addr=$(wait_listening "$work/exec-receiver.log")
"$bin/tensorwire-exec" --connect "$addr" info
start=$(date +%s.%N)
"$bin/tensorwire-exec" --connect "$addr" --mtu "$mtu" run "$spmv_dir/spmv.ptx" --function spmv_csr \
  --grid $(( (rows + 255) / 256 )) --block 256 \
  --in values="$work/data/values.npy" --in col_indices="$work/data/col_indices.npy" \
  --in row_ptr="$work/data/row_ptr.npy" --in x="$work/data/x.npy" \
  --out y="f32:$rows" --scalar rows="i32:$rows" --save "$work/out" --repeat 3
end=$(date +%s.%N)
"$bin/spmv" check "$work/data" "$work/out/y.npy"
"$bin/tensorwire-exec" --connect "$addr" health

# The same bytes with the plain programs: inputs to a GPU receiver, y back to another.
"$bin/receiver" --listen 127.0.0.1:0 --mtu "$mtu" --device cuda:0 --require-gpu > "$work/plain.log" 2>&1 &
pids+=($!)
plain=$(wait_listening "$work/plain.log")
inputs=$(date +%s.%N)
"$bin/sender" --connect "$plain" --mtu "$mtu" --quiet "$work/data/values.npy" "$work/data/col_indices.npy" \
  "$work/data/row_ptr.npy" "$work/data/x.npy"
output=$(date +%s.%N)
"$bin/sender" --connect "$plain" --mtu "$mtu" --quiet "$work/out/y.npy"
done_at=$(date +%s.%N)
bytes=$(stat -c %s "$work/data/values.npy" "$work/data/col_indices.npy" "$work/data/row_ptr.npy" \
  "$work/data/x.npy" "$work/out/y.npy" | awk '{s += $1} END {print s}')
awk -v m="$mtu" -v r="$rows" -v n="$nnz" -v b="$bytes" -v e="$start" -v f="$end" -v i="$inputs" \
  -v o="$output" -v d="$done_at" 'BEGIN {
  printf "spmv %d rows, %d non-zeros: %.1f MB of .npy inputs and output, MTU %d\n", r, n, b / 1e6, m
  printf "  tensorwire-exec, 3 runs on one connection (incl. connect): %.3f s\n", f - e
  printf "  plain sender: inputs %.3f s + y %.3f s = %.3f s (two connections)\n", o - i, d - o, d - i
}'
