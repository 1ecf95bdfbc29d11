"""Offline alignment: each method learns, SD² starts as the plain drafter, checkpoints resume
exactly, generated data is cached, and every output loads as a drafter that decodes losslessly."""
import json

import pytest
import torch

from specloop.drafter.decode.engine import generate
from specloop.drafter.decode.requests import StopRule
from specloop.drafter.decode.sampling import SamplingParams
from specloop.drafter.kinds.pretrained import PretrainedDrafter
from specloop.drafter.kinds.table import build_drafter
from specloop.drafter.model.loading import load_model
from specloop.trainer.data import GENERATED_FILE
from specloop.trainer.offline import CHECKPOINT_DIR, CHECKPOINT_JSON, LOG_FILE, OfflineTrainer, train_offline
from specloop.trainer.offline_config import KIND_OF_METHOD, OfflineConfig, config_from_options
from specloop.trainer.students import METHODS
from tests.tiny import CONVERSATIONS, TEXT

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def pair(peaky_pair):
    """The conftest's peaky pair: a 6-layer verifier (so the default steering layers exist) and a 1-layer drafter."""
    return peaky_pair


def config(pair, out, method, **extra):
    base = dict(method=method, verifier=str(pair[0]), drafter=str(pair[1]), out_dir=str(out), max_steps=3,
                batch_size=2, seq_len=24, k=3, warmup_steps=0, lr=1e-2, lm_lr=3e-3, checkpoint_every=100,
                conversations=CONVERSATIONS, gen_batch=4, gen_max_tokens=12)
    return OfflineConfig(**(base | extra))


@pytest.fixture(scope="module")
def trained(pair, tmp_path_factory):
    """method -> out dir after a short run of that method."""
    root = tmp_path_factory.mktemp("trained")
    outs = {}
    for method in METHODS:
        OfflineTrainer(config(pair, root / method, method), progress=False).run()
        outs[method] = root / method
    return outs


@pytest.fixture(scope="module")
def prompts(pair):
    tok = load_model(pair[0]).tokenizer
    return [tok.encode(t[:30], add_special_tokens=False) for t in TEXT]


# ----------------------------------------------------------------------------- learning


@pytest.mark.parametrize("method", METHODS)
def test_a_few_steps_of_each_method_reduce_the_loss_on_a_fixed_batch(pair, tmp_path, method):
    trainer = OfflineTrainer(config(pair, tmp_path, method, k=1), progress=False)  # k = 1: a fixed offset
    batch = trainer.data.batch(2)
    before = trainer.evaluate(batch)["loss"]
    for _ in range(20):
        trainer.step(batch)
    after = trainer.evaluate(batch)
    assert after["loss"] < 0.9 * before
    assert 0.0 <= after["acceptance"] <= 1.0


def test_sd2_frozen_trains_only_the_steering(pair, tmp_path):
    trainer = OfflineTrainer(config(pair, tmp_path, "sd2-frozen"), progress=False)
    names = [n for n, _, _ in trainer.params]
    assert names and all(n.startswith("steering.") for n in names)
    lm_before = {n: p.clone() for n, p in trainer.student.lm.hf.named_parameters()}
    trainer.run()
    assert all(torch.equal(p, lm_before[n]) for n, p in trainer.student.lm.hf.named_parameters())
    assert trainer.student.steering.w_s.abs().sum() > 0


def test_lk_loss_logs_a_kl_weight_that_follows_acceptance(pair, tmp_path):
    OfflineTrainer(config(pair, tmp_path, "distill", loss="lk"), progress=False).run()
    for line in (tmp_path / LOG_FILE).read_text().splitlines():
        rec = json.loads(line)
        assert rec["lambda"] == pytest.approx(max(0.0, min(1.0, 1.0 - rec["acceptance_ema"])))


# ----------------------------------------------------------------------------- outputs


def test_untrained_sd2_drafts_exactly_what_the_pretrained_drafter_drafts(pair, tmp_path, prompts):
    OfflineTrainer(config(pair, tmp_path, "sd2", max_steps=0), progress=False).run()
    verifier = load_model(pair[0])
    steered = build_drafter("sd2", verifier, tmp_path)
    plain = PretrainedDrafter(load_model(pair[1]).lean)
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=3)
    rule = StopRule(frozenset([4]))
    a = generate(verifier.lean, steered, prompts, params, 3, rule)
    b = generate(verifier.lean, plain, prompts, params, 3, rule)
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    assert [g.stats.to_dict() for g in a] == [g.stats.to_dict() for g in b]


