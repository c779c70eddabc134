#!/usr/bin/env bash
# The GPU check, for a machine with a GPU (about 5 minutes on one): builds
# geotrain against that machine's CUDA LibTorch (PyPI's torch wheel, with
# the CUDA codec kernels), runs cuda_codec_test, trains the demo job with 3
# workers sharing the device, checks that `sync` gives the same per-step
# losses there as on the CPU, and prints samples/s of both; then runs two
# pipelines with spot checks, one on the device and one on the CPU, where
# no honest worker may fail an audit (compare_devices.py).
#
#   tests/gpu/run.sh                  # on cuda:0
#   tests/gpu/run.sh --device=cuda:1
#   tests/gpu/run.sh --device=cpu     # CI: the same script, both runs on the CPU
#
# Environment: GEOTRAIN_GPU_BUILD_DIR (default build-wheel, shared with
# tests/run.sh's second tree), GEOTRAIN_GPU_STEPS (default 30),
# GEOTRAIN_COORDINATOR_BIN_DIR (a directory that already has
# geotrain-coordinator and geotrain-ctl, which link no LibTorch: this tree
# then builds only the worker), GEOTRAIN_GPU_AUDIT_STEPS (default 400; 0
# skips the spot-check run), GEOTRAIN_GPU_OTHER_BIN_DIR (another build's
# bin directory: its geotrain-worker runs the spot-check run's pipeline 1).
set -euo pipefail
cd "$(dirname "$0")/../.."

DEVICE=cuda:0
for arg in "$@"; do
  case "$arg" in
    --device=*) DEVICE="${arg#--device=}" ;;
    *) echo "usage: tests/gpu/run.sh [--device=cuda[:N]|cpu]" >&2; exit 2 ;;
  esac
done
BUILD_DIR="${GEOTRAIN_GPU_BUILD_DIR:-build-wheel}"
STEPS="${GEOTRAIN_GPU_STEPS:-30}"

echo "== gpu check: device $DEVICE, build $BUILD_DIR"
./deploy/install-deps.sh >&2
PREFIX=$(./deploy/install-libtorch.sh "$BUILD_DIR")
NVCC=$(command -v nvcc || true)
[ -z "$NVCC" ] && [ -x /usr/local/cuda/bin/nvcc ] && NVCC=/usr/local/cuda/bin/nvcc
TARGETS=(geotrain-worker)
if [ -z "${GEOTRAIN_COORDINATOR_BIN_DIR:-}" ]; then
  TARGETS+=(geotrain-coordinator geotrain-ctl)
elif [ ! -x "$GEOTRAIN_COORDINATOR_BIN_DIR/geotrain-coordinator" ]; then
  echo "GEOTRAIN_COORDINATOR_BIN_DIR=$GEOTRAIN_COORDINATOR_BIN_DIR has no geotrain-coordinator" >&2
  exit 2
fi
CUDA_FLAGS=()
if [ -n "$NVCC" ]; then
  CUDA_FLAGS=(-DGEOTRAIN_WITH_CUDA=ON -DCMAKE_CUDA_COMPILER="$NVCC")
  TARGETS+=(cuda_codec_test)
else
  echo "no nvcc: building without the CUDA codec kernels"
fi
# Only the architecture of the GPU at hand, when there is one: quicker.
if command -v nvidia-smi >/dev/null && nvidia-smi >/dev/null 2>&1 && [ ! -f "$BUILD_DIR/CMakeCache.txt" ]; then
  SM=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n1 | tr -d ' .')
  [ -n "$SM" ] && CUDA_FLAGS+=(-DGEOTRAIN_CUDA_ARCHITECTURES="$SM")
fi
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_PREFIX_PATH="$PREFIX" \
  "${CUDA_FLAGS[@]}" >/dev/null
cmake --build "$BUILD_DIR" -j"$(nproc)" --target "${TARGETS[@]}" | grep -E "error|Built target" || true

if [ -x "$BUILD_DIR/bin/cuda_codec_test" ]; then
  echo "== cuda_codec_test"
  "$BUILD_DIR/bin/cuda_codec_test"
fi
echo "== sync on $DEVICE against sync on cpu ($STEPS steps, 3 workers)"
GEOTRAIN_BIN_DIR="$BUILD_DIR/bin" python3 -u tests/gpu/compare_devices.py \
  --device="$DEVICE" --steps="$STEPS" --audit_steps="${GEOTRAIN_GPU_AUDIT_STEPS:-400}" \
  --other_bin_dir="${GEOTRAIN_GPU_OTHER_BIN_DIR:-}"
