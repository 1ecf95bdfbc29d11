"""Drafter helpers several test modules share: a scripted controller, heads with random weights."""
from __future__ import annotations

import torch

from specloop.drafter.decode.controller import Batch, Choice, Controller, ControllerConfig
from specloop.drafter.decode.engine import generate
from specloop.drafter.decode.rejection import rejection_sample
from specloop.drafter.decode.requests import StopRule
from specloop.drafter.decode.sampling import SamplingParams
from specloop.drafter.decode.shaping import Controls
from specloop.drafter.kinds.dvi import DraftHead, DVIConfig, DVIDrafter
from specloop.drafter.kinds.eagle import FeatureHead, new_head
from specloop.drafter.kinds.eagle3 import Eagle3Head, new_head3
from specloop.drafter.kinds.ngram import NgramDrafter
from specloop.drafter.kinds.pretrained import PretrainedDrafter
from specloop.drafter.kinds.sd2 import SteeredDrafter, steering_for
from specloop.drafter.kinds.suffix import SuffixDrafter
from specloop.drafter.model.decoder import LeanDecoder

SCHEDULE = [0, 0, 2, 0, 3, 1, 0, 4, 4, 0]  # plain steps, drafting after them (rows resync), every k


def fast_exact_weights() -> str | None:
    """The weight mode the reference pair's engine tests serve it in where they test the engine, not fp32: w4a8
    on specloop's own kernels (every row of a verify pass computed as alone, from one read of the weights), else
    None (as stored, fp32: each row its own product, so a verify pass of 36 rows reads the weights 36 times; ~9x
    slower there)."""
    from specloop.drafter.model import kernels

    return "w4a8" if kernels.available() else None


class Scripted(Controller):
    """Chooses k from a fixed cycle whatever it measures, so every transition (plain → drafting → plain)
    happens; rows with an explicit k set the floor, as with the real controller. A k of -1 is a step left
    plain and untimed (no probe due: `Choice.timed` False)."""

    def __init__(self, ks: list[int] = SCHEDULE, k_max: int = 4):
        super().__init__(ControllerConfig(k_max=k_max))
        self.ks, self.calls = ks, 0

    def choose(self, batch: Batch) -> Choice:
        k = self.ks[self.calls % len(self.ks)]
        self.calls += 1
        if k < 0:
            return Choice(0, timed=False)
        return Choice(max(k, min(max(batch.fixed, default=0), self.cfg.k_max)))

    def cut(self, confidence: list[list[float]], rows: int, sources=None) -> list[int]:
        """Drafts with confidence are cut to lengths that cycle with the step and row (0 .. all)."""
        return [(self.calls + b) % (len(c) + 1) for b, c in enumerate(confidence)]


def trained_eagle(lean: LeanDecoder, seed: int = 0, std: float = 0.3) -> FeatureHead:
    """A head with random (non-trivial) weights."""
    head = new_head(lean, intermediate=32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=g) * std)
    return head


def trained_eagle3(lean: LeanDecoder, seed: int = 0, std: float = 0.3, window: int = 4) -> Eagle3Head:
    """A head with random (non-trivial) weights and a short window (so that it slides in tests)."""
    head = new_head3(lean, window=window, intermediate=32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=g) * std)
    return head


def perturbed_steering(verifier_hf, drafter_hf, layers=None, std=0.05):
    """SD² steering with non-zero W_s, so that steering really changes the drafts."""
    steering = steering_for(verifier_hf.config, drafter_hf.config, layers)
    torch.nn.init.normal_(steering.w_s, std=std, generator=torch.Generator().manual_seed(0))
    return steering


def perturbed_head(verifier_hf, layers, std=0.05):
    """A DVI head whose LoRA adapters are non-zero."""
    head = DraftHead(verifier_hf, DVIConfig(layers=layers))
    for name, p in head.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=std, generator=torch.Generator().manual_seed(1))
    return head


VOCAB = 12


PROMPT = [1, 2, 3, 1, 2]


N_SAMPLES = 10_000  # the wrong sampler below still fails at this size (suite time)


POSITIONS = 3


