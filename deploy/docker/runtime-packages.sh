#!/usr/bin/env bash
# Prints the Debian packages that hold the shared libraries the given
# binaries load (ldd, then dpkg -S), one per line: what a runtime image must
# install, without compilers or headers. The Dockerfile's build stage runs
# it; tests/deploy/check_deploy.sh runs it on a fresh clone's build.
set -euo pipefail
if [[ $# -eq 0 ]]; then
  echo "usage: runtime-packages.sh BINARY..." >&2
  exit 2
fi
libraries=$(ldd "$@" | awk '/=> \// { print $3 }' | sort -u)
missing=$(ldd "$@" | awk '/not found/ { print $1 }' | sort -u)
if [[ -n "$missing" ]]; then
  echo "runtime-packages: libraries not found: $missing" >&2
  exit 1
fi
for library in $libraries; do
  # The real file (dpkg knows the path it installed, not a symlink's).
  dpkg -S "$library" 2>/dev/null || dpkg -S "$(readlink -f "$library")" 2>/dev/null ||
    { echo "runtime-packages: no package holds $library" >&2; exit 1; }
done | cut -d: -f1 | sort -u
