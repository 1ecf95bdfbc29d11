"""bench/gpu_targets.py: issue 28's targets read off stored GPU results (section 33's H200 calls)."""
from __future__ import annotations

from bench.gpu_calls import STAGES, commands
from bench.gpu_targets import ROOT, load, targets

RESULTS = ROOT / "bench" / "results"


def by_name(found):
    return {t.name.split(" (")[0]: t for t in found}


def test_the_h200_session_reads_as_section_33_reports_it():
    main, fetched, cpu = load([RESULTS / "gpu_h200_session.json", RESULTS / "gpu_h200_anchor.json"])
    t = by_name(targets(main, fetched, cpu))
    assert round(t["1.7B roofline, batch 1"].value, 2) == 0.39 and t["1.7B roofline, batch 1"].met is False
    assert round(t["8B roofline, batch 1"].value, 2) == 0.67 and t["8B roofline, batch 1"].met is False
    assert round(t["1.7B step over compiled transformers"].value, 2) == 1.31 and t["1.7B step over compiled transformers"].met
    assert round(t["verify of 5 / one-token step, batch 1"].value, 2) == 0.97
    assert t["greedy identity, every drafter, batch 1 and 8"].value == "14/14 systems"  # the alone paths are no drafter
    assert round(t["reference pair, best drafter, batch 1"].value, 2) == 1.38
    low = t["reference pair, k auto, batch 8, lowest"]
    assert round(low.value, 2) == 0.75 and low.met is False
    for name in ("verify of 5 / one-token step, batch 16", "chi-square on the device, bf16, graph step",
                 "fetched pair alone, GPU / CPU tokens/s, batch 1", "fetched pair, eagle over alone, batch 1"):
        assert t[name].value is None and t[name].met is None, name


def test_a_fetched_run_is_divided_by_the_cpus_own_figure(tmp_path):
    import json

    fetched = tmp_path / "fetched.json"
    rate = lambda x: {"tokens_per_s_median": x, "x_alone_graph": None, "identical_to_graph_alone": "16/16"}  # noqa: E731
    fetched.write_text(json.dumps({"rows": [], "sections": {"pair": {
        "batch_1": {"systems": {"alone-graph": rate(1460.0), "eagle-k4": rate(2000.0) | {"x_alone_graph": 1.2}}}}}}))
    main, got, cpu = load([fetched])
    t = by_name(targets(main, got, cpu))
    cpu_b1 = cpu["sections"]["pair"]["batch_1"]["systems"]["alone-eager"]["tokens_per_s_median"]
    assert t["fetched pair alone, GPU / CPU tokens/s, batch 1"].value == 1460.0 / cpu_b1
    assert t["fetched pair, eagle over alone, batch 1"].value == 1.2 and t["fetched pair, eagle over alone, batch 1"].met is False


def test_every_gpu_stage_ends_by_printing_its_targets():
    for stage in STAGES.values():
        if stage.gpu_args:
            last = commands(stage, "/out", here=True)[-1]
            assert last[1:] == ["bench/gpu_targets.py", last[-1]] and last[-1].startswith("/out/")
