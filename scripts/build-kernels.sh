#!/usr/bin/env bash
# Regenerates the PTX that tensorwire-gpu ships from its CUDA sources (needs nvcc; run on any
# CUDA host). The crate embeds the PTX, so building tensorwire needs no CUDA toolkit.
set -euo pipefail
cd "$(dirname "$0")/../crates/tensorwire-gpu/kernels"
for cu in *.cu; do
  ptx="${cu%.cu}.ptx"
  nvcc -ptx -arch=compute_75 -O3 -o "$ptx" "$cu"
  # The kernels use nothing newer than PTX ISA 7.0 (CUDA 11.0): drivers that old load them.
  sed -i 's/^\.version .*/.version 7.0/' "$ptx"
done
