"""bench/gpu.py's section sampling: at temperature > 0, speculative output on the device is distributed as the
same engine's plain sampling (the verifier as served: bf16, the graph backend, its CUDA graphs).

A verifier and a drafter LM of tiny shapes (a 16-token vocabulary, random weights with a wide spread, so that
their distributions are peaked and differ) are built on the device. Each arm samples `samples` answers of
`positions` tokens after one prompt, `chunk` rows at a time (one pool shape: one compile):
- plain: the verifier alone (k = 0), the reference;
- pretrained k = 2 (drafts sampled from the drafter LM: q is a distribution), n-gram k = 3 (drafts from the
  prompt and the answer so far: q one-hot), each against plain by a two-sample chi-square test per position;
- wrong sampler: pretrained k = 2 judged by a sampler with the classic bug (after a rejection, the token is
  drawn from p instead of norm(max(0, p - q))): the test's power, which must fail.
Each arm draws from its own seed (independent samples). Pass: every correct arm's p-values above
`alpha` / (the tests made) (Bonferroni), and the wrong sampler's below `alpha` at some position.
No scipy on the GPU machine: the chi-square tail is torch.special.gammaincc.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

PROMPT = [1, 2, 3, 1, 2]
VOCAB = 16


@dataclass(frozen=True)
class SamplingPlan:
    samples: int = 20_000  # per arm
    chunk: int = 20_000  # rows an engine holds (one engine an arm on a GPU)
    positions: int = 3
    alpha: float = 0.01
    settings: tuple[tuple[str, float, float], ...] = (("T=1", 1.0, 1.0), ("T=0.7,top-p=0.9", 0.7, 0.9))


def homogeneity_pvalue(a: torch.Tensor, b: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson's chi-square test that two samples' counts over the same bins come from one distribution
    (a 2 x bins contingency table). Bins whose expected count is below `min_expected` in either sample are
    pooled into one; p-value = Q(df / 2, statistic / 2)."""
    a, b = a.double(), b.double()
    na, nb = a.sum(), b.sum()
    pooled = (a + b) / (na + nb)
    big = (pooled * torch.minimum(na, nb)) >= min_expected
    a = torch.cat([a[big], a[~big].sum()[None]])
    b = torch.cat([b[big], b[~big].sum()[None]])
    keep = (a + b) > 0
    a, b = a[keep], b[keep]
    if len(a) < 2:
        return 1.0
    pooled = (a + b) / (na + nb)
    ea, eb = pooled * na, pooled * nb
    stat = (((a - ea) ** 2) / ea + ((b - eb) ** 2) / eb).sum()
    df = torch.tensor(float(len(a) - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))


def residual_dropped(draft_tokens, draft_probs, target_probs, uniforms, **cap):
    """The classic bug, for the test's power: after a rejection the token comes from p, not from
    norm(max(0, p - q)) (the accept/reject verdicts themselves are the lossless sampler's)."""
    from specloop.drafter.decode.rejection import rejection_sample

    right = rejection_sample(draft_tokens, draft_probs, target_probs, uniforms, **cap)
    plain = rejection_sample(draft_tokens, torch.zeros_like(draft_probs), target_probs, uniforms, **cap)
    rows = torch.arange(len(draft_tokens), device=draft_tokens.device)
    right.tokens[rows, right.num_accepted] = plain.tokens[rows, 0]
    return right


def counts(verifier, drafter, k: int, params, plan: SamplingPlan, sampler=None) -> torch.Tensor:
    """[positions, VOCAB] token counts of `plan.samples` answers (requests numbered from 0 in each chunk's
    stream: first_request = the chunk's start)."""
    from specloop.drafter.decode.engine import generate
    from specloop.drafter.decode.requests import StopRule

    extra = {} if sampler is None else {"sampler": sampler}
    out = torch.zeros(plan.positions, VOCAB, dtype=torch.long)
    for lo in range(0, plan.samples, plan.chunk):
        rows = min(plan.chunk, plan.samples - lo)
        gens = generate(verifier, drafter() if drafter else None, [PROMPT] * rows, params, k, StopRule(),
                        first_request=lo, backend="graph", **extra)
        tokens = torch.tensor([g.token_ids[: plan.positions] for g in gens])
        for t in range(plan.positions):
            out[t] += torch.bincount(tokens[:, t], minlength=VOCAB)
    return out


