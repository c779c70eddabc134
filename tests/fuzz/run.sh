#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (build-fuzz/) and runs each for a
# bounded time on a scratch copy of its seed corpus (tests/fuzz/corpus/),
# two at a time. A crash, leak, sanitizer report or timeout fails the run and
# leaves the reproducer in the scratch directory it names.
# Usage: tests/fuzz/run.sh [SECONDS_PER_TARGET]   (default 30)
set -euo pipefail
cd "$(dirname "$0")/../.."
SECONDS_PER_TARGET="${1:-${GEOTRAIN_FUZZ_SECONDS:-30}}"
CLANG=$(command -v clang++-14 || command -v clang++ || true)
if [ -z "$CLANG" ]; then
  echo "fuzz: no clang++ (Debian's clang-14 and libclang-rt-14-dev): fuzzing skipped"
  exit 0
fi
CC_BIN="${CLANG/clang++/clang}"
BUILD_DIR="${GEOTRAIN_FUZZ_BUILD_DIR:-build-fuzz}"
CC="$CC_BIN" CXX="$CLANG" cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DGEOTRAIN_FUZZ=ON -DGEOTRAIN_BUILD_TESTS=OFF >/dev/null
cmake --build "$BUILD_DIR" -j2 --target geotrain_fuzz_targets
SCRATCH=$(mktemp -d /tmp/geotrain-fuzz.XXXXXX)
TARGETS=(link_frames_fuzz tensor_decode_fuzz job_spec_fuzz checkpoint_file_fuzz token_fuzz
         safetensors_fuzz)
run_one() {
  local target="$1"
  mkdir -p "$SCRATCH/$target/corpus" "$SCRATCH/$target/artifacts"
  # New inputs go to the scratch corpus; the tree's seeds are read only.
  "$BUILD_DIR/bin/$target" -max_total_time="$SECONDS_PER_TARGET" -timeout=10 \
    -rss_limit_mb=3072 -max_len=65536 -print_final_stats=1 \
    -artifact_prefix="$SCRATCH/$target/artifacts/" \
    "$SCRATCH/$target/corpus" "tests/fuzz/corpus/$target" >"$SCRATCH/$target.log" 2>&1
}
failed=0
for ((i = 0; i < ${#TARGETS[@]}; i += 2)); do
  pids=()
  for target in "${TARGETS[@]:i:2}"; do
    run_one "$target" &
    pids+=("$!:$target")
  done
  for entry in "${pids[@]}"; do
    pid="${entry%%:*}"
    target="${entry#*:}"
    if wait "$pid"; then
      runs=$(grep -m1 'stat::number_of_executed_units' "$SCRATCH/$target.log" | awk '{print $2}')
      rate=$(grep -E '^#[0-9]+.*DONE' "$SCRATCH/$target.log" | sed 's/.*exec\/s: \([0-9]*\).*/\1/')
      cov=$(grep -E '^#[0-9]+.*DONE' "$SCRATCH/$target.log" | sed 's/.*cov: \([0-9]*\).*/\1/')
      echo "fuzz: $target: ${runs:-?} runs in ${SECONDS_PER_TARGET}s (${rate:-?} exec/s), coverage ${cov:-?}, no crash"
    else
      echo "fuzz: $target FAILED; its log ($SCRATCH/$target.log) ends:"
      grep -v '^#' "$SCRATCH/$target.log" | tail -n 40
      echo "fuzz: reproducer(s): $(ls "$SCRATCH/$target/artifacts/" 2>/dev/null | tr '\n' ' ')"
      failed=1
    fi
  done
done
exit "$failed"
