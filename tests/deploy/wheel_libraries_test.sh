#!/usr/bin/env bash
# Built against PyPI's torch wheel, a binary must load the wheel's own CUDA
# runtime, NCCL and cuDNN (from site-packages/nvidia/*/lib), not the CUDA
# toolkit's copies, and nothing may be missing. Checked with ldd, which
# resolves libraries as the loader does.
# Usage: wheel_libraries_test.sh BINARY SITE_PACKAGES_DIR
set -euo pipefail
binary="$1"
site=$(realpath "$2")
out=$(ldd "$binary")
if grep -q "not found" <<<"$out"; then
  echo "FAIL: unresolved libraries:"; grep "not found" <<<"$out"; exit 1
fi
status=0
for lib in libtorch_cuda.so libcudart.so libnccl.so libcudnn.so libcublas.so; do
  path=$(awk -v lib="$lib" 'index($1, lib) == 1 { print $3; exit }' <<<"$out")
  if [ -z "$path" ]; then
    echo "FAIL: $binary does not load $lib"; status=1; continue
  fi
  real=$(realpath "$path")
  case "$real" in
    "$site"/*) echo "ok: $lib -> $real" ;;
    *) echo "FAIL: $lib -> $real, outside the wheel ($site)"; status=1 ;;
  esac
done
exit $status
