"""Self-distillation of the eagle head (specloop.trainer.selfdistill): what a decoded sequence holds, the loss,
that training lowers it, and the end-to-end run writing a checkpoint that drafts losslessly."""
import random

import pytest
import torch

from specloop.drafter.decode.engine import generate
from specloop.drafter.decode.requests import StopRule
from specloop.drafter.decode.sampling import SamplingParams
from specloop.drafter.kinds.table import build_drafter
from specloop.drafter.model.loading import load_model
from specloop.trainer.selfdistill import (
    TOP_K,
    DistillConfig,
    Sequence,
    decode_batch,
    distill_eagle,
    soft_cross_entropy,
    train_head,
    vocab_index,
)
from specloop.trainer.students import build_student

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]


@pytest.fixture(scope="module")
def verifier(tiny_pair):
    return load_model(tiny_pair[0], dtype=torch.float32, keep_module=True)


def identity_index(v) -> torch.Tensor:
    return vocab_index(None, v.vocab_size)


def test_a_greedy_sequence_is_the_verifiers_answer_with_its_features_and_distributions(verifier):
    layer = verifier.lean.num_layers - 1
    seqs = decode_batch(verifier, PROMPTS, 10, (layer,), identity_index(verifier), 0.0, torch.Generator())
    ref = generate(verifier.lean, None, PROMPTS, SamplingParams(max_tokens=10), 0, StopRule())
    assert len(seqs) == 3
    for s, p, g in zip(seqs, PROMPTS, ref):
        n = len(s.target_ids)
        assert s.tokens[0] == p[-1] and s.tokens[1:].tolist() == g.token_ids[:n]
        assert s.target_ids[:, 0].tolist() == g.token_ids[:n]  # greedy: the top-1 is the next token
        assert s.target_ids.shape == (n, TOP_K) and s.features.shape == (n + 1, verifier.lean.hidden_size)
        assert bool((s.target_logp[:, :-1] >= s.target_logp[:, 1:]).all())
    # features[j] is the last layer's output at the position before tokens[j] (row 0: the prompt's
    # second-to-last position), as the verifier computes it in one teacher-forced pass
    ids = torch.tensor([PROMPTS[0] + seqs[0].tokens[1:4].tolist()])
    captured = {}
    hook = lambda m, i, o: captured.setdefault("h", o[0] if isinstance(o, tuple) else o)  # noqa: E731
    handle = verifier.hf.model.layers[layer].register_forward_hook(hook)
    try:
        with torch.no_grad():
            verifier.hf(input_ids=ids)
    finally:
        handle.remove()
    start = len(PROMPTS[0]) - 2
    torch.testing.assert_close(seqs[0].features[:4].float(), captured["h"][0, start : start + 4].float(),
                               atol=2e-2, rtol=2e-2)


def test_soft_cross_entropy_renormalises_over_the_draft_vocabulary_and_skips_empty_positions():
    logits = torch.randn(2, 5)
    ids = torch.tensor([[1, 3, -1], [-1, -1, -1]])
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.25], [0.6, 0.3, 0.1]]))
    got = soft_cross_entropy(logits, ids, logp)
    q = torch.log_softmax(logits[0], -1)
    want = -(2 / 3 * q[1] + 1 / 3 * q[3])
    torch.testing.assert_close(got, want)


def test_training_on_decoded_sequences_lowers_the_loss(verifier):
    layer = verifier.lean.num_layers - 1
    seqs = decode_batch(verifier, PROMPTS * 4, 24, (layer,), identity_index(verifier), 1.0, torch.Generator().manual_seed(0))
    student = build_student("eagle", verifier, None, k=2, dvi_layers=2, steer_layers=None,
                            generator=torch.Generator().manual_seed(0), device=verifier.lean.device)
    cfg = DistillConfig(train_minutes=0.05, window=8, train_batch=8, lr=1e-2)
    from specloop.trainer.selfdistill import windows

    batch = windows(seqs, 8, 16, random.Random(1))
    with torch.no_grad():
        before = float(soft_cross_entropy(student.unrolled_logits(batch[1], batch[0]), batch[2], batch[3]))
    summary = train_head(student, seqs, cfg, progress=False)
    with torch.no_grad():
        after = float(soft_cross_entropy(student.unrolled_logits(batch[1], batch[0]), batch[2], batch[3]))
    assert summary["steps"] > 5 and after < before - 0.1, (before, after)


def test_distill_eagle_writes_a_checkpoint_that_drafts_losslessly(tmp_path, tiny_pair, verifier):
    cfg = DistillConfig(collect_minutes=0.02, train_minutes=0.02, batch=4, max_new=8, max_prompt=48, threads=1)
    summary = distill_eagle(tiny_pair[0], tmp_path / "eagle", None, cfg, progress=False)
    assert summary["sequences"] > 0 and summary["steps"] > 0
    d = build_drafter("eagle", verifier, tmp_path / "eagle")
    params = SamplingParams(max_tokens=16)
    ref = generate(verifier.lean, None, PROMPTS, params, 0, StopRule())
    out = generate(verifier.lean, d, PROMPTS, params, 3, StopRule())
    assert [g.token_ids for g in out] == [g.token_ids for g in ref]


def test_a_window_never_runs_past_its_sequence():
    d = 8
    s = Sequence(torch.arange(4), torch.randn(4, d).half(), torch.zeros(3, TOP_K, dtype=torch.long),
                 torch.zeros(3, TOP_K))
    from specloop.trainer.selfdistill import windows

    ids, prev, tid, tlp = windows([s], 6, 2, random.Random(0))
    assert ids.shape == (2, 3) and prev.shape == (2, 3, d)  # one window of the whole sequence, twice
    assert bool((tid >= 0).all())


def test_a_teacher_forced_document_has_the_fields_of_a_decoded_answer(verifier):
    from specloop.trainer.selfdistill import forced_sequence

    layer = verifier.lean.num_layers - 1
    doc = [3, 14, 15, 9, 26, 5, 35, 8, 9, 7]
    s = forced_sequence(verifier, doc, (layer,), identity_index(verifier))
    n = len(doc) - 2
    assert s.tokens.tolist() == doc[1:] and s.features.shape[0] == n + 1 and s.target_ids.shape == (n, TOP_K)
    with torch.no_grad():
        logits = verifier.hf(input_ids=torch.tensor([doc])).logits[0]
    assert s.target_ids[:, 0].tolist() == logits[1:-1].argmax(-1).tolist()  # target j: after tokens[j] = doc[j + 1]
    # features[j] is the residual at doc position j, tokens[j]'s predecessor
    cache = verifier.lean.new_cache(1, len(doc))
    hidden = verifier.lean.forward(cache, torch.tensor([doc[:3]]), capture=(layer,)).hidden[layer][0]
    torch.testing.assert_close(s.features[:3].float(), hidden.float(), atol=2e-2, rtol=2e-2)
