"""bench/specbench.py --compare: two runs of the same questions compared request by request."""
from __future__ import annotations

import json
import math

import pytest

from bench.specbench import compare, paired_ratios


def run(system: str, qid: str, category: str, prefill: float, seconds: float, tokens: int = 10) -> dict:
    return {"system": system, "qid": qid, "category": category, "prefill_s": prefill, "seconds": seconds,
            "tokens": tokens}


BEFORE = {"runs": [run("alone", "1", "rag", 1.0, 2.0), run("alone", "2", "rag", 4.0, 5.0),
                   run("default", "1", "rag", 1.0, 1.6), run("alone", "3", "qa", 0.1, 1.0)]}
AFTER = {"machine": {"cpu": "test"},
         "runs": [run("alone", "1", "rag", 0.5, 1.5, tokens=20), run("alone", "2", "rag", 2.0, 4.0),
                  run("default", "1", "rag", 0.8, 1.6), run("alone", "9", "qa", 0.1, 1.0)]}


def test_requests_are_paired_by_system_and_question_and_averaged_geometrically_per_category():
    got = paired_ratios([BEFORE], [AFTER])
    rag = got["alone"]["rag"]
    assert rag["requests"] == 2 and math.isclose(rag["prefill"], 0.5)
    assert math.isclose(rag["whole"], math.sqrt(0.75 * 0.8))
    assert math.isclose(rag["per_token"], math.sqrt(0.375 * 0.8))  # question 1's answer twice as long after
    assert math.isclose(rag["share"], (0.5 + 0.8) / 2)
    assert math.isclose(got["default"]["rag"]["prefill"], 0.8) and math.isclose(got["default"]["rag"]["whole"], 1.0)
    assert "qa" not in got["alone"]  # question 3 ran before only, 9 after only: nothing to pair


def test_compare_writes_the_ratios_and_a_plot(tmp_path):
    out = tmp_path / "cmp.json"
    compare({"before": [BEFORE], "after": [AFTER]}, out)
    written = json.loads(out.read_text())
    assert written["labels"] == ["before", "after"]
    assert written["ratios"] == json.loads(json.dumps(paired_ratios([BEFORE], [AFTER])))
    assert out.with_suffix(".png").stat().st_size > 1000


def test_several_runs_a_label_are_paired_in_order_and_pooled(tmp_path):
    slower = {"runs": [run("alone", "1", "rag", 2.0, 4.0)]}
    got = paired_ratios([BEFORE, slower], [AFTER, {"runs": [run("alone", "1", "rag", 2.0, 2.0)]}])
    assert got["alone"]["rag"]["requests"] == 3  # two of the first pair, one of the second
    assert math.isclose(got["alone"]["rag"]["whole"], (0.75 * 0.8 * 0.5) ** (1 / 3))
    with pytest.raises(SystemExit, match="as many of each"):
        compare({"before": [BEFORE, slower], "after": [AFTER]}, tmp_path / "cmp.json")
