#!/usr/bin/env bash
# On a CUDA machine: build the kernels in place (CUDA forced on) and run the
# tests marked gpu, package by package, against the sources. Used by
# `nox -s gpu` and directly on the device machine, which has no nox.
set -euo pipefail
cd "$(dirname "$0")/.."
export ZEROSTACK_BUILD_CUDA="${ZEROSTACK_BUILD_CUDA:-1}"
python3 packages/fused-adam/hatch_build.py
PYTHONPATH="$(ls -d packages/*/src | paste -sd:)${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONPATH
status=0
for tests in packages/*/tests integration_tests; do
  [ -d "$tests" ] || continue
  python3 -m pytest "$tests" -m gpu -q -p no:cacheprovider "$@" || { rc=$?; [ $rc -eq 5 ] || status=$rc; }
done
exit $status
