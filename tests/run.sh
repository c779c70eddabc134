#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test through ctest.
# Usage: ./tests/run.sh [extra ctest args, e.g. -L unit]
set -euo pipefail
cd "$(dirname "$0")/.."

./deploy/install-deps.sh
BUILD_DIR="${GEOTRAIN_BUILD_DIR:-build}"
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=RelWithDebInfo
cmake --build "$BUILD_DIR" -j2
cd "$BUILD_DIR"
ctest --output-on-failure -j2 "$@"
