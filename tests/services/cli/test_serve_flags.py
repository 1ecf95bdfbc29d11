"""`specloop serve` with vLLM's launch flags, checked at the config level: the command line (environment,
--config) parsed into the ServeConfig that `run_serve` would start, without starting Ray."""
from __future__ import annotations

import json
import logging

import pytest

import specloop.services.cli.deployment as deployment
from specloop.services.cli.deployment import Deployment, ServeConfig
from specloop.services.cli.main import KV_BUDGET, MIN_DEFAULT_CONTEXT, default_context, main
from specloop.services.cli.options import UsageError, parse_speculative_config, served_weights
from specloop.services.worker.worker import WorkerConfig
from tests.tiny import llama_config


@pytest.fixture
def model_dir(tmp_path):
    """A model directory as serve's parsing reads it (config.json only): a Llama of 8192 positions."""
    out = tmp_path / "model"
    llama_config(vocab=64, layers=2, hidden=32, max_position_embeddings=8192).save_pretrained(out)
    return out


@pytest.fixture
def served(monkeypatch):
    """The ServeConfigs `specloop serve` hands to run_serve (which starts nothing here)."""
    configs: list[ServeConfig] = []
    monkeypatch.setattr(deployment, "run_serve", lambda cfg: configs.append(cfg) or 0)
    return configs


def _serve(argv, capsys):
    code = main(["--threads", "1", "serve", *map(str, argv)])
    out = capsys.readouterr()
    return code, out.err


def test_vllm_flags_parse_into_the_serve_config(model_dir, served, capsys):
    argv = [model_dir, "--max-model-len", 4096, "--max-num-seqs", 16, "--dtype", "bfloat16",
            "--served-model-name", "m", "--api-key", "k"]
    assert _serve(argv, capsys) == (0, "")
    cfg = served[-1]
    assert (cfg.verifier, cfg.max_context, cfg.slots, cfg.weights, cfg.model_id, cfg.api_key) == (
        model_dir, 4096, 16, "bf16", "m", "k")
    # no drafter named: suffix decoding (model-free), which the learner does not train
    assert (cfg.drafter, cfg.kind, cfg.learner) == (None, "suffix", "off")
    assert (cfg.prefix_caching, cfg.chat_template, cfg.uvicorn_log_level) == (True, None, "warning")


def test_the_old_names_are_hidden_aliases_that_still_work(model_dir, served, capsys):
    assert _serve([model_dir, "--max-context", 2048, "--slots", 4], capsys)[0] == 0
    assert (served[-1].max_context, served[-1].slots) == (2048, 4)
    assert main(["serve", "--help"]) == 0
    help_text = capsys.readouterr().out
    assert "--max-model-len" in help_text and "--max-num-seqs" in help_text and "--dtype" in help_text
    assert "--max-context" not in help_text and "--slots" not in help_text
    code, err = _serve([model_dir, "--max-model-len", 2048, "--max-context", 1024], capsys)
    assert code == 2 and "--max-model-len 2048 and --max-context 1024: give one" in err
    code, err = _serve([model_dir, "--slots", 0], capsys)
    assert code == 2 and "--slots must be >= 1" in err