def sampled_counts(tiny, params, kind, k, sampler=rejection_sample, controller=None,
                   controls: Controls = Controls()) -> torch.Tensor:
    verifier = LeanDecoder(tiny[0])
    counts = torch.zeros(POSITIONS, VOCAB)
    rule = StopRule()
    chunk = 5000
    for lo in range(0, N_SAMPLES, chunk):
        drafter = tiny_drafter(tiny, kind)
        gens = generate(verifier, drafter, [PROMPT] * chunk, params, k, rule, sampler, first_request=lo,
                        controller=controller, controls=controls)
        toks = torch.tensor([g.token_ids for g in gens])
        for t in range(POSITIONS):
            counts[t] += torch.bincount(toks[:, t], minlength=VOCAB)
    return counts


def tiny_drafter(tiny, kind):
    verifier, drafter = tiny
    if kind == "pretrained":
        return PretrainedDrafter(LeanDecoder(drafter))
    if kind == "sd2":
        return SteeredDrafter(LeanDecoder(drafter), perturbed_steering(verifier, drafter, (0, 1, 1), std=0.5))
    if kind == "dvi":
        return DVIDrafter(LeanDecoder(verifier), perturbed_head(verifier, layers=1, std=0.5))
    if kind == "suffix":  # earlier outputs in its global store: drafts come from both stores
        return suffix_with_outputs([[3, 1, 2, 3, 4, 5], [2, 3, 1, 2, 6], [1, 2, 7, 7]])
    if kind == "eagle3":
        from specloop.drafter.kinds.eagle3 import Eagle3Drafter
        trained_like3 = trained_eagle3

        lean = LeanDecoder(verifier)
        return Eagle3Drafter(lean, trained_like3(lean, seed=3, window=3))
    if kind == "mix":  # an eagle head, an eagle3 one and suffix decoding, chosen per step and row
        from specloop.drafter.kinds.eagle import EagleDrafter
        from specloop.drafter.kinds.eagle3 import Eagle3Drafter
        from specloop.drafter.kinds.mix import SpeculatorMix
        trained_like = trained_eagle
        trained_like3 = trained_eagle3

        lean = LeanDecoder(verifier)
        suffix = suffix_with_outputs([[3, 1, 2, 3, 4, 5], [2, 3, 1, 2, 6]])
        return SpeculatorMix({"adaptive": EagleDrafter(lean, trained_like(lean, seed=1)),
                              "static": Eagle3Drafter(lean, trained_like3(lean, seed=2, window=3)), "suffix": suffix},
                             explore=2)
    return NgramDrafter(VOCAB) if kind == "ngram" else None


def suffix_with_outputs(outputs: list[list[int]]) -> SuffixDrafter:
    import numpy as np

    drafter = SuffixDrafter(VOCAB)
    for out in outputs:
        drafter.store.add(np.array(out, dtype=np.int32))
    return drafter


SETTINGS = {
    "T=1": SamplingParams(temperature=1.0, max_tokens=POSITIONS, seed=1),
    "T=0.7,top-p=0.9": SamplingParams(temperature=0.7, top_p=0.9, max_tokens=POSITIONS, seed=2),
}


# Every kind under the full transform (temperature, top-p: each kind warps its own q); plain T = 1, the
# same code with an identity transform, for the verifier alone and one drafter kind (suite time).
WARPED = "T=0.7,top-p=0.9"


def chained_like_the_loop(drafter, k: int, slots: int, depth: int = 4):
    """A head's greedy block of k drafts from its loop, then from its captured chain (`use_chain`, uncompiled: on the
    CPU a replay calls again) on the same state, checked equal bit for bit: tokens, confidence and logits. Returns
    (loop, chained) proposals; the chain is left in place. The loop's greedy logits may be its draft vocabulary's
    rows alone (`Proposal.logit_rows`): expanded to the whole vocabulary, they are the chain's."""
    from specloop.drafter.model.vocab import expand

    loop = drafter.propose(k, SamplingParams(), None)
    drafter.use_chain(slots=slots, depth=depth, compiled=False)  # more slots than rows: the engine's pool, partly empty
    assert drafter.chain is not None
    chained = drafter.propose(k, SamplingParams(), None)
    assert torch.equal(chained.tokens, loop.tokens) and torch.equal(chained.confidence, loop.confidence)
    width = chained.logits[0].shape[-1]
    whole = lambda p: [x if p.logit_rows is None else expand(x, p.logit_rows, width) for x in p.logits]  # noqa: E731
    assert all(torch.equal(a, b) for a, b in zip(whole(chained), whole(loop))) and len(chained.logits) == k
    assert torch.allclose(chained.logprobs(), loop.logprobs(), atol=1e-6)  # what the logits are kept for
    return loop, chained
