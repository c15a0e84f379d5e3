#!/usr/bin/env bash
# Instructions, not seconds: what tensorwire executes per 4 KiB tensor and per payload byte,
# beside raw quinn, counted by valgrind's callgrind on each thread of `bench`. Timings on a
# shared host move by a tenth between minutes; these counts by about 1% between runs (what
# the network stack does depends a little on timing), so a change in per-tensor or per-byte
# work of a few percent shows here first.
#
#   benches/instructions.sh BENCH [MESSAGES] [MIB]
#
# BENCH is a `bench` binary built with symbols (`cargo build --release` keeps them). Four
# runs, each under callgrind (about 50 times slower than without):
#   - MESSAGES (default 3000) 4 KiB tensors one at a time with inline admission
#     (`--only latency-inline`), and raw quinn's request/response (`--only latency-raw`);
#   - MIB (default 256) MiB over one connection in 64 MiB tensors, stores on the stream's
#     thread (`--only tensorwire --store-offload never`), and raw quinn from one buffer
#     (`--only raw-quinn --source hot`: counts do not depend on caches).
# For each run it prints the instructions of every thread that ran at least 1% of them, in
# the order the threads started: the receiving endpoint's thread first, then the sending
# one's, then helpers (the sender's checksum threads). The main thread (1), which builds
# the payloads, is left out. Per message and per byte include one connection's setup (a
# few million instructions per side). MTU is common.sh's. Valgrind runs no AVX-512 or
# VAES code: CRC-32C and AES-GCM take their SSE and AES-NI paths. Compare runs of this
# script with each other, not with hardware counters. KEEP=DIR keeps the profiles there
# (for `callgrind_annotate`).
set -euo pipefail
. "$(dirname "$0")/common.sh"
bench=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
messages=${2:-3000}
mib=${3:-256}
command -v valgrind > /dev/null || { echo "instructions.sh needs valgrind" >&2; exit 1; }
out=${KEEP:-$(mktemp -d)}
mkdir -p "$out"
[ -n "${KEEP:-}" ] || trap 'rm -rf "$out"' EXIT

# Runs bench under callgrind as NAME, one profile per thread.
profile() {
  local name=$1
  shift
  rm -f "$out/$name".* # a kept directory's earlier run would be counted again
  BENCH_STATS=1 valgrind --tool=callgrind --separate-threads=yes \
    --callgrind-out-file="$out/$name.%p" "$bench" --mtu "$MTU" "$@" > "$out/$name.log" 2>&1 ||
    { cat "$out/$name.log" >&2; return 1; }
}

# Prints NAME's threads of at least 1% of its instructions, each divided by DIVISOR.
report() {
  local name=$1 divisor=$2 unit=$3
  local files
  # In the order the threads started: by the number after the last '-'.
  files=$(for f in "$out/$name".*-*; do echo "${f##*-} $f"; done | sort -n | cut -d' ' -f2-)
  # shellcheck disable=SC2086 # one profile file per word
  awk -v divisor="$divisor" -v unit="$unit" -v name="$name" '
    /^summary:/ { count[FILENAME] = $2; total += $2; order[++n] = FILENAME }
    END {
      line = sprintf("%-16s", name)
      for (i = 1; i <= n; i++) {
        f = order[i]
        if (count[f] * 100 < total || f ~ /-0*1$/) continue
        thread = f; sub(/.*-/, "", thread)
        line = line sprintf("  thread %d: %.2f", thread, count[f] / divisor)
      }
      printf "%s  (%s)\n", line, unit
    }' $files
}

profile latency-tw --only latency-inline --samples "$messages"
profile latency-raw --only latency-raw --samples "$messages"
profile bytes-tw --only tensorwire --connections 1 --mib "$mib" --runs 1 --store-offload never
profile bytes-raw --only raw-quinn --connections 1 --mib "$mib" --runs 1 --source hot

echo "instructions per 4 KiB message ($messages messages), then per payload byte ($mib MiB):"
report latency-tw "$messages" "tensorwire, inline"
report latency-raw "$messages" "raw quinn request/response"
report bytes-tw $((mib << 20)) "tensorwire, 1 connection"
report bytes-raw $((mib << 20)) "raw quinn, 1 connection"
echo "packets lost (quinn's count; a loss under valgrind's slowness adds work):"
grep -h "lost" "$out"/bytes-*.log | sed 's/^/  /'
