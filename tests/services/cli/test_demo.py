"""`specloop demo`, the main job: serve, chat through the API, print, stop."""
from __future__ import annotations

from specloop.services.cli.demo import comparison, request_line, summary
from specloop.services.cli.main import main


def _run(argv, capsys):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_demo_serves_the_examples_through_the_api_and_stops_the_server(tiny_pair, tmp_path, capsys):
    code, out, err = _run(["--threads", "1", "demo", "--verifier", tiny_pair[0], "--drafter", tiny_pair[1],
                           "--max-tokens", 6, "--cache", tmp_path], capsys)
    assert code == 0
    assert "8 chat requests" in err and "k=auto" in err and "α=" in err
    assert "serving verifier as fp32" in err  # the served mode: the checkpoint's own dtype
    assert "specloop serve stopped (exit code 0)" in err
    assert out.count("── ") == 8  # every example prompt answered once, with its own speed-up
    assert out.count("tokens/s = ") == 8 and "── grounded-summary" in out
    assert "verifier alone:" in err and "with speculation:" in err and "identical answers" in err


def test_comparison_reports_the_speed_up_and_whether_answers_match():
    reply = lambda text, n: {"choices": [{"message": {"content": text}}], "usage": {"completion_tokens": n}}  # noqa: E731
    line = comparison([reply("a", 10)], 2.0, [reply("a", 10)], 1.0)
    assert "5.0 tokens/s" in line and "10.0 tokens/s" in line and "2.00x" in line and "identical answers" in line
    assert "answers differ" in comparison([reply("a", 10)], 2.0, [reply("b", 10)], 1.0)



def test_summary_reports_acceptance_rate_and_block_efficiency_from_usage():
    usage = [{"completion_tokens": 10, "drafted_tokens": 8, "accepted_tokens": 6, "drafter_version": "v0001"},
             {"completion_tokens": 6, "drafted_tokens": 4, "accepted_tokens": 1, "drafter_version": "v0002"}]
    line = summary([{"usage": u} for u in usage], 2.0, k=4)
    assert "16 tokens in 2.00 s = 8.0 tokens/s" in line
    assert "α=0.583" in line and "τ=3.333" in line and "v0001, v0002" in line


def test_a_request_line_gives_its_own_speed_up_beside_the_verifier_alone():
    reply = lambda n, d, a: {"usage": {"completion_tokens": n, "drafted_tokens": d, "accepted_tokens": a}}  # noqa: E731
    line = request_line("grounded-edit", reply(30, 20, 15), 1.0, reply(30, 0, 0), 2.0)
    assert line.startswith("── grounded-edit") and "15.0 → 30.0 tokens/s = 2.00x" in line and "accepted 15/20" in line
    assert "30.0 tokens/s;" in request_line("r", reply(30, 20, 15), 1.0, None, None)


def test_paired_rounds_run_each_chunk_with_speculation_then_at_once_alone(monkeypatch, tmp_path):
    from specloop.services.cli import demo

    calls = []

    def timed_round(url, model, chunk, cfg, speculate):  # the order the requests go out in, and their answers
        calls.append((tuple(chunk), speculate))
        return [{"id": f"{r}-{speculate}"} for r in chunk], 1.0, [0.5] * len(chunk)

    monkeypatch.setattr(demo, "timed_round", timed_round)
    cfg = demo.DemoConfig(verifier=tmp_path, drafter=tmp_path, prompts=tmp_path, registry=tmp_path, clients=2)
    spec, alone = demo.paired_rounds("u", "m", ["a", "b", "c"], cfg)
    assert calls == [(("a", "b"), True), (("a", "b"), False), (("c",), True), (("c",), False)]
    assert [r["id"] for r in spec.replies] == ["a-True", "b-True", "c-True"] and spec.seconds == 2.0
    assert alone is not None and [r["id"] for r in alone.replies] == ["a-False", "b-False", "c-False"]
    cfg.compare = False
    calls.clear()
    assert demo.paired_rounds("u", "m", ["a"], cfg)[1] is None and calls == [(("a",), True)]