def arms(draft_lm):
    """name -> (drafter factory or None, k, sampler or None, whether the test must reject)."""
    from specloop.drafter.kinds.ngram import NgramDrafter
    from specloop.drafter.kinds.pretrained import PretrainedDrafter

    pretrained = lambda: PretrainedDrafter(draft_lm)  # noqa: E731
    return {"pretrained-k2": (pretrained, 2, None, False),
            "ngram-k3": (lambda: NgramDrafter(VOCAB), 3, None, False),
            "wrong-sampler-k2": (pretrained, 2, residual_dropped, True)}


def run_setting(verifier, draft_lm, temperature: float, top_p: float, plan: SamplingPlan, say) -> dict:
    from specloop.drafter.decode.sampling import SamplingParams

    def params(seed: int) -> SamplingParams:
        return SamplingParams(temperature=temperature, top_p=top_p, max_tokens=plan.positions, seed=seed)

    reference = counts(verifier, None, 0, params(1), plan)
    out = {"plain_counts": reference.tolist(), "arms": {}}
    for seed, (name, (drafter, k, sampler, bad)) in enumerate(arms(draft_lm).items(), start=2):
        sampled = counts(verifier, drafter, k, params(seed), plan, sampler)
        p = [homogeneity_pvalue(sampled[t], reference[t]) for t in range(plan.positions)]
        out["arms"][name] = {"k": k, "must_reject": bad, "pvalues": p, "counts": sampled.tolist()}
        say(f"sampling T={temperature} top-p={top_p} {name}: p-values " + ", ".join(f"{x:.3g}" for x in p))
    return out


def verdict(settings: dict, plan: SamplingPlan) -> dict:
    """Bonferroni over the correct arms' tests; the wrong sampler must be caught in every setting."""
    correct = [p for s in settings.values() for a in s["arms"].values() if not a["must_reject"] for p in a["pvalues"]]
    bound = plan.alpha / max(1, len(correct))
    caught = [min(a["pvalues"]) < plan.alpha for s in settings.values() for a in s["arms"].values()
              if a["must_reject"]]
    return {"tests": len(correct), "bound": bound, "min_pvalue": min(correct, default=1.0),
            "holds": min(correct, default=1.0) > bound, "wrong_sampler_caught": all(caught) and bool(caught)}


def build_pair(shape_cls, build_lean, plan) -> tuple:
    """The tiny verifier (2 layers) and drafter LM (1 layer) on the plan's device and dtype, peaked weights."""
    verifier = shape_cls(64, 2, 4, 2, 16, 192, VOCAB, True)
    drafter = shape_cls(32, 1, 2, 1, 16, 96, VOCAB, True)
    return (build_lean(verifier, plan, std=0.5, seed=11)[0], build_lean(drafter, plan, std=0.5, seed=12)[0])


def sampling_section(out: dict, pair: tuple, plan: SamplingPlan, say) -> dict:
    verifier, draft_lm = pair
    out.update(vocab=VOCAB, prompt=PROMPT, samples_per_arm=plan.samples, positions=plan.positions, chunk=plan.chunk,
               backend="graph", dtype=str(verifier.dtype).removeprefix("torch."), device=str(verifier.device))
    out["settings"] = {}
    for name, temperature, top_p in plan.settings:
        out["settings"][name] = run_setting(verifier, draft_lm, temperature, top_p, plan, say)
    out["verdict"] = verdict(out["settings"], plan)
    v = out["verdict"]
    say(f"sampling: {'holds' if v['holds'] else 'FAILS'} (min p {v['min_pvalue']:.3g} over {v['tests']} tests, "
        f"bound {v['bound']:.2g}); the wrong sampler {'caught' if v['wrong_sampler_caught'] else 'NOT caught'}")
    return out
