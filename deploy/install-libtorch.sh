#!/usr/bin/env bash
# Installs a current CUDA LibTorch, the one inside PyPI's `torch` wheel, into
# a virtual environment inside a build tree, and prints the CMake prefix to
# build geotrain against (the only line on stdout; progress goes to stderr):
#
#   cmake -S . -B build-wheel -DCMAKE_PREFIX_PATH="$(deploy/install-libtorch.sh build-wheel)"
#
# Usage: deploy/install-libtorch.sh [BUILD_DIR]   (default: build-wheel)
# Environment: GEOTRAIN_TORCH_VERSION (default 2.15.0), PYTHON (default python3).
# Idempotent: a venv that already holds that version is reused. pip's cache
# (~/.cache/pip) keeps the ~3 GB of wheels for the next clean tree.
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_DIR="${1:-build-wheel}"
VERSION="${GEOTRAIN_TORCH_VERSION:-2.15.0}"
PYTHON="${PYTHON:-python3}"
VENV="$BUILD_DIR/torch-venv"

installed() {
  "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('torch') != '$VERSION')" \
    2>/dev/null
}

if ! installed; then
  mkdir -p "$BUILD_DIR"
  if [ ! -x "$VENV/bin/python" ]; then
    echo "install-libtorch: creating $VENV" >&2
    if ! "$PYTHON" -m venv "$VENV" >&2; then
      echo "install-libtorch: '$PYTHON -m venv' failed (on Debian: apt-get install python3-venv)" >&2
      exit 1
    fi
  fi
  echo "install-libtorch: pip install torch==$VERSION into $VENV (CUDA wheel, ~3 GB with its CUDA libraries)" >&2
  "$VENV/bin/python" -m pip install --disable-pip-version-check --progress-bar off \
    "torch==$VERSION" >&2
fi
PREFIX=$("$VENV/bin/python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)' 2>/dev/null)
echo "install-libtorch: torch $VERSION; CMake prefix $PREFIX" >&2
echo "$PREFIX"
