import json
import re
import subprocess
import sys

import pytest

from specloop.services.cli.main import main


def _prompts(tmp_path, rows):
    f = tmp_path / "prompts.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f


ROWS = [
    {"id": "a", "prompt": "def main():\n"},
    {"id": "b", "messages": [{"role": "user", "content": "hello there"}]},
    {"id": "a-again", "prompt": "def main():\n"},
]


def _run(args, capsys):
    code = main(["--threads", "1", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_json_follows_the_contract(tiny_pair, tmp_path, capsys):
    v, d = tiny_pair
    f = _prompts(tmp_path, ROWS)
    code, out, _ = _run(["generate", "--verifier", v, "--drafter", d, "--prompts", f, "--max-tokens", 8, "--json"], capsys)
    assert code == 0
    results = [json.loads(line) for line in out.splitlines()]
    assert [r["id"] for r in results] == ["a", "b", "a-again"]
    for r in results:
        assert set(r) >= {"id", "token_ids", "text", "stats"}
        assert set(r["stats"]) == {"blocks", "drafted", "accepted", "block_efficiency", "accepted_per_position"}
        assert len(r["stats"]["accepted_per_position"]) == 4 and 0 < len(r["token_ids"]) <= 8


def test_speculative_and_reference_runs_agree_through_the_cli(tiny_pair, tmp_path, capsys):
    v, d = tiny_pair
    f = _prompts(tmp_path, ROWS)
    common = ["generate", v, "--prompts", f, "--max-tokens", 12, "--json"]
    _, ref, _ = _run(common + ["--no-speculation"], capsys)
    _, spec, _ = _run(common + ["--drafter", d, "--k", 3, "--batch-size", 2], capsys)
    _, ngram, _ = _run(common + ["--drafter-kind", "ngram", "--k", 2], capsys)
    _, auto, _ = _run(common + ["--drafter", d, "--k", "auto", "--batch-size", 2], capsys)
    tokens = lambda out: [json.loads(line)["token_ids"] for line in out.splitlines()]
    assert tokens(ref) == tokens(spec) == tokens(ngram) == tokens(auto)


def test_k_is_auto_by_default_and_the_summary_says_what_was_chosen(tiny_pair, tmp_path, capsys):
    v, d = tiny_pair
    f = _prompts(tmp_path, ROWS)
    code, out, err = _run(["generate", "--verifier", v, "--drafter", d, "--prompts", f, "--max-tokens", 8], capsys)
    assert code == 0 and "k=auto (mean " in err
    code, out, err = _run(["generate", v, "--drafter", d, "--prompts", f, "--k", "many"], capsys)
    assert code == 2 and out == "" and "expected 'auto' or an integer, got 'many'" in err


def test_seeded_sampling_repeats_and_repeated_prompts_draw_independently(tiny_pair, tmp_path, capsys):
    v, d = tiny_pair
    f = _prompts(tmp_path, [ROWS[0]] * 4)
    args = ["generate", "--verifier", v, "--drafter", d, "--prompts", f, "--max-tokens", 12, "--json"]
    args += ["--temperature", "1.0", "--seed", 5, "--k", 4]  # a fixed k: with auto, the draws follow the k chosen
    first = [json.loads(x)["token_ids"] for x in _run(args, capsys)[1].splitlines()]
    again = [json.loads(x)["token_ids"] for x in _run(args, capsys)[1].splitlines()]
    assert first == again and len({tuple(t) for t in first}) > 1


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--k", "0"], "--k must be auto or >= 1"),
        (["--drafter-kind", "telepathy"], "unknown drafter kind"),
        (["--drafter", "/nonexistent/drafter"], "model directory not found"),
        (["--temperature", "-1"], "temperature"),
    ],
)
def test_bad_arguments_exit_with_code_2_and_a_clear_message(tiny_pair, tmp_path, capsys, extra, message):
    f = _prompts(tmp_path, ROWS)
    args = ["generate", "--verifier", tiny_pair[0], "--prompts", f, *extra]
    if "--drafter" not in extra and "--drafter-kind" not in extra:
        args += ["--drafter", tiny_pair[1]]
    code, _, err = _run(args, capsys)
    assert code == 2 and message in err and "Traceback" not in err


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
          "required": ["name", "n"], "additionalProperties": False}