def test_new_names_come_from_the_environment_and_the_config_file(model_dir, served, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("SPECLOOP_MAX_MODEL_LEN", "3072")
    monkeypatch.setenv("SPECLOOP_MAX_NUM_SEQS", "3")
    monkeypatch.setenv("SPECLOOP_DTYPE", "float32")
    assert _serve([model_dir], capsys)[0] == 0
    assert (served[-1].max_context, served[-1].slots, served[-1].weights) == (3072, 3, "fp32")
    assert _serve([model_dir, "--max-context", 1024], capsys)[0] == 0  # the command line wins over the environment
    assert served[-1].max_context == 1024
    for name in ("SPECLOOP_MAX_MODEL_LEN", "SPECLOOP_MAX_NUM_SEQS", "SPECLOOP_DTYPE"):
        monkeypatch.delenv(name)
    config = tmp_path / "serve.yaml"
    config.write_text("max-model-len: 2048\nmax_num_seqs: 2\nquantization: int8\nno-enable-prefix-caching: true\n"
                      "uvicorn-log-level: info\n")
    code, err = _serve([model_dir, "--config", config], capsys)
    assert code == 2 and "unknown key 'no-enable-prefix-caching'" in err  # a flag's key is its on-name
    config.write_text("max-model-len: 2048\nmax_num_seqs: 2\nquantization: int8\nenable-prefix-caching: false\n"
                      "uvicorn-log-level: info\n")
    assert _serve([model_dir, "--config", config], capsys)[0] == 0
    cfg = served[-1]
    assert (cfg.max_context, cfg.slots, cfg.weights, cfg.prefix_caching, cfg.uvicorn_log_level) == (
        2048, 2, "int8", False, "info")
    monkeypatch.setenv("SPECLOOP_SLOTS", "5")  # an old name's variable still works
    assert _serve([model_dir], capsys)[0] == 0 and served[-1].slots == 5


def test_the_context_defaults_to_the_models_maximum_within_the_kv_budget(model_dir, served, capsys, tmp_path):
    assert _serve([model_dir], capsys)[0] == 0
    assert served[-1].max_context == 8192  # 8 slots x 8192 positions of a small model's KV: well within budget
    code, err = _serve([model_dir, "--max-model-len", 8193], capsys)
    assert code == 2 and "--max-model-len 8193 exceeds the model's maximum of 8192 positions" in err
    small = tmp_path / "small"
    llama_config(vocab=64, layers=2, hidden=32).save_pretrained(small)  # 512 positions
    assert _serve([small], capsys)[0] == 0
    assert served[-1].max_context == 512  # never raised to the floor above the model's maximum


def test_the_default_context_rule():
    per_position = 32 * 2 * 8 * 128 * 4  # a 7B-class model's fp32 KV: 32 layers, 8 KV heads of 128
    assert default_context(4096, 6144, 8)[0] == 4096
    positions, why = default_context(131072, per_position, 8)
    assert positions == KV_BUDGET // (8 * per_position) // 256 * 256 == 2048
    assert positions * 8 * per_position <= KV_BUDGET and "131072" in why
    assert default_context(131072, per_position, 256)[0] == MIN_DEFAULT_CONTEXT  # the floor
    assert default_context(512, per_position, 256)[0] == 512  # ... but never above the model


def test_a_capped_default_context_is_logged(tmp_path, served, capsys, caplog):
    big = tmp_path / "big"
    llama_config(vocab=64, layers=64, hidden=512, num_attention_heads=4, num_key_value_heads=4,
                 max_position_embeddings=65536).save_pretrained(big)  # 64 x 2 x 4 x 128 x 4 B = 256 KiB/position
    with caplog.at_level(logging.WARNING, logger="specloop.serve"):
        assert _serve([big], capsys)[0] == 0
    assert served[-1].max_context == 2048  # 4 GiB / (8 slots x 256 KiB)
    assert "--max-model-len 2048: the model allows 65536" in caplog.text


def test_the_default_context_counts_the_kv_cache_in_the_dtype_the_workers_keep(tmp_path, served, capsys,
                                                                                 monkeypatch):
    """--kv-cache-dtype bfloat16 halves the bytes a position takes (twice the default context under the same
    budget); auto keeps fp32 on a machine without a GPU, and takes a bf16 checkpoint's dtype where one is seen,
    unless --weights fp32."""
    big = tmp_path / "big"
    config = llama_config(vocab=64, layers=64, hidden=512, num_attention_heads=4, num_key_value_heads=4,
                          max_position_embeddings=65536)
    config.dtype = "bfloat16"
    config.save_pretrained(big)
    assert _serve([big, "--kv-cache-dtype", "bfloat16"], capsys)[0] == 0
    assert served[-1].max_context == 4096  # 4 GiB / (8 slots x 128 KiB)
    assert _serve([big], capsys)[0] == 0
    assert served[-1].max_context == 2048  # no GPU here: the CPU's fp32 cache
    monkeypatch.setattr("specloop.services.cli.main.torch_cuda", lambda: True)
    assert _serve([big], capsys)[0] == 0
    assert served[-1].max_context == 4096  # a GPU: the checkpoint's bf16
    assert _serve([big, "--weights", "fp32"], capsys)[0] == 0
    assert served[-1].max_context == 2048



@pytest.mark.parametrize("dtype,quantization,weights,mode", [
    ("auto", None, "auto", "auto"), ("bfloat16", None, "auto", "bf16"), ("bf16", None, "auto", "bf16"),
    ("float32", None, "auto", "fp32"), ("float", None, "auto", "fp32"), ("fp32", None, "fp32", "fp32"),
    ("BFloat16", None, "bf16", "bf16"), ("auto", "int8", "auto", "int8"), ("auto", "int4", "int4", "int4"),
    ("auto", "w4a8", "auto", "w4a8"), ("auto", None, "int8", "int8"),
])
def test_dtype_and_quantization_map_onto_the_weight_modes(dtype, quantization, weights, mode):
    assert served_weights(dtype, quantization, weights) == mode


@pytest.mark.parametrize("dtype,quantization,weights,message", [
    ("half", None, "auto", "does not serve float16 weights; use --dtype bfloat16"),
    ("float16", None, "auto", "does not serve float16 weights; use --dtype bfloat16"),
    ("int8", None, "auto", "--dtype int8: choose auto, bfloat16"),
    ("auto", "awq", "auto", "--quantization awq: specloop serves int8, int4, w4a8"),
    ("auto", "gptq", "auto", "specloop serves int8, int4, w4a8"),
    ("auto", "fp8", "auto", "specloop serves int8, int4, w4a8"),
    ("auto", "bitsandbytes", "auto", "specloop serves int8, int4, w4a8"),
    ("bfloat16", None, "int8", "--dtype bf16 and --weights int8 name different weight modes"),
    ("bfloat16", "int4", "auto", "leave --dtype auto with --quantization"),
    ("auto", "int8", "int4", "--quantization int8 and --weights int4 name different weight modes"),
])
def test_unservable_or_conflicting_weight_flags_are_usage_errors(dtype, quantization, weights, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(")):
        served_weights(dtype, quantization, weights)


def test_weight_flags_are_refused_from_the_command_line_with_exit_2(model_dir, served, capsys):
    code, err = _serve([model_dir, "--dtype", "half"], capsys)
    assert (code, err.count("\n")) == (2, 1) and "bfloat16" in err
    code, err = _serve([model_dir, "--quantization", "awq"], capsys)
    assert code == 2 and "int8, int4, w4a8" in err
    assert served == []


def test_speculative_config_maps_vllm_methods_onto_drafter_kinds(model_dir, served, capsys, tmp_path, caplog):
    drafter = tmp_path / "drafter"
    llama_config(vocab=64, layers=1, hidden=32).save_pretrained(drafter)
    assert _serve([model_dir, "--speculative-config", '{"method": "ngram"}'], capsys)[0] == 0
    assert (served[-1].kind, served[-1].drafter, served[-1].learner) == ("ngram", None, "off")
    spec = json.dumps({"method": "draft_model", "model": str(drafter), "num_speculative_tokens": 5})
    with caplog.at_level(logging.WARNING, logger="specloop.serve"):
        assert _serve([model_dir, "--speculative-config", spec], capsys)[0] == 0
    assert (served[-1].kind, served[-1].drafter, served[-1].learner) == ("pretrained", drafter, "klrl")
    assert "num_speculative_tokens=5: specloop has no server-wide draft length" in caplog.text
    spec = json.dumps({"method": "eagle3", "model": str(drafter)})
    assert _serve([model_dir, "--speculative-config", spec, "--drafter", drafter], capsys)[0] == 0  # the same one
    assert (served[-1].kind, served[-1].drafter) == ("eagle3", drafter)
    assert _serve([model_dir, "--speculative-config", '{"method": "suffix"}', "--drafter-kind", "suffix"],
                  capsys)[0] == 0


@pytest.mark.parametrize("spec,extra,message", [
    ({"method": "mtp"}, [], "method mtp (the model's own multi-token-prediction layers) is not served"),
    ({"method": "medusa"}, [], "unknown method 'medusa' (accepted: ngram, suffix, eagle, eagle3, draft_model)"),
    ({"method": "ngram", "prompt_lookup_max": 4, "foo": 1}, [], "unknown key(s) foo, prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 0}, [], "num_speculative_tokens must be an integer >= 1"),
    ({"method": "ngram", "model": "x"}, [], "method ngram drafts from the text itself and takes no model"),
    ({"method": "draft_model"}, [], "method draft_model needs a model"),
    ({"method": "ngram"}, ["--drafter-kind", "suffix"], "--drafter-kind suffix and --speculative-config"),
    ({"method": "eagle", "model": "{d}"}, ["--drafter", "{m}"], "--speculative-config model"),
    ([1, 2], [], "expected a JSON object"),
])
def test_bad_speculative_configs_exit_2_with_one_line(model_dir, served, capsys, tmp_path, spec, extra, message):
    text = json.dumps(spec).replace("{d}", str(tmp_path)).replace("{m}", str(model_dir))
    code, err = _serve([model_dir, "--speculative-config", text, *[e.format(m=model_dir) for e in extra]], capsys)
    assert (code, err.count("\n")) == (2, 1) and message in err, err
    assert served == []


def test_speculative_config_that_is_not_json_is_a_usage_error():
    with pytest.raises(UsageError, match="not JSON"):
        parse_speculative_config("{method: ngram}")
    assert parse_speculative_config('{"model": "d"}').kind is None  # a model alone: its manifest's kind


def test_chat_template_is_read_from_a_file_or_given_inline(model_dir, served, capsys, tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}\n{% endfor %}")
    assert _serve([model_dir, "--chat-template", template], capsys)[0] == 0
    assert served[-1].chat_template == template.read_text()
    assert _serve([model_dir, "--chat-template", r"{{ messages[0].content }}\n¶"], capsys)[0] == 0
    assert served[-1].chat_template == "{{ messages[0].content }}\n¶"  # one line, escapes decoded as vLLM does
    code, err = _serve([model_dir, "--chat-template", tmp_path / "missing.jinja"], capsys)
    assert code == 2 and "missing.jinja: no such file" in err


def test_uvicorn_log_level_and_prefix_caching_flags(model_dir, served, capsys):
    assert _serve([model_dir, "--uvicorn-log-level", "debug", "--no-enable-prefix-caching"], capsys)[0] == 0
    assert (served[-1].uvicorn_log_level, served[-1].prefix_caching) == ("debug", False)
    code, err = _serve([model_dir, "--uvicorn-log-level", "loud"], capsys)
    assert code == 2 and "Invalid value for '--uvicorn-log-level'" in err


def test_the_learner_refuses_a_model_free_drafter_before_ray_starts(model_dir, served, capsys):
    code, err = _serve([model_dir, "--learner", "klrl"], capsys)
    assert code == 2 and "not suffix (model-free): give --drafter DIR, or --learner off" in err
    assert served == []


def test_workers_get_prefix_caching_in_their_config(monkeypatch, tmp_path):
    """Deployment._start's worker config is a WorkerConfig's fields, prefix_caching among them (a fake Ray:
    the actor is not started)."""
    import specloop.services.actors as actors
    from specloop.services.worker.worker import WorkerConfig

    started = []

    class FakeActor:
        @staticmethod
        def options(**kwargs):
            return FakeActor

        @staticmethod
        def remote(wcfg, *args):
            started.append(wcfg)

    class FakeRay:
        @staticmethod
        def cluster_resources():
            return {"CPU": 1}

    monkeypatch.setattr(actors, "ServingActor", FakeActor)
    for caching in (True, False):
        deploy = object.__new__(Deployment)
        deploy.cfg = ServeConfig(verifier=tmp_path / "v", drafter=None, kind="suffix", learner="off",
                                 prefix_caching=caching)
        deploy.registry = tmp_path / "registry"
        deploy._start(FakeRay(), None)
        assert WorkerConfig(**started[-1]).prefix_caching is caching


def test_the_api_gets_the_chat_template_and_uvicorn_the_log_level(tiny_pair):
    from specloop.services.api.app import api_server
    from tests.api_helpers import scripted, scripted_app

    app = scripted_app(scripted(tiny_pair[0]), chat_template="{{ messages[0].content }}")
    assert app.state.api.chat_template == "{{ messages[0].content }}"
    server = api_server(app, log_level="debug")
    assert (server.config.log_level, server.config.access_log) == ("debug", True)
    server = api_server(scripted_app(scripted(tiny_pair[0])))
    assert (server.config.log_level, server.config.access_log) == ("warning", False)


def test_generate_shows_only_no_speculation(capsys):
    assert main(["generate", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--no-speculation" in out and "--no-no-speculation" not in out


def test_serve_takes_a_hugging_face_id_from_the_local_cache(reference_pair, served, capsys, tmp_path, monkeypatch):
    from tests.hub_helpers import fake_hub_cache

    repo = "HuggingFaceTB/SmolLM2-135M-Instruct"
    snapshot = fake_hub_cache(tmp_path / "hub", repo, reference_pair[0])
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert _serve([repo, "--max-num-seqs", 2], capsys) == (0, "")
    cfg = served[-1]
    assert (cfg.verifier, cfg.model_id, cfg.max_context, cfg.slots) == (snapshot, repo, 2048, 2)
    assert _serve([repo, "--served-model-name", "smol"], capsys)[0] == 0 and served[-1].model_id == "smol"


def test_an_uncached_hugging_face_id_exits_2_with_one_line(served, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    code, err = _serve(["owner/not-cached", "--max-model-len", 1024], capsys)
    assert (code, err.count("\n")) == (2, 1) and "Traceback" not in err
    assert err.startswith("specloop: error: owner/not-cached is neither a local directory nor in the local "
                          "Hugging Face cache") and "`hf download owner/not-cached`" in err
    assert served == []


def test_kv_cache_dtype_and_enforce_eager_reach_the_workers_and_fp8_is_refused_by_name(model_dir, served, capsys):
    assert _serve([model_dir], capsys)[0] == 0
    assert (served[-1].kv_cache_dtype, served[-1].enforce_eager) == ("auto", False)
    assert _serve([model_dir, "--kv-cache-dtype", "bf16", "--enforce-eager"], capsys)[0] == 0
    assert (served[-1].kv_cache_dtype, served[-1].enforce_eager) == ("bfloat16", True)
    worker = WorkerConfig(**deployment.worker_fields(served[-1], None, "specloop", None))  # what each actor gets
    assert (worker.kv_cache_dtype, worker.enforce_eager, worker.log_records) == ("bfloat16", True, False)
    assert _serve([model_dir, "--kv-cache-dtype", "half"], capsys)[0] == 0  # llama.cpp's default cache
    assert served[-1].kv_cache_dtype == "float16"
    for value, message in (("fp8", "specloop keeps no fp8 KV cache"), ("fp8_e5m2", "no fp8 KV cache"),
                           ("int4", "choose auto, bfloat16")):
        served.clear()
        code, err = _serve([model_dir, "--kv-cache-dtype", value], capsys)
        assert code == 2 and message in err and not served, value
