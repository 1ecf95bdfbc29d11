"""Run a benchmark with specloop's CPU kernels as an earlier git revision wrote them: the "before" of a
before / after on one machine, everything else (engine, controller, drafters, the benchmark) as this tree
has it, so that the kernels are the only difference.

    .venv/bin/python bench/kernels_at.py b039769 bench/specbench.py --questions Q.jsonl --out specbench_before

The revision's drafter/model/csrc/ is extracted from git into a temporary folder and built for this CPU
under a name of its own (cached, as the tree's own build is); every kernel call of the process, model
loads included, then goes to that build. bench/step_cost.py --baseline uses the same two functions to time
both builds in turn in one process.
"""
from __future__ import annotations

import contextlib
import functools
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CSRC = "drafter/model/csrc"


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True).stdout


def build_at(rev: str):
    """This CPU's kernels as revision `rev` wrote them (built once per revision and CPU)."""
    from specloop.drafter.model import kernels

    sha = _git("rev-parse", "--short", rev).strip()
    folder = Path(tempfile.gettempdir()) / f"specloop_csrc_{sha}"  # one folder a revision, rewritten alike
    folder.mkdir(exist_ok=True)
    for name in _git("ls-tree", "--name-only", f"{sha}:{CSRC}").split():
        (folder / name).write_text(_git("show", f"{sha}:{CSRC}/{name}"))
    return kernels.build(folder, f"specloop_kernels_at_{sha}")


@contextlib.contextmanager
def kernels_from(mod):
    """Every call to specloop's kernels served by `mod` meanwhile (None: the tree's own build), loads
    included (a weight binds its product's function when it is built)."""
    from specloop.drafter.model import kernels

    if mod is None:
        yield
        return
    saved = kernels._module
    kernels._module = functools.cache(lambda: mod)  # the module-level lookup every kernel call makes
    try:
        yield
    finally:
        kernels._module = saved


def main() -> None:
    if len(sys.argv) < 3:
        print(__doc__.strip().splitlines()[0], "\nusage: kernels_at.py REV SCRIPT [ARGS...]", file=sys.stderr)
        raise SystemExit(2)
    rev, script, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    sys.path.insert(0, str(ROOT))
    mod = build_at(rev)
    print(f"kernels as {rev} wrote them: {mod.__name__}", file=sys.stderr)
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).resolve().parent))
    with kernels_from(mod):
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
