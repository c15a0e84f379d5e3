#!/usr/bin/env bash
# Builds the GPU test suite and the programs in release mode into one self-contained folder
# (default: gpu-bundle/) that runs on a GPU host with only the NVIDIA driver: no Rust
# toolchain, no network. Copy the folder there and run its run.sh.
#
#   scripts/gpu-bundle.sh [OUT_DIR]
#   OUT_DIR/run.sh [LOG_DIR]        # on the GPU host; exits non-zero on any failure or skip
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-bundle}
rm -rf "$out"
mkdir -p "$out/tests" "$out/bin"

echo "building programs" >&2
cargo build --release --locked -p tensorwire-examples -p tensorwire-bench --bins
for program in demo receiver sender bench ipc-bench inference-server tensorwire-exec \
  tensorwire-exec-worker spmv tensorwire-share; do
  cp "target/release/$program" "$out/bin/"
done

echo "building test binaries" >&2
cargo test --release --locked -p tensorwire-gpu -p tensorwire-ipc -p tensorwire-exec --no-run --message-format=json 2>/dev/null \
  | grep -o '"executable":"[^"]*"' | sed 's/"executable":"\(.*\)"/\1/' \
  | while read -r exe; do
      name=$(basename "$exe" | sed 's/-[0-9a-f]*$//')
      # The Python test finds python/ through its build path; share-e2e.sh covers it here.
      [ "$name" = python ] || cp "$exe" "$out/tests/$name"
    done
# The remote-execution tests, which start the programs above.
cargo test --release --locked -p tensorwire-examples --test exec --no-run --message-format=json 2>/dev/null \
  | grep '"kind":\["test"\]' | grep -o '"executable":"[^"]*"' \
  | sed 's/"executable":"\(.*\)"/\1/' \
  | while read -r exe; do cp "$exe" "$out/tests/exec-programs"; done
