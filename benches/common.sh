# Helpers sourced by the benchmark scripts in this folder.

# The UDP payload size every QUIC program and anchor of a script uses (1200 to 65507):
# 6000 by default, as every figure before "Larger packets" in benches/results/LOG.md; MTU=65507
# is what loopback carries, and what the programs pick there without --mtu.
MTU=${MTU:-6000}

# Waits up to 10 s for `listening on ADDR` in LOG (written by a program starting in the
# background) and prints ADDR; prints the log and fails if it never comes. Empty LOG before
# starting the program (`: > LOG`): the background job truncates it only once it runs, and
# until then an earlier run's address would be read (a sender then failed at once against
# a receiver that had exited).
listening_address() {
  local log=$1 addr
  for _ in $(seq 100); do grep -q "listening on" "$log" && break; sleep 0.1; done
  addr=$(sed -n 's/^listening on //p' "$log" | head -1)
  [ -n "$addr" ] || { cat "$log" >&2; return 1; }
  echo "$addr"
}

# Runs COMMAND... with its output to LOG, and writes the CPU seconds the process used (user
# and system, all its threads) to CPU_FILE as "cpu USER SYSTEM". Run it in the background
# (`&`) for a server; `wait` on it then waits for COMMAND too.
#
#   with_cpu_time CPU_FILE LOG COMMAND...
with_cpu_time() {
  local cpu_file=$1 log=$2
  shift 2
  local TIMEFORMAT='cpu %U %S'
  { time "$@" > "$log" 2>&1; } 2> "$cpu_file"
}

# Stops the script's background jobs and what they started (a job run through
# `with_cpu_time` is a subshell whose child is the program): for an EXIT trap.
stop_jobs() {
  local job
  for job in $(jobs -p); do
    pkill -P "$job" 2>/dev/null || true
    kill "$job" 2>/dev/null || true
  done
}

# The CPU seconds (user + system) in the "cpu USER SYSTEM" lines of FILEs, summed.
#
#   cpu_seconds FILE...
cpu_seconds() {
  cat "$@" 2>/dev/null | awk '$1 == "cpu" { s += $2 + $3 } END { printf "%.2f\n", s }'
}

