"""Replay records: what a real speculative step logs (positions up to the first rejection, the
verifier's top-K, the drafter kind's inputs), and a wire format that round-trips bit for bit and
refuses anything malformed without ever unpickling."""
from __future__ import annotations

import dataclasses
import json
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import save as st_save

from specloop.drafter.kinds.dvi import DVIDrafter
from specloop.drafter.kinds.pretrained import PretrainedDrafter
from specloop.drafter.kinds.sd2 import SteeredDrafter
from specloop.drafter.model.loading import load_model
from specloop.trainer.records import MAGIC, SCHEMA, RecordError, ReplayRecord, decode, encode
from specloop.trainer.students import verifier_targets
from tests.records_helpers import DVI_LAYERS, TOP_K, K, log_blocks, perturbed_head, perturbed_steering

torch.set_num_threads(1)

ALL = ["pretrained", "self", "sd2", "dvi", "eagle", "sampled"]


# ----------------------------------------------------------------------------- logging real steps






def prompts_for(tokenizer) -> list[list[int]]:
    return [tokenizer.encode("def main():"), tokenizer.encode("The quick brown fox")]






def serving_drafter(kind: str, verifier, drafter):
    if kind == "pretrained":
        return PretrainedDrafter(drafter.lean)
    if kind == "self":  # the verifier drafting for itself: every draft is accepted
        return PretrainedDrafter(verifier.lean)
    if kind == "sd2":
        return SteeredDrafter(drafter.lean, perturbed_steering(verifier.hf, drafter.hf))
    if kind == "dvi":
        return DVIDrafter(verifier.lean, perturbed_head(verifier.hf))
    if kind == "eagle":
        from specloop.drafter.kinds.eagle import EagleDrafter
        from tests.drafter_helpers import trained_eagle as trained_like

        return EagleDrafter(verifier.lean, trained_like(verifier.lean, std=0.1))
    if kind == "eagle3":
        from specloop.drafter.kinds.eagle3 import Eagle3Drafter
        from tests.drafter_helpers import trained_eagle3 as trained_like3

        return Eagle3Drafter(verifier.lean, trained_like3(verifier.lean, std=0.1))
    raise ValueError(kind)




@pytest.fixture(scope="module")
def models(tiny_pair):
    return load_model(tiny_pair[0], dtype=torch.float32), load_model(tiny_pair[1], dtype=torch.float32)


@pytest.fixture(scope="module")
def logged(models):
    """name -> records of a short generation: greedy with pretrained, sd2, dvi and the verifier as its own
    drafter (every draft accepted), and sampled at T = 0.5 with the pretrained drafter (partial acceptance:
    the tiny random models mostly repeat the last token, so greedy blocks accept all or nothing)."""
    v, d = models
    prompts = prompts_for(v.tokenizer)
    out = {}
    for kind in ("pretrained", "self", "sd2", "dvi", "eagle", "eagle3"):
        record_kind = "pretrained" if kind == "self" else kind
        out[kind] = log_blocks(v, serving_drafter(kind, v, d), record_kind, prompts)
    out["sampled"] = log_blocks(v, serving_drafter("pretrained", v, d), "pretrained", prompts, temperature=0.5)
    return out


def assert_same_record(a: ReplayRecord, b: ReplayRecord) -> None:
    for f in dataclasses.fields(ReplayRecord):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            assert isinstance(x, np.ndarray) and isinstance(y, np.ndarray), f.name
            assert x.dtype == y.dtype and x.shape == y.shape, f.name
            assert x.tobytes() == y.tobytes(), f"{f.name} differs"
        else:
            assert type(x) is type(y) and x == y, f.name


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("kind", ALL)
def test_records_from_a_real_step_round_trip_bit_for_bit(logged, kind):
    assert logged[kind]
    for item in logged[kind]:
        payload = encode(item.record)
        assert payload[:4] == MAGIC
        back = decode(payload)
        assert_same_record(item.record, back)
        assert_same_record(decode(encode(back)), item.record)  # (metadata key order may vary between encodes)
        assert_same_record(decode(memoryview(payload)), item.record)
        assert_same_record(decode(bytearray(payload)), item.record)