# Sources those tests read: the kernels, the SpMV PTX, the exec vectors.
mkdir -p "$out/src/examples/tests" "$out/src/spec/vectors"
cp -r examples/spmv "$out/src/examples/"
cp -r examples/tests/kernels "$out/src/examples/tests/"
cp -r spec/vectors/exec "$out/src/spec/vectors/"
cargo build --release --locked -p tensorwire-c
mkdir -p "$out/lib" "$out/c/include" "$out/c/examples"
cp target/release/libtensorwire_c.so "$out/lib/"
cp crates/tensorwire-c/include/tensorwire.h "$out/c/include/"
cp crates/tensorwire-c/examples/*.c crates/tensorwire-c/examples/*.cpp crates/tensorwire-c/examples/*.py \
  "$out/c/examples/"
echo "building the Python wheel" >&2
mkdir -p "$out/wheel"
python3 -m pip wheel --no-deps --quiet ./python -w "$out/wheel"
mkdir -p "$out/scripts"
# The sources only: no tool caches (a type checker's can be tens of MB).
tar -C . --exclude=.mypy_cache --exclude=.pytest_cache --exclude=__pycache__ -cf - python \
  | tar -C "$out" -xf -
cp scripts/share-e2e.sh scripts/spmv-e2e.sh scripts/metrics-e2e.sh scripts/pytest-lite.py benches/scale.sh \
  benches/common.sh benches/one-sender.sh benches/python-send.sh benches/two-hosts.sh "$out/scripts/"
strip "$out"/bin/* "$out"/tests/* "$out"/lib/* 2>/dev/null || true
# Compressed, so the folder stays small enough to copy around (run.sh unpacks it).
tar -C "$out" -czf "$out/payload.tar.gz" bin tests lib
rm -rf "$out/bin" "$out/tests" "$out/lib"

cat > "$out/run.sh" <<'RUN'
#!/usr/bin/env bash
# Runs the GPU tests with TENSORWIRE_REQUIRE_GPU=1 (no test may skip), then the demo on the
# GPU. Logs go to LOG_DIR (default: ./logs). Exit status: 0 only if everything passed.
set -uo pipefail
bundle=$(cd "$(dirname "$0")" && pwd)
logs=${1:-$bundle/logs}
mkdir -p "$logs"
# Programs, tests and the C library, unpacked where they can run.
here=$(mktemp -d)
chmod 755 "$here" # tests that spawn processes as another user run them from here
trap 'rm -rf "$here"' EXIT
tar -C "$here" -xzf "$bundle/payload.tar.gz"
ln -s "$bundle/scripts" "$here/scripts"
ln -s "$bundle/src" "$here/src"
ln -s "$bundle/c" "$here/c"
ln -s "$bundle/python" "$here/python"
export TENSORWIRE_REQUIRE_GPU=1
export TENSORWIRE_BIN_DIR="$here/bin" TENSORWIRE_SOURCE_DIR="$here/src"
status=0
failed=()
check() { # STATUS STEP: remembers a failed step, to list at the end
  if [ "$1" -ne 0 ]; then
    status=1
    failed+=("$2 (exit $1)")
  fi
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$logs/gpus.txt" 2>&1 || true
for test in "$here"/tests/*; do
  name=$(basename "$test")
  echo "== $name"
  # Bounded, so one hung test cannot take the whole run.
  timeout 300 "$test" --test-threads 1 2>&1 | tee "$logs/test-$name.log"
  check "${PIPESTATUS[0]}" "test $name"
done
echo "== GPU landing again over the TCP binding"
TENSORWIRE_TEST_BINDING=tcp timeout 300 "$here/tests/gpu" --test-threads 1 2>&1 | tee "$logs/test-gpu-over-tcp.log"
check "${PIPESTATUS[0]}" "test gpu over TCP"
echo "== remote execution again over the TCP binding"
TENSORWIRE_TEST_BINDING=tcp timeout 300 "$here/tests/exec-programs" --test-threads 1 2>&1 \
  | tee "$logs/test-exec-programs-over-tcp.log"
check "${PIPESTATUS[0]}" "test exec-programs over TCP"
echo "== demo --require-gpu"
"$here/bin/demo" --require-gpu 2>&1 | tee "$logs/demo.log"
check "${PIPESTATUS[0]}" "demo --require-gpu"
echo "== inference-server: landed tensors in cuBLAS, weights updated in place, hand-off timing"
"$here/bin/inference-server" --require-gpu 2>&1 | tee "$logs/inference-server.log"
check "${PIPESTATUS[0]}" "inference-server: landed tensors in cuBLAS, weights updated in place, hand-off timing"
echo "== receiver --share, Python consumer with PyTorch/CuPy"
REQUIRE_GPU=1 REQUIRE_CPP=1 C_LIB_DIR="$here/lib" C_SRC_DIR="$here/c" \
  "$here/scripts/share-e2e.sh" "$here/bin" 2>&1 | tee "$logs/share-e2e.log"
check "${PIPESTATUS[0]}" "receiver --share, Python consumer with PyTorch/CuPy"
echo "== receiver --metrics-listen on the GPU: a scrape shows the tensors, cuda:0's budget and the pools"
DEVICE=cuda:0 "$here/scripts/metrics-e2e.sh" "$here/bin" 2>&1 | tee "$logs/metrics-e2e.log"
check "${PIPESTATUS[0]}" "receiver --metrics-listen on the GPU"
echo "== remote execution: SpMV walkthrough beside plain sender/receiver"
for mtu in 1200 6000 65507; do
  MTU=$mtu "$here/scripts/spmv-e2e.sh" "$here/bin" "$here/src/examples/spmv" 2>&1 \
    | tee "$logs/spmv-e2e-$mtu.log"
  check "${PIPESTATUS[0]}" "remote execution: SpMV walkthrough beside plain sender/receiver"
done
echo "== Python package: its tests with PyTorch on the GPU (the wheel, unpacked)"
python3 -m zipfile -e "$bundle"/wheel/*.whl "$here/pypkg"
PYTHONPATH="$here/pypkg" TENSORWIRE_BIN_DIR="$here/bin" \
  python3 "$here/scripts/pytest-lite.py" "$bundle/python/tests/test_package.py" 2>&1 \
  | tee "$logs/python.log"
check "${PIPESTATUS[0]}" "Python package: its tests with PyTorch on the GPU (the wheel, unpacked)"
echo "== Python send of a 4 GiB CUDA tensor beside the Rust sender"
PYTHONPATH="$here/pypkg" "$here/scripts/python-send.sh" "$here/bin" 4096 2>&1 \
  | tee "$logs/python-send.log"
check "${PIPESTATUS[0]}" "Python send of a 4 GiB CUDA tensor beside the Rust sender"
echo "== ipc-bench"
"$here/bin/ipc-bench" --json "$logs/ipc-bench.json" 2>&1 | tee "$logs/ipc-bench.log"
check "${PIPESTATUS[0]}" "ipc-bench"
if [ "${SCALE:-0}" = 1 ]; then
  echo "== one sender, 8 connections -> 1 receiver, beside raw quinn"
  "$here/scripts/one-sender.sh" "$here/bin" 8 16 256 cuda:0 2>&1 | tee "$logs/one-sender.log"
  check "${PIPESTATUS[0]}" "one sender, 8 connections -> 1 receiver, beside raw quinn"
  echo "== one sender, 8 connections, one 4 GiB tensor split over them, then sent whole"
  "$here/scripts/one-sender.sh" "$here/bin" 8 1 4096 cuda:0 2>&1 | tee "$logs/one-sender-split.log"
  check "${PIPESTATUS[0]}" "one sender, one 4 GiB tensor split over 8 connections"
  SENDER_FLAGS=--no-split "$here/scripts/one-sender.sh" "$here/bin" 8 1 4096 cuda:0 2>&1 \
    | tee "$logs/one-sender-whole.log"
  check "${PIPESTATUS[0]}" "one sender, one 4 GiB tensor sent whole"
  echo "== scale: 1 receiver <- 8 sender processes, beside raw quinn"
  "$here/scripts/scale.sh" "$here/bin" 8 1024 cuda:0 2>&1 | tee "$logs/scale.log"
  check "${PIPESTATUS[0]}" "scale: 1 receiver <- 8 sender processes, beside raw quinn"
fi
grep -h "test result" "$logs"/test-*.log
for step in "${failed[@]}"; do echo "FAILED: $step"; done
exit $status
RUN
chmod +x "$out/run.sh"
du -sh "$out" >&2
