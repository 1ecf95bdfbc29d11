#!/usr/bin/env bash
# Creates .venv and installs specloop with its test and benchmark extras. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v '^WARNING' || true
# The CPU build of torch lies on disk; pinning it first keeps pip from pulling a CUDA build.
.venv/bin/python -m pip install -q torch==2.13.0 2>&1 | grep -v '^WARNING' || true
.venv/bin/python -m pip install -q -e '.[dev,bench]' 2>&1 | grep -v '^WARNING' || true
.venv/bin/python -c "import torch, transformers, drafter, services, trainer" \
  || { echo "setup failed: specloop does not import" >&2; exit 1; }