def test_each_kind_logs_the_inputs_it_needs_to_recompute_its_forward(logged, models):
    v, d = models
    d_v = v.hf.config.hidden_size
    for kind in ("pretrained", "self", "sampled"):
        for item in logged[kind]:
            r = item.record
            assert r.kind == "pretrained" and r.steer is None and r.hidden is None
            assert r.context.tolist() == item.history  # short history: the context window holds all of it
    for item in logged["sd2"]:
        r = item.record
        assert r.kind == "sd2" and r.hidden is None and r.steer.shape == (3, d_v) and r.steer.dtype == np.float32
        assert r.context.tolist() == item.history
    for item in logged["dvi"]:
        r = item.record
        assert r.kind == "dvi" and r.steer is None and len(r.context) == 0
        assert r.hidden.shape == (r.positions, d_v) and r.hidden.dtype == np.float32


def test_sd2_steering_inputs_are_the_verifier_states_where_the_last_committed_token_was_produced(logged, models):
    v, _ = models
    layers = (0, 1, 2)  # default_steer_layers falls back to first / middle / last on 3 layers
    assert any(float(np.abs(item.record.steer).max()) > 0 for item in logged["sd2"])
    for item in logged["sd2"]:
        h = item.history
        _, res = verifier_targets(v.hf, torch.tensor([h[:-1]]), layers)
        want = torch.stack([res[i][0, len(h) - 2] for i in layers]).numpy()  # [3, d_v]
        np.testing.assert_allclose(item.record.steer, want, atol=1e-4)


def test_dvi_hidden_states_are_the_verifiers_residual_after_layer_s_at_the_logged_positions(logged, models):
    v, _ = models
    s = DVI_LAYERS
    for item in logged["dvi"]:
        r, h = item.record, item.history
        ids = torch.tensor([h + r.tokens[:-1].tolist()])
        _, res = verifier_targets(v.hf, ids, (s - 1,))
        want = res[s - 1][0, len(h) - 1 : len(h) - 1 + r.positions].numpy()  # [m, d]
        np.testing.assert_allclose(r.hidden, want, atol=1e-4)


# ----------------------------------------------------------------------------- what is logged


@pytest.mark.parametrize("kind", ALL)
def test_positions_run_up_to_and_including_the_first_rejection_with_rewards_one_then_zero(logged, kind):
    for item in logged[kind]:
        r = item.record
        m = min(item.n + 1, K)
        assert r.positions == m and r.k == K
        want = [1] * item.n + ([0] if item.n < K else [])
        assert r.rewards.tolist() == want[:m]
        assert r.accepted == item.n
        assert r.rewards.dtype == np.uint8


def test_the_verifier_drafting_for_itself_logs_k_positions_all_rewarded(logged):
    assert logged["self"]
    for item in logged["self"]:
        assert item.n == K and item.record.positions == K and item.record.rewards.tolist() == [1] * K


def test_the_logged_blocks_cover_no_partial_and_full_acceptance(logged):
    ns = {item.n for items in logged.values() for item in items}
    assert 0 in ns and K in ns and ns & set(range(1, K)), ns
    partial = [item for item in logged["sampled"] if 0 < item.n < K]
    assert partial
    for item in partial:
        assert item.record.rewards.tolist() == [1] * item.n + [0]


@pytest.mark.parametrize("kind", ALL)
def test_top_logprobs_are_sorted_and_with_the_rest_mass_sum_to_one(logged, kind):
    for item in logged[kind]:
        r = item.record
        assert r.top_ids.shape == r.top_logprobs.shape == (r.positions, TOP_K)
        assert np.all(np.diff(r.top_logprobs, axis=1) <= 0)
        total = np.exp(r.top_logprobs.astype(np.float64)).sum(axis=1) + r.rest_mass
        np.testing.assert_allclose(total, 1.0, atol=1e-5)
        assert np.all(r.rest_mass >= 0) and np.all(r.top_logprobs <= 0)
        assert all(len(set(row)) == TOP_K for row in r.top_ids.tolist())


