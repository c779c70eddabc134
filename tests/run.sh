#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test through ctest.
# Where a CUDA toolkit is installed it also builds the CUDA codec kernels in
# a second build dir and runs their test (which skips without a GPU), so the
# optional CUDA path keeps compiling.
# Usage: ./tests/run.sh [extra ctest args, e.g. -L unit]
set -euo pipefail
cd "$(dirname "$0")/.."

./deploy/install-deps.sh
BUILD_DIR="${GEOTRAIN_BUILD_DIR:-build}"
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=RelWithDebInfo
cmake --build "$BUILD_DIR" -j2
(cd "$BUILD_DIR" && ctest --output-on-failure -j2 "$@")

if command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; then
  CUDA_BUILD_DIR="${BUILD_DIR}-cuda"
  cmake -S . -B "$CUDA_BUILD_DIR" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DGEOTRAIN_WITH_CUDA=ON
  cmake --build "$CUDA_BUILD_DIR" -j2 --target cuda_codec_test
  "$CUDA_BUILD_DIR/bin/cuda_codec_test"
else
  echo "no CUDA toolkit: the CUDA codec kernels were not built"
fi
