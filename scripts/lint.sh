#!/usr/bin/env bash
# Lint and type-check: ruff on the whole repository, mypy on the installed package's layout.
# mypy cannot follow the package-dir mapping (specloop.drafter is the folder drafter/), so it reads a
# tree of links shaped like the installed package. Run by scripts/test.sh before the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
.venv/bin/ruff check .
TREE=$(mktemp -d)
trap 'rm -rf "$TREE"' EXIT
mkdir -p "$TREE/specloop"
cp specloop/*.py "$TREE/specloop/"
for room in drafter trainer services; do ln -s "$ROOT/$room" "$TREE/specloop/$room"; done
(cd "$TREE" && "$ROOT/.venv/bin/mypy" --config-file "$ROOT/pyproject.toml" --python-executable "$ROOT/.venv/bin/python" \
    -p specloop)
