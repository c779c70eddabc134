#!/usr/bin/env bash
# Installs the PyPI tools the tests use to check geotrain from the outside,
# into a venv of their own: grpcio with its health-checking and reflection
# clients; tensorboard (its EventAccumulator reads the event files); and the
# deployment files' checkers (PyYAML, jsonschema, kubernetes-validate with
# the Kubernetes schemas, and docker-compose 1.29.2 for its compose-spec
# schema only, without its dependencies). Usage: deploy/install-test-tools.sh VENV_DIR; prints the venv's
# python. Idempotent: a venv whose stamp matches the pins is reused.
set -euo pipefail

VENV="${1:?usage: install-test-tools.sh VENV_DIR}"
PINS=(grpcio==1.85.3 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1
      tensorboard==2.21.0 PyYAML==6.0.4 jsonschema==4.26.0 kubernetes-validate==1.37.0)
SCHEMA_ONLY=(docker-compose==1.29.2)
STAMP="$VENV/.geotrain-pins"
# Two suites may ask at once (ctest -j2): one installs, the other waits.
mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
flock 9
if [[ -x "$VENV/bin/python" && -f "$STAMP" && "$(cat "$STAMP")" == "${PINS[*]} ${SCHEMA_ONLY[*]}" ]]; then
  echo "$VENV/bin/python"
  exit 0
fi
PYTHON="${PYTHON:-python3}"
echo "install-test-tools: pip install ${PINS[*]} into $VENV" >&2
rm -rf "$VENV"
if ! "$PYTHON" -m venv "$VENV" >&2; then
  echo "install-test-tools: '$PYTHON -m venv' failed (on Debian: apt-get install python3-venv)" >&2
  exit 1
fi
"$VENV/bin/python" -m pip install --disable-pip-version-check --progress-bar off -q \
  "${PINS[@]}" >&2
"$VENV/bin/python" -m pip install --disable-pip-version-check --progress-bar off -q \
  --no-deps "${SCHEMA_ONLY[@]}" >&2
echo "${PINS[*]} ${SCHEMA_ONLY[*]}" > "$STAMP"
echo "$VENV/bin/python"