@pytest.mark.parametrize("kind", ALL)
def test_top_ids_lead_with_the_verifiers_greedy_token_and_greedy_accepted_drafts_are_that_token(logged, models, kind):
    v, _ = models
    for item in logged[kind]:
        r, h = item.record, item.history
        logits, _ = verifier_targets(v.hf, torch.tensor([h + r.tokens[:-1].tolist()]))
        at = logits[0, len(h) - 1 : len(h) - 1 + r.positions]  # [m, V] predicting d_1..d_m
        assert r.top_ids[:, 0].tolist() == at.argmax(-1).tolist()
        logp = torch.log_softmax(at, -1)
        np.testing.assert_allclose(r.top_logprobs, logp.gather(-1, torch.from_numpy(r.top_ids)).numpy(), atol=1e-4)
        if r.temperature == 0:  # greedy: a draft is accepted exactly when it is the verifier's argmax
            for i in range(r.positions):
                assert (r.tokens[i] == r.top_ids[i, 0]) == bool(r.rewards[i])


def test_draft_logprobs_are_the_log_probability_of_each_drafted_token_under_q(logged):
    for kind in ("pretrained", "sd2", "dvi", "sampled"):
        for item in logged[kind]:
            lp = item.record.draft_logprobs
            assert lp.dtype == np.float32 and np.all(lp <= 0) and np.all(np.isfinite(lp))
    for item in logged["self"]:  # the verifier's own greedy token: log q(d) is its top log-prob
        np.testing.assert_allclose(item.record.draft_logprobs, item.record.top_logprobs[:, 0], atol=1e-4)


def test_block_indices_count_up_per_request_and_the_version_is_the_serving_one(logged):
    for kind, items in logged.items():
        per_request: dict[str, list[int]] = {}
        for item in items:
            per_request.setdefault(item.record.request_id, []).append(item.record.block)
            assert item.record.drafter_version == "v0"
            assert item.record.temperature == (0.5 if kind == "sampled" else 0.0)
        for blocks in per_request.values():
            assert blocks == list(range(len(blocks)))


def test_the_context_is_cut_to_the_window_and_ends_with_the_blocks_first_input(models):
    v, d = models
    items = log_blocks(v, PretrainedDrafter(d.lean), "pretrained", prompts_for(v.tokenizer), context=3)
    assert items
    for item in items:
        assert item.record.context.tolist() == item.history[-3:]
        assert item.record.context[-1] == item.history[-1]


# ----------------------------------------------------------------------------- refusals


@pytest.fixture(scope="module")
def record(logged) -> ReplayRecord:
    """A record with every optional piece the schema allows for its kind (an sd2 one)."""
    return logged["sd2"][0].record


def header_end(payload: bytes) -> int:
    n = struct.unpack("<Q", payload[4:12])[0]
    return 12 + n


def test_steering_inputs_of_the_wrong_shape_for_the_kind_are_refused(logged):
    eagle, sd2 = logged["eagle"][0].record, logged["sd2"][0].record
    assert eagle.steer.shape[0] == 1 and decode(encode(eagle)).steer.shape == eagle.steer.shape
    eagle3 = logged["eagle3"][0].record  # its window: one feature row per context token
    assert eagle3.steer.shape[0] == len(eagle3.context) > 1 and decode(encode(eagle3)).steer.shape == eagle3.steer.shape
    for good, rows in ((eagle, 3), (sd2, 1), (eagle3, len(eagle3.context) - 1)):
        bad = dataclasses.replace(good, steer=np.zeros((rows, good.steer.shape[1]), dtype=np.float32))
        with pytest.raises(RecordError, match="steering inputs"):
            decode(encode(bad))


