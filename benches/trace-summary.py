#!/usr/bin/env python3
"""Summarizes an Nsight Systems trace of `bench --gpu` (see trace-gpu.sh).

    trace-summary.py GPU_TRACE.csv API_TRACE.csv

The inputs are `nsys stats --format csv` exports of the cuda_gpu_trace and cuda_api_trace
reports. Host → device copies are cut into runs wherever the copy engine rests for more
than 30 ms, as it does between the phases of `bench --gpu`. The sinks copy on one stream
(the pinned peak, each ingest run, the network → GPU runs); the anchor "without the sink" on
one stream per thread, so the stream count tells them apart. For each run of 100 copies or
more it prints
the copies' mean size, the rate over the run, the share of the run the copy engine was busy,
the rate of a median 4 MiB copy while it ran, the idle time in gaps over 100 µs, and the
median and total time of the CUDA calls made during the run.
"""

import csv
import statistics
import sys

RUN_BREAK_NS = 30_000_000
LONG_GAP_NS = 100_000
CALLS = (
    "cuMemcpyHtoDAsync_v2",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventSynchronize",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
)


def copies(path):
    """(start, end, MB, stream) of each host → device copy, in start order."""
    with open(path, newline="") as f:
        rows = [
            (
                int(r["Start (ns)"]),
                int(r["Start (ns)"]) + int(r["Duration (ns)"]),
                float(r["Bytes (MB)"] or 0),
                r["Strm"],
            )
            for r in csv.DictReader(f)
            if "Host-to-Device" in r["Name"]
        ]
    return sorted(rows)


def calls(path):
    """(start, duration, name) of each CUDA call."""
    with open(path, newline="") as f:
        return [
            (int(r["Start (ns)"]), int(r["Duration (ns)"]), r["Name"])
            for r in csv.DictReader(f)
        ]


def runs(rows):
    """Rows cut wherever the copy engine rests for more than RUN_BREAK_NS."""
    out, current, end = [], [], 0
    for row in rows:
        if current and row[0] - end > RUN_BREAK_NS:
            out.append(current)
            current = []
        current.append(row)
        end = max(end, row[1])
    if current:
        out.append(current)
    return out


def busy_and_gaps(run):
    """Nanoseconds the engine was busy, and idle time in gaps over LONG_GAP_NS."""
    busy, long_idle, end = 0, 0, None
    for start, stop, _, _ in run:
        if end is None or start >= end:
            if end is not None and start - end > LONG_GAP_NS:
                long_idle += start - end
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    return busy, long_idle


def main():
    rows = copies(sys.argv[1])
    api = calls(sys.argv[2])
    print("copy runs (host -> device), in order:")
    for i, run in enumerate(runs(rows)):
        if len(run) < 100:
            continue
        first, last = run[0][0], max(r[1] for r in run)
        span = last - first
        mb = sum(r[2] for r in run)
        busy, long_idle = busy_and_gaps(run)
        whole = [r[1] - r[0] for r in run if 4.1 < r[2] < 4.3]
        median_copy = f"{4194.304 / (statistics.median(whole) / 1e3):.1f} GB/s" if whole else "-"
        print(
            f"  run {i}: {len(set(r[3] for r in run))} stream(s), {len(run)} copies of "
            f"{mb / len(run) / 1.048576:.2f} MiB, {mb / (span / 1e6):.1f} GB/s over "
            f"{span / 1e6:.1f} ms; engine busy {busy / span:.1%}; a 4 MiB copy {median_copy}; "
            f"idle in gaps over 100 us {long_idle / 1e6:.1f} ms"
        )
        during = [(d, n) for s, d, n in api if first <= s < last]
        for name in CALLS:
            took = [d for d, n in during if n == name]
            if took:
                print(
                    f"      {name:22} {len(took):6} calls, median {statistics.median(took) / 1e3:7.1f} us, "
                    f"total {sum(took) / 1e6:8.1f} ms"
                )


if __name__ == "__main__":
    main()
