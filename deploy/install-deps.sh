#!/usr/bin/env bash
# Installs the Debian 12 packages geotrain needs to build, test and run.
# Idempotent: packages already present are not touched, and apt is not even
# consulted when everything is installed. Runs as root, or through sudo.
set -euo pipefail

PACKAGES=(
  build-essential cmake pkg-config ccache
  libtorch-dev              # LibTorch 1.13 (CPU)
  libopenblas0-openmp       # without it LibTorch's matmuls use reference BLAS (~16x slower)
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libgtest-dev libgmock-dev libbenchmark-dev libzstd-dev zlib1g-dev
  libssl-dev                # keys, CSRs and certificates of the cluster CA
  prometheus-cpp-dev        # the daemons' /metrics endpoints
  prometheus                # tests/integration/test_operations.py scrapes a live run
  chromium                  # the same suite loads the coordinator's status page headless
  nftables                  # the network lab (deploy/net-lab): namespaces, veth, tbf, NAT
  clang-14 libclang-rt-14-dev  # libFuzzer (tests/fuzz)
  fortunes                  # text corpus for the byte-level GPT and the token files
  python3-sentencepiece     # deploy/tokenize.py: a real tokenizer for token-file datasets
  dataset-fashion-mnist     # idx files for the MLP
  linux-perf                # bench/vs_ddp --profile: where each worker's CPU time goes
  procps iproute2 python3 python3-venv
)

missing=()
for pkg in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$pkg")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PACKAGES[@]} packages already installed"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then
    SUDO="sudo"
  else
    echo "install-deps: need root (or sudo) to install: ${missing[*]}" >&2
    exit 1
  fi
fi

echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
echo "install-deps: done"