@pytest.mark.parametrize("method", METHODS)
def test_outputs_load_as_their_kind_and_decode_losslessly_at_temperature_zero(pair, trained, prompts, method):
    out = trained[method]
    manifest = json.loads((out / "manifest.json").read_text())
    kind = KIND_OF_METHOD[method]
    assert manifest["kind"] == kind and manifest["method"] == method and manifest["steps"] == 3
    verifier = load_model(pair[0])
    drafter = build_drafter(kind, verifier, out)
    params = SamplingParams(max_tokens=16)
    rule = StopRule(frozenset([4]))
    reference = [generate(verifier.lean, None, [p], params, 0, rule)[0].token_ids for p in prompts]
    speculative = generate(verifier.lean, drafter, prompts, params, 3, rule)
    assert [g.token_ids for g in speculative] == reference


def test_distilled_drafter_differs_from_its_base(pair, trained):
    base = load_model(pair[1]).hf.state_dict()
    tuned = load_model(trained["distill"] / "drafter").hf.state_dict()
    assert any(not torch.equal(base[n], tuned[n]) for n in base)


# ----------------------------------------------------------------------------- checkpoints


def trainable_state(trainer):
    return {n: p.detach().clone() for n, p, _ in trainer.params}


def test_a_resumed_run_continues_at_the_saved_step_and_ends_where_an_uninterrupted_one_does(pair, tmp_path):
    whole = OfflineTrainer(config(pair, tmp_path / "whole", "sd2", max_steps=4), progress=False)
    whole.run()

    first = OfflineTrainer(config(pair, tmp_path / "split", "sd2", max_steps=4), progress=False)
    first.run(stop_at=2)
    saved_opt = first.optimizer.state_dict()
    assert json.loads((tmp_path / "split" / CHECKPOINT_DIR / CHECKPOINT_JSON).read_text())["step"] == 2

    second = OfflineTrainer(config(pair, tmp_path / "split", "sd2", max_steps=4, resume=True), progress=False)
    assert second.step_count == 2 and second.tokens_seen == first.tokens_seen
    resumed_opt = second.optimizer.state_dict()
    assert resumed_opt["state"].keys() == saved_opt["state"].keys()
    for i, state in saved_opt["state"].items():
        for key, value in state.items():
            assert torch.equal(resumed_opt["state"][i][key], value)
    assert [g["lr"] for g in resumed_opt["param_groups"]] == [g["lr"] for g in saved_opt["param_groups"]]
    second.run()

    assert second.step_count == 4
    expected = trainable_state(whole)
    got = trainable_state(second)
    assert all(torch.equal(got[n], expected[n]) for n in expected)
    steps = [json.loads(line)["step"] for line in (tmp_path / "split" / LOG_FILE).read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


def test_an_existing_checkpoint_is_not_overwritten_without_resume(pair, tmp_path):
    OfflineTrainer(config(pair, tmp_path, "dvi", max_steps=1), progress=False).run()
    with pytest.raises(ValueError, match="--resume"):
        OfflineTrainer(config(pair, tmp_path, "dvi", max_steps=1), progress=False)
    with pytest.raises(ValueError, match="method"):
        OfflineTrainer(config(pair, tmp_path, "distill", max_steps=2, resume=True), progress=False)


# ----------------------------------------------------------------------------- generated data


def test_generated_data_is_made_once_cached_and_reused(pair, tmp_path):
    cache = tmp_path / "cache"
    first = OfflineTrainer(config(pair, tmp_path / "a", "dvi", data="generated", data_cache=str(cache)), progress=False)
    summary = first.run()
    lines = (cache / GENERATED_FILE).read_text().splitlines()
    assert summary["generated"]["new_sequences"] == len(lines) > 0
    first_turns = {c[0]["content"] for c in CONVERSATIONS}
    tok = first.verifier.tokenizer
    for line in lines:
        rec = json.loads(line)
        assert CONVERSATIONS[rec["conversation"]][0]["content"] in first_turns
        assert tok.decode(rec["prompt_ids"]).startswith("<|user|>")
        assert rec["finish"] in ("stop", "length") and len(rec["generated_ids"]) <= 12

    again = OfflineTrainer(config(pair, tmp_path / "b", "dvi", data="generated", data_cache=str(cache)), progress=False)
    assert again.run()["generated"]["new_sequences"] == 0
    assert (cache / GENERATED_FILE).read_text().splitlines() == lines

    other = tmp_path / "other"
    OfflineTrainer(config(pair, tmp_path / "c", "dvi", data="generated", data_cache=str(other)), progress=False).run()
    assert (other / GENERATED_FILE).read_text().splitlines()[: len(lines)] == lines  # same seed, same samples

    with pytest.raises(ValueError, match="another data cache"):
        OfflineTrainer(config(pair, tmp_path / "d", "dvi", data="generated", data_cache=str(cache), seed=1),
                       progress=False)


# ----------------------------------------------------------------------------- configuration


def test_bad_configurations_are_refused(pair, tmp_path):
    with pytest.raises(ValueError, match="needs --drafter"):
        OfflineTrainer(config(pair, tmp_path, "sd2", drafter=None), progress=False)
    with pytest.raises(ValueError, match="budget"):
        OfflineTrainer(config(pair, tmp_path, "dvi", max_steps=None), progress=False)
    with pytest.raises(ValueError, match="unknown method"):
        OfflineTrainer(config(pair, tmp_path, "medusa"), progress=False)


def _offline_options(argv: list[str]) -> dict:
    """`specloop train offline ARGV` parsed by the real command (not run): its options by field name."""
    from specloop.services.cli.main import app
    from specloop.services.cli.runtime import command, group_from_params
    from specloop.services.cli.train import OfflineOptions

    leaf = command(app).commands["train"].commands["offline"]
    with leaf.make_context("offline", list(argv)) as ctx:
        return vars(group_from_params(OfflineOptions, dict(ctx.params)))


def test_command_line_options_become_a_config(tmp_path):
    options = _offline_options(["--method", "sd2", "--verifier", "v", "--drafter", "d", "--out", "o",
                                "--data", "generated", "--loss", "lk", "--k", "5", "--minutes", "2.5",
                                "--steer-layers", "0", "2", "4", "--resume", "--draft-vocab", "dv"])
    cfg = config_from_options(options, threads=2)
    assert (cfg.method, cfg.verifier, cfg.drafter, cfg.out_dir) == ("sd2", "v", "d", "o")
    assert (cfg.data, cfg.loss, cfg.k, cfg.minutes, cfg.max_steps) == ("generated", "lk", 5, 2.5, None)
    assert (cfg.steer_layers, cfg.resume, cfg.threads, cfg.draft_vocab) == ((0, 2, 4), True, 2, "dv")


def test_the_command_lines_defaults_are_the_configs(tmp_path):
    cfg = config_from_options(_offline_options(["--method", "dvi", "--verifier", "v", "--out", "o"]))
    assert cfg.description() == OfflineConfig(method="dvi", verifier="v", out_dir="o").description()


def test_the_help_names_the_trainers_choices():
    from specloop.services.cli.main import app
    from specloop.services.cli.runtime import command
    from specloop.trainer.losses import LOSSES
    from specloop.trainer.offline_config import DATA_MODES

    helps = {p.name: p.help for p in command(app).commands["train"].commands["offline"].params}
    for name, choices in (("method", METHODS), ("data", DATA_MODES), ("loss", LOSSES)):
        assert helps[name].startswith(" | ".join(choices)), name


def test_a_bad_offline_option_exits_2_before_training(tmp_path, capsys):
    from specloop.services.cli.main import main

    code = main(["train", "offline", "--method", "medusa", "--verifier", str(tmp_path), "--out", str(tmp_path / "o"),
                 "--max-steps", "1"])
    assert code == 2 and "unknown method 'medusa'" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_self_distilled_data_trains_an_eagle_head_within_the_minutes(pair, tmp_path):
    with pytest.raises(ValueError, match="self-distilled trains --method eagle"):
        OfflineTrainer(config(pair, tmp_path / "x", "sd2", data="self-distilled", minutes=1.0), progress=False)
    with pytest.raises(ValueError, match="self-distilled trains --method eagle"):
        train_offline(config(pair, tmp_path / "y", "eagle", data="self-distilled"), progress=False)  # no minutes
    out = tmp_path / "eagle"
    summary = train_offline(config(pair, out, "eagle", data="self-distilled", minutes=0.03, k=2), progress=False)
    assert summary["data"] == "self-distilled" and summary["steps"] > 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["kind"] == "eagle" and manifest["k"] == 2
    assert json.loads((out / "summary.json").read_text()) == summary