@pytest.mark.parametrize("flag,value,whole", [
    ("--json-schema", json.dumps(PERSON), lambda t: set(json.loads(t)) == {"name", "n"}),
    ("--json-schema", "FILE", lambda t: set(json.loads(t)) == {"name", "n"}),
    ("--regex", "[a-z]{3} [0-9]{2}", lambda t: re.fullmatch("[a-z]{3} [0-9]{2}", t) is not None),
    ("--grammar-file", 'root ::= "yes" | "no"', lambda t: t in ("yes", "no")),  # GBNF, converted
])
def test_generate_constrains_every_answer_and_speculation_keeps_the_verifiers_tokens(reference_pair, tmp_path, capsys,
                                                                                   flag, value, whole):
    v, d = reference_pair
    if flag == "--grammar-file" or value == "FILE":
        path = tmp_path / "constraint"
        path.write_text(json.dumps(PERSON) if value == "FILE" else value)
        value = path
    common = ["generate", v, "--prompts", _prompts(tmp_path, ROWS), "--max-tokens", 40, "--json", flag, value]
    code, ref, err = _run(common + ["--no-speculation"], capsys)
    assert code == 0, err
    _, spec, _ = _run(common + ["--drafter", d], capsys)
    _, suffix, _ = _run(common + ["--drafter-kind", "suffix", "--k", 4], capsys)
    results = [json.loads(line) for line in ref.splitlines()]
    tokens = lambda out: [json.loads(line)["token_ids"] for line in out.splitlines()]  # noqa: E731
    assert tokens(spec) == tokens(suffix) == [r["token_ids"] for r in results]
    finished = [r["text"] for r in results if r["finish_reason"] == "stop"]
    assert finished and all(whole(t) for t in finished)


@pytest.mark.parametrize("extra,message", [
    (["--json-schema", "{not json"], "--json-schema: not a JSON schema"),
    (["--json-schema", "/nonexistent/schema.json"], "--json-schema /nonexistent/schema.json: No such file"),
    (["--json-schema", "[1, 2]"], "--json-schema: not a JSON schema (a schema is a JSON object)"),
    (["--regex", "(open"], "--regex: regex"),
    (["--grammar-file", "/nonexistent/g.lark"], "--grammar-file /nonexistent/g.lark: No such file"),
    (["--regex", "a+", "--json-schema", "{}"], "--json-schema and --regex: give one"),
])
def test_a_bad_constraint_exits_with_code_2_before_any_model_loads(tmp_path, capsys, extra, message):
    code, out, err = _run(["generate", tmp_path / "no-model", "--prompts", _prompts(tmp_path, ROWS), *extra], capsys)
    assert code == 2 and out == "" and message in err and "Traceback" not in err


def test_a_grammar_file_neither_lark_nor_gbnf_exits_with_code_2(tmp_path, capsys):
    bad = tmp_path / "bad.gbnf"
    bad.write_text('root ::= ( "a" | ')
    code, out, err = _run(["generate", tmp_path / "no-model", "--prompts", _prompts(tmp_path, ROWS),
                           "--grammar-file", bad], capsys)
    assert code == 2 and out == "" and "--grammar-file: neither Lark nor GBNF" in err and "Traceback" not in err


def test_an_empty_prompt_exits_with_code_2(tiny_pair, tmp_path, capsys):
    f = _prompts(tmp_path, [{"id": "x", "prompt": ""}])
    code, _, err = _run(["generate", "--verifier", tiny_pair[0], "--drafter-kind", "ngram", "--prompts", f], capsys)
    assert code == 2 and "non-empty" in err


def test_a_missing_verifier_directory_exits_with_code_2(tmp_path, capsys):
    f = _prompts(tmp_path, ROWS)
    code, _, err = _run(["generate", "--verifier", tmp_path / "nope", "--drafter-kind", "ngram", "--prompts", f], capsys)
    assert code == 2 and "model directory not found" in err


