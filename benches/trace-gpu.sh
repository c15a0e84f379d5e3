#!/usr/bin/env bash
# Traces `bench --gpu` with Nsight Systems and says, for each run of host → device copies,
# how much of the time the copy engine was busy and what the CUDA calls around it cost: what
# a throughput figure alone cannot tell apart (a starved GPU, slow copies, a contended call).
#
#   benches/trace-gpu.sh BENCH [BENCH_ARGS...]
#
# Default BENCH_ARGS: --gpu --only raw-quinn --connections 1 --mib 64 --runs 1 (the GPU
# section, with the network runs kept short). Needs `nsys` on PATH (or NSYS=/path/to/nsys)
# and python3. Prints bench's own output, then one line per run of copies (see
# trace-summary.py); the report and its CSV exports stay in TRACE_DIR (default: a temporary
# folder, removed). An nsys from an Nsight Compute install writes only a .qdstrm; the
# QdstrmImporter beside it turns that into a report (it needs libdw, from elfutils).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bench=${1:?usage: trace-gpu.sh BENCH [BENCH_ARGS...]}
shift
[ $# -gt 0 ] || set -- --gpu --only raw-quinn --connections 1 --mib 64 --runs 1
nsys=${NSYS:-$(command -v nsys || true)}
[ -n "$nsys" ] || { echo "trace-gpu.sh: no nsys on PATH; set NSYS" >&2; exit 2; }
if [ -n "${TRACE_DIR:-}" ]; then
  out=$TRACE_DIR
  mkdir -p "$out"
else
  out=$(mktemp -d)
  trap 'rm -rf "$out"' EXIT
fi

"$nsys" profile --trace=cuda --sample=none --cpuctxsw=none --force-overwrite=true \
  -o "$out/trace" "$bench" "$@"
if [ ! -f "$out/trace.nsys-rep" ] && [ -f "$out/trace.qdstrm" ]; then
  importer=$(ls "$(dirname "$nsys")"/../*/QdstrmImporter 2>/dev/null | head -1 || true)
  [ -n "$importer" ] || { echo "trace-gpu.sh: only a .qdstrm, and no QdstrmImporter" >&2; exit 2; }
  "$importer" -i "$out/trace.qdstrm" > /dev/null
fi
"$nsys" stats --force-export=true --format csv --report cuda_gpu_trace -o "$out/gpu" \
  "$out/trace.nsys-rep" > /dev/null
"$nsys" stats --format csv --report cuda_api_trace -o "$out/api" "$out/trace.nsys-rep" > /dev/null
python3 "$here/trace-summary.py" "$out/gpu_cuda_gpu_trace.csv" "$out/api_cuda_api_trace.csv"
