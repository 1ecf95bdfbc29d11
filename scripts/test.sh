#!/usr/bin/env bash
# Installs everything, makes sure Redis answers on 127.0.0.1:6379, and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/redis.sh
bash scripts/system-deps.sh  # nginx, prometheus, docker-compose for the deploy tests
exec .venv/bin/python -m pytest "$@"
