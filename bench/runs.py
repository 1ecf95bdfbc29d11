"""Before / after comparisons of a benchmark's runs: each checkout run alone, alternating, then the runs
pooled per label (`--compare before=a1.json,a2.json after=b1.json,b2.json`)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_compare(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--compare", nargs="+", metavar="LABEL=RUN.json[,RUN.json]",
                    help="no run: pool earlier runs per label into --out (JSON + PNG), e.g. before / after a change")


def labelled_runs(labelled: list[str]) -> dict[str, list[dict]]:
    """label -> the reports of its runs, from ["label=run1.json,run2.json", ...]."""
    runs = {}
    for item in labelled:
        label, files = item.split("=", 1)
        runs[label] = [json.loads(Path(f).read_text()) for f in files.split(",")]
    return runs
