#!/usr/bin/env bash
# Installs everything, makes sure Redis answers on 127.0.0.1:6379, and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/lint.sh  # ruff on the repository, mypy on the specloop package
bash scripts/redis.sh
bash scripts/system-deps.sh  # nginx, prometheus, docker-compose for the deploy tests
# Two pytest workers (pytest-xdist), one per core: every test runs its models on one thread
# (tests/conftest.py), so the suite takes about 60 % of its serial time. SPECLOOP_TEST_WORKERS=0 runs it serially.
WORKERS=${SPECLOOP_TEST_WORKERS:-2}
if [ "$WORKERS" = 0 ]; then exec .venv/bin/python -m pytest "$@"; fi
exec .venv/bin/python -m pytest -n "$WORKERS" --dist load "$@"
