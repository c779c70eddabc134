#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test through ctest, then
# the fuzz targets (tests/fuzz/run.sh, with clang); then
# builds the same code a second time against PyPI's CUDA LibTorch (the torch
# wheel, with the CUDA codec kernels where nvcc is installed) and runs every
# unit test that links LibTorch there too, plus the GPU check in its CPU mode
# and the outer optimizer against PyTorch (test_outer_step_reference.py),
# then loads a model the wheel tree exported with transformers, and
# fine-tunes a model transformers made (init_from) and exports it back.
# Usage: ./tests/run.sh [extra ctest args for the first tree, e.g. -L unit]
# GEOTRAIN_SKIP_WHEEL=1 skips the second tree (a quick local run).
set -euo pipefail
cd "$(dirname "$0")/.."

# Where the time goes, for the CI budget (45 min): one line per phase.
phase() { echo "== tests/run.sh: $1 at $((SECONDS / 60))m$((SECONDS % 60))s"; }

# Every test's scratch files go under one directory per run, removed when the
# run ends however it ends: the suites make about a thousand temporary
# directories (checkpoints of up to 2.3 GB among them), and before this they
# piled up in /tmp until a later run's pip died with "No space left on
# device". GEOTRAIN_KEEP_TEST_DIRS=1 keeps it, for a failure's post-mortem.
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/geotrain-tests.XXXXXX")
if [ "${GEOTRAIN_KEEP_TEST_DIRS:-0}" = 1 ]; then
  trap 'echo "tests/run.sh: scratch files kept in $SCRATCH"' EXIT
else
  trap 'rm -rf "$SCRATCH"' EXIT
fi
export TMPDIR="$SCRATCH" TEST_TMPDIR="$SCRATCH"

# A full run needs about 16 GiB: two build trees, the torch wheel's venv
# (3 GB with its CUDA libraries, twice that while pip unpacks it) and the
# tests' scratch files. Say so now rather than fail 27 minutes in.
need_kib=$((16 * 1024 * 1024))
free_kib=$(df -Pk . "$SCRATCH" | awk 'NR > 1 {print $4}' | sort -n | head -1)
if [ "$free_kib" -lt "$need_kib" ] && [ "${GEOTRAIN_SKIP_WHEEL:-0}" != 1 ]; then
  echo "tests/run.sh: $((free_kib / 1024 / 1024)) GiB free on $(pwd) or $SCRATCH;" \
       "a full run needs 16 GiB (GEOTRAIN_SKIP_WHEEL=1 needs about 6)" >&2
  exit 1
fi

phase "installing dependencies"
./deploy/install-deps.sh
BUILD_DIR="${GEOTRAIN_BUILD_DIR:-build}"
phase "building $BUILD_DIR"
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=RelWithDebInfo
cmake --build "$BUILD_DIR" -j2
phase "testing $BUILD_DIR"
(cd "$BUILD_DIR" && ctest --output-on-failure -j2 "$@")

# libFuzzer targets with clang, 20 s each (two at a time); a crash fails.
phase "fuzzing"
./tests/fuzz/run.sh 20  # 20 s a target: the whole run must stay under 45 min

if [ "${GEOTRAIN_SKIP_WHEEL:-0}" = 1 ]; then
  echo "GEOTRAIN_SKIP_WHEEL=1: the build against the torch wheel was skipped"
  exit 0
fi
WHEEL_BUILD_DIR="${BUILD_DIR}-wheel"
phase "building $WHEEL_BUILD_DIR against the torch wheel"
PREFIX=$(./deploy/install-libtorch.sh "$WHEEL_BUILD_DIR")
CUDA_FLAGS=()
NVCC=$(command -v nvcc || true)
[ -z "$NVCC" ] && [ -x /usr/local/cuda/bin/nvcc ] && NVCC=/usr/local/cuda/bin/nvcc
if [ -n "$NVCC" ]; then
  CUDA_FLAGS=(-DGEOTRAIN_WITH_CUDA=ON -DCMAKE_CUDA_COMPILER="$NVCC")
else
  echo "no CUDA toolkit: the CUDA codec kernels are not built"
fi
# The benchmarks are built (and run) in the first tree only.
cmake -S . -B "$WHEEL_BUILD_DIR" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DGEOTRAIN_BUILD_BENCH=OFF \
  -DCMAKE_PREFIX_PATH="$PREFIX" "${CUDA_FLAGS[@]}"
# Only what depends on the LibTorch: the worker and the unit tests that
# link it (label "unit-torch"); the others, the coordinator and geotrain-ctl
# are the same code in both trees, so the wheel tree's workers run with the
# first tree's coordinator (GEOTRAIN_COORDINATOR_BIN_DIR).
cmake --build "$WHEEL_BUILD_DIR" -j2 --target geotrain_torch_checks
export GEOTRAIN_COORDINATOR_BIN_DIR="$(cd "$BUILD_DIR/bin" && pwd)"
phase "testing $WHEEL_BUILD_DIR"
(cd "$WHEEL_BUILD_DIR" && ctest --output-on-failure -j2 -L torch)
# Its spot-check run mixes the builds: pipeline 1 runs Debian's LibTorch.
GEOTRAIN_GPU_BUILD_DIR="$WHEEL_BUILD_DIR" \
  GEOTRAIN_GPU_OTHER_BIN_DIR="$(cd "$BUILD_DIR/bin" && pwd)" ./tests/gpu/run.sh --device=cpu
# A spot check's honest spread across the two LibTorch builds, both ways:
# the audits one build emits pass the other's verifier.
phase "spot checks across the two LibTorch builds"
SPREAD_DIR=$(mktemp -d)
for pair in "$WHEEL_BUILD_DIR $BUILD_DIR" "$BUILD_DIR $WHEEL_BUILD_DIR"; do
  set -- $pair
  rm -f "$SPREAD_DIR"/audit-*.bin
  "$1/bin/spot_check_spread" --job=deploy/jobs/gpt-tiny.textproto --emit="$SPREAD_DIR"
  "$2/bin/spot_check_spread" --job=deploy/jobs/gpt-tiny.textproto --verify="$SPREAD_DIR"
done
rm -rf "$SPREAD_DIR"
# The outer optimizer against PyTorch (the wheel's torch on both sides).
phase "the outer step against PyTorch"
GEOTRAIN_SOURCE_DIR="$PWD" GEOTRAIN_BIN_DIR="$WHEEL_BUILD_DIR/bin" \
  "$WHEEL_BUILD_DIR/torch-venv/bin/python" -u tests/worker/test_outer_step_reference.py
# Hugging Face interop: transformers (PyPI) loads what --export_dir wrote.
phase "Hugging Face interop with transformers"
"$WHEEL_BUILD_DIR/torch-venv/bin/pip" install -q "transformers==5.24.0"
GEOTRAIN_SOURCE_DIR="$PWD" GEOTRAIN_BIN_DIR="$WHEEL_BUILD_DIR/bin" \
  "$WHEEL_BUILD_DIR/torch-venv/bin/python" -u tests/hf/test_export_loads.py
# init_from with the first tree's daemons (the export test above covers the
# wheel's), so the wheel tree need not build geotrain-eval too.
GEOTRAIN_SOURCE_DIR="$PWD" GEOTRAIN_BIN_DIR="$BUILD_DIR/bin" \
  "$WHEEL_BUILD_DIR/torch-venv/bin/python" -u tests/hf/test_init_from.py
phase "done"