def test_a_changed_magic_is_refused(record):
    payload = encode(record)
    for bad in (b"SLRD" + payload[4:], b"slrc" + payload[4:], payload[4:], b"\x00" * 4 + payload[4:]):
        with pytest.raises(RecordError):
            decode(bad)


def test_flipping_any_byte_of_the_length_or_the_json_header_is_refused(record):
    payload = encode(record)
    end = header_end(payload)
    assert end < len(payload)
    for i in range(4, end):
        bad = bytearray(payload)
        bad[i] ^= 0xFF
        with pytest.raises(RecordError):
            decode(bytes(bad))


@pytest.mark.parametrize("old, new", [
    (b'"dtype":"I64"', b'"dtype":"I32"'),  # tokens claim another dtype (data size no longer matches)
    (b'"dtype":"F32"', b'"dtype":"F64"'),
    (b'"__metadata__":{', b'"__metadata__":['),  # the JSON no longer parses
    (b'\\"k\\"', b'\\"q\\"'),  # a scalar field is missing from the metadata
    (b'\\"block\\": ', b'\\"block\\":\\"'),  # the fields JSON no longer parses
    (b'"fields"', b'"fieldz"'),  # the fields entry is missing
])
def test_corrupted_json_metadata_is_refused(record, old, new):
    payload = encode(record)
    head = payload[: header_end(payload)]
    assert old in head, old
    bad = head.replace(old, new, 1) + payload[len(head):]
    if len(new) != len(old):  # keep the declared header length consistent with the edit
        n = header_end(bad) - 12 + len(new) - len(old)
        bad = bad[:4] + struct.pack("<Q", n) + bad[12:]
    with pytest.raises(RecordError):
        decode(bad)


def test_a_wrong_schema_version_is_refused(record):
    payload = encode(record)
    key = f'"schema":"{SCHEMA}"'.encode()
    assert key in payload
    with pytest.raises(RecordError, match="schema"):
        decode(payload.replace(key, f'"schema":"{SCHEMA + 1}"'.encode(), 1))


def test_a_truncated_payload_is_refused_at_every_cut(record):
    payload = encode(record)
    end = header_end(payload)
    cuts = sorted({0, 1, 3, 4, 5, 11, 12, 13, end // 2, end - 1, end, end + 1, (end + len(payload)) // 2,
                   len(payload) - 4, len(payload) - 1})
    for cut in cuts:
        with pytest.raises(RecordError):
            decode(payload[:cut])


@pytest.mark.parametrize("obj", [None, 0, "SLRC", ["SLRC"], {"tokens": [1]}, np.frombuffer(b"SLRC" * 4, np.uint8)])
def test_objects_that_are_not_bytes_are_refused(obj):
    with pytest.raises(RecordError):
        decode(obj)


def test_a_string_holding_a_valid_payloads_text_is_refused(record):
    with pytest.raises(RecordError):
        decode(encode(record).decode("latin-1"))