# Raw quinn the way the programs run: one `bench --raw-server` process with one endpoint
# per connection on one port, fed by PROCESSES `bench --raw-client` processes of
# CONNECTIONS_EACH connections, MIB_EACH MiB per connection, each client on two tokio
# workers per connection as `sender` runs. Prints the rate in Gbit/s, from the first
# client's start to the last one's exit. The CPU seconds its processes used go to
# WORK_DIR/raw-server.cpu and raw-client-N.cpu (`cpu_seconds` sums them).
# RAW_SERVER_FLAGS adds server flags (e.g. "--steering address"). Client i sends the ith
# SOURCE (the last one where fewer are given): a file, mapped as `sender` maps the files it
# sends, or `hot`, one 4 MiB buffer again and again, which stays in the CPU's cache (the
# anchor of earlier figures).
#
#   raw_quinn_as_processes BIN_DIR WORK_DIR PROCESSES CONNECTIONS_EACH MIB_EACH SOURCE...
raw_quinn_as_processes() {
  local bin=$1 work=$2 processes=$3 each=$4 mib=$5
  shift 5
  local sources=("$@")
  local connections=$((processes * each)) workers=$((2 * each)) server addr start end
  [ "$workers" -le "$(nproc)" ] || workers=$(nproc)
  rm -f "$work"/raw-*.cpu
  : > "$work/raw-server.log"
  with_cpu_time "$work/raw-server.cpu" "$work/raw-server.log" \
    "$bin/bench" --raw-server "$work/raw.der" --connections "$connections" --mtu "$MTU" \
    ${RAW_SERVER_FLAGS:-} &
  server=$!
  addr=$(listening_address "$work/raw-server.log")
  start=$(date +%s.%N)
  local pids=() failed=0
  local source
  for i in $(seq "$processes"); do
    source=${sources[$((i <= ${#sources[@]} ? i - 1 : ${#sources[@]} - 1))]}
    TOKIO_WORKER_THREADS=$workers with_cpu_time "$work/raw-client-$i.cpu" "$work/raw-client-$i.log" \
      "$bin/bench" --raw-client "$addr" --cert "$work/raw.der" \
      --connections "$each" --mtu "$MTU" --mib "$mib" --source "$source" &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
  end=$(date +%s.%N)
  wait "$server" || failed=1
  [ "$failed" -eq 0 ] || { cat "$work"/raw-*.log >&2; return 1; }
  awk -v b="$((connections * mib))" -v s="$start" -v e="$end" \
    'BEGIN { printf "%.1f\n", b * 1048576 * 8 / (e - s) / 1e9 }'
}

# Raw quinn with both sides in one process (`bench --only raw-quinn,raw-quinn-hot`, one
# run): CONNECTIONS connections of MIB_EACH MiB sending SOURCE (a file, each connection its
# own part), then, beside it, one 4 MiB buffer that stays in the CPU's cache. Prints both
# rates in Gbit/s, "SAME HOT", n/a for a rate that did not come. BENCH_ARGS go to bench as
# they are (e.g. --endpoint-threads caller).
#
#   raw_quinn_in_process BIN_DIR CONNECTIONS MIB_EACH SOURCE [BENCH_ARGS...]
raw_quinn_in_process() {
  local bin=$1 connections=$2 mib=$3 source=$4 log
  shift 4
  log=$("$bin/bench" --only raw-quinn,raw-quinn-hot --connections "$connections" --mtu "$MTU" --runs 1 \
    --mib "$mib" --source "$source" "$@" 2>&1) || true
  awk '/^ *raw quinn +[0-9]/ { same = $4 } /^ *raw quinn, hot +[0-9]/ { hot = $5 }
    END { print (same == "" ? "n/a" : same), (hot == "" ? "n/a" : hot) }' <<< "$log"
}

# RATE / ANCHOR to two decimals, n/a where the anchor did not come (empty, n/a or 0).
#
#   ratio_to RATE ANCHOR
ratio_to() {
  awk -v t="$1" -v r="${2:-0}" 'BEGIN { if (r + 0 > 0) printf "%.2f", t / r; else print "n/a" }'
}

# The median, least and greatest of numbers, ignoring n/a; n/a where none is left.
#
#   median VALUE...   minimum VALUE...   maximum VALUE...
median() { _order_statistic median "$@"; }
minimum() { _order_statistic min "$@"; }
maximum() { _order_statistic max "$@"; }
_order_statistic() {
  local which=$1
  shift
  printf '%s\n' "$@" | grep -E '^[0-9.]+$' | sort -g | awk -v w="$which" '
    { v[NR] = $1 }
    END {
      if (NR == 0) { print "n/a"; exit }
      if (w == "min") print v[1]
      else if (w == "max") print v[NR]
      else if (NR % 2) print v[(NR + 1) / 2]
      else printf "%.2f\n", (v[NR / 2] + v[NR / 2 + 1]) / 2
    }'
}

# Writes a safetensors file of TENSORS random U8 tensors of MIB MiB each (t0, t1, ...) to
# FILE: a u64 header length (little-endian), the JSON header padded to 8 bytes, the data.
#
#   random_safetensors FILE TENSORS MIB
random_safetensors() {
  local file=$1 tensors=$2 bytes=$(($3 << 20)) header="{" len le="" i shift
  for i in $(seq 0 $((tensors - 1))); do
    [ "$i" -gt 0 ] && header+=","
    header+="\"t$i\":{\"dtype\":\"U8\",\"shape\":[$bytes],\"data_offsets\":[$((i * bytes)),$(((i + 1) * bytes))]}"
  done
  header+="}"
  while [ $((${#header} % 8)) -ne 0 ]; do header+=" "; done
  len=${#header}
  for shift in 0 8 16 24 32 40 48 56; do le+=$(printf '\\x%02x' $(((len >> shift) & 255))); done
  { printf "$le"; printf '%s' "$header"; head -c $((tensors * bytes)) /dev/urandom; } > "$file"
}