def test_the_installed_console_script_runs(tiny_pair, tmp_path):
    f = _prompts(tmp_path, ROWS[:1])
    cmd = [sys.executable, "-m", "specloop", "--threads", "1", "generate", "--verifier", str(tiny_pair[0])]
    cmd += ["--drafter", str(tiny_pair[1]), "--prompts", str(f), "--max-tokens", "4"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "tokens/s" in done.stderr and "τ=" in done.stderr
    bad = subprocess.run(cmd[:-4] + ["--k", "-3"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2


@pytest.mark.parametrize("args,message", [
    (["generate", "{v}", "--prompts", "{f}"], "MODEL without a drafter"),
    (["generate", "--prompts", "{tmp}/absent.jsonl"], "prompt file not found"),
    (["generate", "{v}", "--drafter-kind", "ngram", "--prompts", "{bad}"], "'id' must be a non-empty string"),
    (["replay", "--prompts", "{f}", "{tmp}/absent.jsonl"], "prompt file not found"),
])
def test_a_usage_error_is_told_before_torch_is_imported(tiny_pair, tmp_path, args, message):
    """A mistyped command answers in well under a second: nothing heavy is imported before its checks."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1}\n')
    fill = {"v": tiny_pair[0], "f": _prompts(tmp_path, ROWS), "tmp": tmp_path, "bad": bad}
    argv = [a.format(**fill) for a in args]
    probe = ("import sys; from specloop.services.cli.main import main; code = main(sys.argv[1:]); "
             "print(code, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["2", "False"] and message in done.stderr, (done.stdout, done.stderr)


def test_demo_needs_both_models_or_neither(tiny_pair, capsys):
    code, _, err = _run(["demo", "--verifier", tiny_pair[0]], capsys)
    assert code == 2 and "give both" in err


def test_sd2_on_a_plain_drafter_directory_drafts_exactly_like_pretrained(tiny_pair, tmp_path, capsys):
    v, d = tiny_pair
    f = _prompts(tmp_path, ROWS)
    common = ["generate", "--verifier", v, "--drafter", d, "--prompts", f, "--max-tokens", 10, "--json"]
    common += ["--temperature", "1.0", "--seed", 2, "--k", 3]
    plain = [json.loads(x) for x in _run(common, capsys)[1].splitlines()]
    steered = [json.loads(x) for x in _run(common + ["--drafter-kind", "sd2"], capsys)[1].splitlines()]
    assert [(r["token_ids"], r["stats"]) for r in plain] == [(r["token_ids"], r["stats"]) for r in steered]


def test_dvi_without_a_checkpoint_uses_an_untrained_head_and_stays_lossless(tiny_pair, tmp_path, capsys):
    f = _prompts(tmp_path, ROWS)
    common = ["generate", "--verifier", tiny_pair[0], "--prompts", f, "--max-tokens", 10, "--json"]
    ref = [json.loads(x)["token_ids"] for x in _run(common + ["--no-speculation"], capsys)[1].splitlines()]
    dvi = [json.loads(x)["token_ids"] for x in _run(common + ["--drafter-kind", "dvi"], capsys)[1].splitlines()]
    assert dvi == ref


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--prompts", "/nonexistent/prompts.jsonl"], "prompt file not found"),
        (["--learner", "telepathy"], "unknown learner 'telepathy'"),
        (["--buffer", "kafka://somewhere"], "unknown replay buffer spec 'kafka://somewhere'"),
        (["--buffer", "redis://127.0.0.1:notaport"], "unknown replay buffer spec"),
    ],
)
def test_replay_with_a_bad_argument_exits_with_code_2_before_ray_starts(tiny_pair, tmp_path, capsys, extra, message):
    import ray

    args = ["replay", "--verifier", tiny_pair[0], "--drafter", tiny_pair[1]]
    if "--prompts" not in extra:
        args += ["--prompts", _prompts(tmp_path, ROWS)]
    code, out, err = _run(args + extra, capsys)
    assert code == 2 and out == ""
    assert err.splitlines() == [err.strip()] and err.startswith("specloop: error: ") and message in err
    assert not ray.is_initialized()


# ---- one command line: MODEL, global options, environment, --config, --version


def test_the_model_may_be_positional_or_given_with_verifier(tiny_pair, tmp_path, capsys):
    v, d = tiny_pair
    f = _prompts(tmp_path, ROWS[:1])
    common = ["--drafter", d, "--prompts", f, "--max-tokens", 6, "--k", 3, "--json"]  # a fixed k: the same stats
    positional = _run(["generate", v, *common], capsys)
    alias = _run(["generate", "--verifier", v, *common], capsys)
    both = _run(["generate", v, "--verifier", v, *common], capsys)
    assert positional[0] == alias[0] == both[0] == 0 and positional[1] == alias[1] == both[1] != ""
    code, out, err = _run(["generate", v, "--verifier", tmp_path, *common], capsys)
    assert (code, out) == (2, "") and "MODEL and --verifier name different directories" in err


def test_the_command_line_model_wins_over_the_environment(tiny_pair, tmp_path, capsys, monkeypatch):
    v, d = tiny_pair
    f = _prompts(tmp_path, ROWS[:1])
    monkeypatch.setenv("SPECLOOP_VERIFIER", str(tmp_path / "stale"))
    code, out, _ = _run(["generate", v, "--drafter", d, "--prompts", f, "--max-tokens", 4, "--json"], capsys)
    assert code == 0 and len(out.splitlines()) == 1
    monkeypatch.setenv("SPECLOOP_MODEL", str(tmp_path / "other"))  # the same source, two directories
    code, _, err = _run(["generate", "--drafter", d, "--prompts", f], capsys)
    assert code == 2 and "MODEL and --verifier name different directories" in err


def test_options_come_from_the_environment_and_the_config_file(tiny_pair, tmp_path, capsys, monkeypatch):
    v, d = tiny_pair
    f = _prompts(tmp_path, ROWS)
    cfg = tmp_path / "gen.yaml"
    cfg.write_text(f"model: {v}\ndrafter: {d}\nprompts: {f}\nmax_tokens: 3\nlimit: 1\njson: true\n")
    code, out, _ = _run(["generate", "--config", cfg], capsys)
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and [r["id"] for r in rows] == ["a"] and len(rows[0]["token_ids"]) <= 3
    monkeypatch.setenv("SPECLOOP_LIMIT", "2")
    monkeypatch.setenv("SPECLOOP_MAX_TOKENS", "5")
    out = _run(["generate", "--config", cfg, "--max-tokens", 1], capsys)[1]
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["id"] for r in rows] == ["a", "b"] and {len(r["token_ids"]) for r in rows} == {1}


def test_global_options_may_follow_the_command_and_win_there(tiny_pair, tmp_path, capsys):
    import torch

    f = _prompts(tmp_path, ROWS[:1])
    args = [tiny_pair[0], "--drafter-kind", "ngram", "--prompts", f, "--max-tokens", 2, "--json"]
    assert main(["--threads", "2", "generate", *args, "--threads", "1"]) == 0
    assert torch.get_num_threads() == 1
    assert main(["generate", *args, "--threads", "2"]) == 0
    assert torch.get_num_threads() == 2
    assert main(["--threads", "1", "generate", *args]) == 0
    assert torch.get_num_threads() == 1
    capsys.readouterr()


@pytest.mark.parametrize("argv,message", [
    (["serve", "--workers", "1", "--threads", "0"], "Invalid value for '--threads'"),
    (["serve", "--drain-timeout", "-1"], "Invalid value for '--drain-timeout'"),
    (["api", "--port", "http"], "Invalid value for '--port'"),
    (["serve", "--weights", "int3"], "Invalid value for '--weights'"),
    (["serve", "--bogus"], "No such option"),
    (["teleport"], "No such command"),
    (["serve", "--max-context", "0"], "--max-context must be >= 1"),
    (["serve", "v", "--verifier", "w"], "MODEL and --verifier name different directories"),
    (["serve", "--drafter", "d"], "--drafter without MODEL"),
    (["serve", "v"], "model directory not found: v"),
    (["serve", "v", "--max-model-len", "0"], "--max-model-len must be >= 1"),
    (["serve", "v", "--dtype", "float16"], "use --dtype bfloat16"),
    (["--threads", "1", "models", "fetch", "--drafter-minutes", "0"], "--drafter-minutes must be > 0"),
    (["train", "offline", "--verifier", "v", "--out", "o"], "Missing option '--method'"),
])
def test_bad_input_exits_2_with_one_line_before_anything_loads(capsys, argv, message):
    code, out, err = _run(argv, capsys)
    assert (code, out) == (2, "") and err.startswith("specloop: error: ") and message in err
    assert err.count("\n") == 1


def test_serve_reads_its_options_from_the_environment_and_the_config(tmp_path, capsys, monkeypatch):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("slots: 4\nmax-context: 0\napi_key: k\n")
    assert _run(["serve", "v", "--config", cfg], capsys)[2].count("--max-context must be >= 1") == 1
    monkeypatch.setenv("SPECLOOP_MAX_CONTEXT", "512")
    monkeypatch.setenv("SPECLOOP_SLOTS", "0")
    assert "--slots must be >= 1" in _run(["serve", "v", "--config", cfg], capsys)[2]
    assert "model directory not found: v" in _run(["serve", "v", "--config", cfg, "--slots", "2"], capsys)[2]
    cfg.write_text("drain-timeout: 5\nserved-model-name: m\nbogus_key: 1\n")
    code, _, err = _run(["serve", "v", "--config", cfg], capsys)
    assert code == 2 and "unknown key 'bogus_key' for `specloop serve`" in err


def test_replay_takes_several_prompt_files_after_one_prompts(tiny_pair, tmp_path, capsys):
    import ray

    good = _prompts(tmp_path, ROWS)
    args = ["replay", tiny_pair[0], "--drafter", tiny_pair[1], "--prompts", good, tmp_path / "second.jsonl", "--json"]
    code, out, err = _run(args, capsys)
    assert (code, out) == (2, "") and f"prompt file not found: {tmp_path / 'second.jsonl'}" in err
    assert not ray.is_initialized()


def test_version_prints_the_package_version(capsys):
    from importlib.metadata import version

    assert _run(["--version"], capsys)[:2] == (0, f"specloop {version('specloop')}\n")
    assert main(["--version", "teleport"]) == 0  # eager: before the command is looked at


def test_help_works_for_every_command(capsys):
    for argv in (["serve"], ["generate"], ["replay"], ["api"], ["demo"], ["models", "fetch"], ["train", "offline"]):
        code, out, _ = _run([*argv, "--help"], capsys)
        assert code == 0 and out.startswith(f"Usage: specloop {' '.join(argv)} ") and "--threads" in out
    assert "[MODEL]" in _run(["serve", "--help"], capsys)[1]
    assert "--verifier" not in _run(["serve", "--help"], capsys)[1]  # the hidden alias


def test_no_command_shows_the_help_and_exits_2(capsys):
    assert main([]) == 2
    assert "Commands:" in capsys.readouterr().err
    code, _, err = _run([], capsys)  # global options only
    assert code == 2 and err == "specloop: error: Missing command. (see 'specloop --help')\n"


def test_serve_answers_as_the_served_model_name_and_asks_for_the_api_key(tiny_pair, tmp_path, monkeypatch):
    """End to end (a real `specloop serve` process): MODEL positional, --served-model-name from the
    command line, the API key from SPECLOOP_API_KEY, the drain timeout and learner from --config."""
    import httpx

    from specloop.services.cli.launch import ServeProcess

    monkeypatch.setenv("SPECLOOP_API_KEY", "sekret")
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("drain-timeout: 2\nlearner: 'off'\nslots: 1\n")
    flags = [tiny_pair[0], "--drafter", tiny_pair[1], "--served-model-name", "tiny-chat", "--config", cfg]
    server = ServeProcess(flags, threads=1, registry=tmp_path / "registry")  # its key: SPECLOOP_API_KEY
    try:
        server.start(timeout=240)
        assert server.model == "tiny-chat" and server.headers == {"Authorization": "Bearer sekret"}
        assert httpx.get(f"{server.url}/v1/models", timeout=10).status_code == 401
        models = httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer sekret"}, timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["tiny-chat"]
    finally:
        code = server.stop()
        server.forget_redis_keys()
    assert code == 0


def test_speculators_default_to_the_kinds_and_none_turns_them_off():
    from specloop.services.cli.main import _speculators
    from specloop.services.cli.options import UsageError

    assert _speculators(None, "eagle") == ("suffix",)
    assert _speculators("none", "eagle") == ()
    assert _speculators("static, suffix", "eagle") == ("static", "suffix")
    assert _speculators(None, "pretrained") == ()
    with pytest.raises(UsageError, match="model-free"):
        _speculators("suffix", "ngram")