class _Boom:
    """Unpickling this creates a file: the proof that something called pickle.loads."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def test_decode_never_unpickles_a_pickled_payload(tmp_path, record):
    sentinel = tmp_path / "unpickled"
    for payload in (pickle.dumps(record), pickle.dumps(_Boom(sentinel)), MAGIC + pickle.dumps(_Boom(sentinel)),
                    MAGIC + pickle.dumps(record)):
        with pytest.raises(RecordError):
            decode(payload)
    assert not sentinel.exists()
    pickle.loads(pickle.dumps(_Boom(sentinel)))  # the payload really is a live pickle
    assert sentinel.exists()


def _encoded_with(record: ReplayRecord, **changes) -> bytes:
    """encode() does not validate: a way to put an invalid record on the wire."""
    return encode(dataclasses.replace(record, **changes))


def _positions(record: ReplayRecord, m: int, rewards: list[int]) -> dict:
    reps = lambda a: np.repeat(a[:1], m, axis=0)  # noqa: E731
    return dict(tokens=reps(record.tokens), rewards=np.array(rewards, np.uint8), draft_logprobs=reps(record.draft_logprobs),
                top_ids=reps(record.top_ids), top_logprobs=reps(record.top_logprobs), rest_mass=reps(record.rest_mass))


@pytest.mark.parametrize("rewards", [[0, 1], [0, 0], [1, 1], [1, 0, 1], [0, 1, 1, 1], [1, 2, 0], [2, 1, 1, 1], [1, 1, 1, 7]])
def test_a_record_with_an_invalid_reward_pattern_is_refused(record, rewards):
    payload = _encoded_with(record, k=4, **_positions(record, len(rewards), rewards))
    with pytest.raises(RecordError, match="reward|rejection"):
        decode(payload)


@pytest.mark.parametrize("rewards", [[0], [1, 0], [1, 1, 1, 0], [1, 1, 1, 1]])
def test_valid_reward_patterns_are_accepted(record, rewards):
    back = decode(_encoded_with(record, k=4, **_positions(record, len(rewards), rewards)))
    assert back.rewards.tolist() == rewards


def test_an_observed_record_has_one_position_and_no_reward(record):
    # k = 0: a step left plain, the verifier's distribution at the block's first position, nothing drafted
    back = decode(_encoded_with(record, k=0, **_positions(record, 1, [0])))
    assert back.observed and back.positions == 1 and not record.observed
    for change in (_positions(record, 1, [1]), _positions(record, 2, [1, 0])):
        with pytest.raises(RecordError, match="observed|positions"):
            decode(_encoded_with(record, k=0, **change))


def test_records_with_inconsistent_shapes_or_dtypes_are_refused(record):
    m = record.positions
    bad = [
        dict(tokens=np.zeros(0, np.int64)),  # no positions
        dict(k=m - 1) if m > 1 else dict(k=0, **_positions(record, 2, [1, 0])),  # more positions than k
        dict(k=-1),
        dict(draft_logprobs=np.zeros(m + 1, np.float32)),
        dict(top_ids=record.top_ids[:, :-1]),  # top ids and log-probs disagree on K
        dict(steer=np.zeros((2, record.steer.shape[1]), np.float32)),
        dict(hidden=np.zeros((m + 1, 8), np.float32)),
    ]
    for change in bad:
        with pytest.raises(RecordError):
            decode(_encoded_with(record, **change))


def test_arrays_of_the_wrong_dtype_or_rank_or_missing_are_refused(record):
    arrays = {n: getattr(record, n) for n in ("tokens", "rewards", "draft_logprobs", "top_ids", "top_logprobs",
                                               "rest_mass", "context", "steer")}
    fields = {n: getattr(record, n) for n in ("request_id", "drafter_version", "block", "kind", "k", "temperature")}
    meta = {"schema": str(SCHEMA), "fields": json.dumps(fields)}
    assert decode(MAGIC + st_save(arrays, metadata=meta)).kind == record.kind  # the hand-built payload is valid
    for change in (dict(tokens=record.tokens.astype(np.int32)), dict(rewards=record.rewards.astype(np.int64)),
                   dict(top_logprobs=record.top_logprobs.astype(np.float16)), dict(rest_mass=record.rest_mass[:, None]),
                   dict(steer=record.steer.reshape(-1))):
        with pytest.raises(RecordError):
            decode(MAGIC + st_save(arrays | change, metadata=meta))
    for missing in ("tokens", "rewards", "top_ids", "context"):
        with pytest.raises(RecordError):
            decode(MAGIC + st_save({n: a for n, a in arrays.items() if n != missing}, metadata=meta))
    for bad_meta in ({"fields": meta["fields"]}, {"schema": str(SCHEMA)}, {"schema": str(SCHEMA), "fields": "[1, 2]"},
                     {"schema": str(SCHEMA), "fields": json.dumps(fields | {"k": "four"})}):
        with pytest.raises(RecordError):
            decode(MAGIC + st_save(arrays, metadata=bad_meta))
    with pytest.raises(RecordError):
        decode(MAGIC + st_save(arrays))  # no metadata at all
