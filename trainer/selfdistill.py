"""Self-distillation of the eagle heads (kinds.eagle, kinds.eagle3): the verifier's own answers, with the features
and distributions it computed while decoding them, are the training data (the setting of the EAGLE
and DVI papers: a drafter is judged on the verifier's outputs, so it learns from them).

1. `collect`: the served verifier (its own kernels and weight mode, so the features are those the
   head reads at inference) decodes batches of prompts, chat first turns from ShareGPT's training
   part and code from the standard library's non-test source, alternately greedy and at T = 1.
   Per decoded position it keeps the head's layers' residual streams (fp16), the token, and the
   verifier's top-K next-token log-probabilities over the draft vocabulary. Optionally, between
   batches, it reads whole conversations and source files teacher-forced (the same fields).
2. `train_head`: windows of those sequences train `specloop.trainer.students.EagleStudent` (or
   `Eagle3Student`) with a random depth (as it drafts), by cross-entropy against the verifier's
   renormalised top-K.

`distill_eagle` runs both within a wall-clock budget and writes a checkpoint that
`specloop.drafter.kinds.table.build_drafter("eagle" or "eagle3", ...)` loads.
"""
from __future__ import annotations

import itertools
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import load_file
from tqdm import tqdm

from specloop.drafter.model.kv_cache import prefill
from specloop.drafter.model.loading import LoadedModel, load_model
from specloop.drafter.model.vocab import save_vocab
from specloop.trainer.data import ConversationSource, code_documents, conversation_ids, first_turn_prompt
from specloop.trainer.students import Eagle3Student, EagleStudent, build_student

TOP_K = 16


@dataclass
class Sequence:
    """One decoded answer: tokens[0] is the prompt's last token, tokens[j + 1] the verifier's choice
    at step j; features[j] is the residual stream at the position of tokens[j]'s predecessor (row 0:
    the prompt's second-to-last position, from the prefill), so that (features[j], tokens[j]) is
    what the head drafts tokens[j + 1] from, and target_*[j] the verifier's distribution there."""

    tokens: torch.Tensor  # [n + 1] int64
    features: torch.Tensor  # [n + 1, d × layers] fp16, the head's layers concatenated (the last row is unused)
    target_ids: torch.Tensor  # [n, K] int64 (draft-vocabulary indices; -1: outside it)
    target_logp: torch.Tensor  # [n, K] float32


@dataclass
class DistillConfig:
    collect_minutes: float = 2.0
    train_minutes: float = 2.5
    batch: int = 16  # prompts decoded together
    max_new: int = 96  # tokens per answer
    max_prompt: int = 96  # longer prompts are skipped (chat) or cut (code)
    forced_share: float = 0.0  # of the collection time spent reading documents teacher-forced (0: answers only;
    #                            0.5 gave 1.7x the positions and no better held-out acceptance, bench/README.md 12)
    forced_tokens: int = 256  # tokens per teacher-forced document
    depth: int = 2  # the head is unrolled up to this many drafts (the controller rarely drafts more)
    window: int = 32  # positions per training window
    train_batch: int = 32  # windows per step
    lr: float = 5e-3
    weight_decay: float = 0.0  # AdamW, on the head's matrices
    noise: float = 0.0  # uniform noise on the input features, × their RMS (EAGLE's robustness trick)
    seed: int = 0
    threads: int = 2
    domains: tuple[str, ...] = ("chat", "code")  # which prompts the verifier answers (an oracle for code: ("code",))
    extra: dict = field(default_factory=dict)  # manifest fields to add


def training_prompts(tokenizer, max_prompt: int, seed: int,
                     domains: tuple[str, ...] = ("chat", "code")) -> Iterator[tuple[str, list[int]]]:
    """("chat" | "code", prompt ids), alternating over `domains`: ShareGPT first user turns
    (training part) and stretches of standard-library source for the verifier to continue."""
    chat = (("chat", p) for _, conv in ConversationSource().iter_from(0)
            if 0 < len(p := first_turn_prompt(tokenizer, conv)) <= max_prompt)
    rng = random.Random(seed)

    def code() -> Iterator[tuple[str, list[int]]]:
        for doc in code_documents(tokenizer, 0, 4096):
            if len(doc) > max_prompt + 64:
                start = rng.randrange(0, len(doc) - max_prompt - 64)
                yield "code", doc[start : start + rng.randrange(max_prompt // 2, max_prompt)]

    sources = {"chat": chat, "code": code()}
    for pair in zip(*(sources[d] for d in domains)):
        yield from pair


@torch.inference_mode()
def decode_batch(verifier: LoadedModel, prompts: list[list[int]], max_new: int, layers: tuple[int, ...],
                 vocab_index: torch.Tensor,
                 temperature: float, generator: torch.Generator) -> list[Sequence]:
    """Decode `prompts` together for `max_new` steps (rows stop at EOS) keeping what `Sequence` holds."""
    lean = verifier.lean
    cache, first = prefill(lean, prompts, max(map(len, prompts)) + max_new + 1, capture=layers)
    last = torch.tensor([p[-1] for p in prompts], dtype=torch.long)
    feats, toks, ids, logps = [joined(first, layers)], [last], [], []
    alive = torch.ones(len(prompts), dtype=torch.bool)
    lengths = torch.full((len(prompts),), max_new)
    for step in range(max_new):
        out = lean.forward(cache, last[:, None], capture=layers)
        logits = out.logits[:, 0].float()
        logp = torch.log_softmax(logits, dim=-1)
        top = logp.topk(TOP_K, dim=-1)
        if temperature > 0:
            last = torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1, generator=generator)[:, 0]
        else:
            last = logits.argmax(dim=-1)
        feats.append(joined({i: h[:, 0] for i, h in out.hidden.items()}, layers))
        toks.append(last.cpu())
        ids.append(vocab_index[top.indices.cpu()])
        logps.append(top.values.cpu())
        ended = alive & torch.tensor([int(t) in verifier.eos_ids for t in last.tolist()])
        lengths = torch.where(ended, torch.full_like(lengths, step + 1), lengths)
        alive &= ~ended
        if not alive.any():
            break
    F, X, Ids, L = (torch.stack(t, dim=1) for t in (feats, toks, ids, logps))
    return [Sequence(X[b, : n + 1], F[b, : n + 1], Ids[b, :n], L[b, :n])
            for b, n in enumerate(lengths.tolist()) if n > 1]


def training_documents(tokenizer, max_tokens: int) -> Iterator[list[int]]:
    """Whole ShareGPT conversations (training part) and standard-library files, alternately, cut to
    `max_tokens`: text the verifier reads teacher-forced."""
    chat = (ids for _, conv in ConversationSource().iter_from(0)
            if len(ids := conversation_ids(tokenizer, conv, max_tokens)) > 8)
    code = (ids for ids in code_documents(tokenizer, 0, max_tokens) if len(ids) > 8)
    for pair in zip(chat, code):
        yield from pair


@torch.inference_mode()
def forced_sequence(verifier: LoadedModel, doc: list[int], layers: tuple[int, ...],
                    vocab_index: torch.Tensor) -> Sequence:
    """`doc` read in one pass: the same fields as a decoded answer, at every position but the first."""
    lean = verifier.lean
    out = lean.forward(lean.new_cache(1, len(doc)), torch.tensor([doc]), capture=layers)
    top = torch.log_softmax(out.logits[0, 1:-1].float(), dim=-1).topk(TOP_K, dim=-1)
    return Sequence(torch.tensor(doc[1:]), joined({i: h[0, :-1] for i, h in out.hidden.items()}, layers),
                    vocab_index[top.indices.cpu()], top.values.cpu())


def joined(hidden: dict[int, torch.Tensor], layers: tuple[int, ...]) -> torch.Tensor:
    """[..., len(layers) · d] fp16 on the host: the captured residual streams of `layers`, concatenated."""
    return torch.cat([hidden[i] for i in layers], dim=-1).half().cpu()


def vocab_index(vocab: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """[vocab_size]: each token's index in the draft vocabulary (-1 outside it; the identity for None)."""
    if vocab is None:
        return torch.arange(vocab_size)
    index = torch.full((vocab_size,), -1, dtype=torch.long)
    index[vocab] = torch.arange(len(vocab))
    return index


def collect(verifier: LoadedModel, layers: tuple[int, ...], vocab: torch.Tensor | None, cfg: DistillConfig,
            progress: bool = True) -> list[Sequence]:
    """Sequences within cfg.collect_minutes (the first batch always, however short the budget: reading the prompts
    could spend a short one on a loaded machine): batches of the verifier's own answers, each followed by
    teacher-forced documents for `forced_share` of the time when asked (a pass over a document
    yields ~2.4x the positions per second of decoding, but the answers are what the head will be
    asked to predict)."""
    index = vocab_index(vocab, verifier.vocab_size)
    prompts = training_prompts(verifier.tokenizer, cfg.max_prompt, cfg.seed, cfg.domains)
    documents = training_documents(verifier.tokenizer, cfg.forced_tokens)
    generator = torch.Generator().manual_seed(cfg.seed)
    seqs: list[Sequence] = []
    deadline = time.monotonic() + 60.0 * cfg.collect_minutes
    bar = tqdm(desc="verifier answers", unit="tok", disable=not progress, file=sys.stderr)
    for round_ in itertools.count():
        batch = [p for _, p in itertools.islice(prompts, cfg.batch)]
        if not batch or (seqs and time.monotonic() > deadline):  # the first batch whatever the budget: never none
            break
        t0 = time.monotonic()
        new = decode_batch(verifier, batch, cfg.max_new, layers, index, 1.0 if round_ % 2 else 0.0, generator)
        forced_until = time.monotonic() + (time.monotonic() - t0) * cfg.forced_share / (1.0 - cfg.forced_share)
        while time.monotonic() < min(forced_until, deadline) and (doc := next(documents, None)) is not None:
            new.append(forced_sequence(verifier, doc, layers, index))
        seqs += new
        bar.update(sum(len(s.target_ids) for s in new))
    bar.close()
    return seqs


def windows(seqs: list[Sequence], window: int, batch: int, rng: random.Random):
    """A batch of `batch` windows: (ids [B, W], prev features [B, W, d], target ids / logp [B, W, K])."""
    picks = []
    for _ in range(batch):
        s = seqs[rng.randrange(len(seqs))]
        n = len(s.target_ids)
        start = rng.randrange(0, max(1, n - window + 1))
        picks.append((s, start, min(window, n - start)))
    W = max(w for _, _, w in picks)
    d = seqs[0].features.shape[1]
    ids = torch.zeros(batch, W, dtype=torch.long)
    prev = torch.zeros(batch, W, d)
    tid = torch.full((batch, W, TOP_K), -1, dtype=torch.long)
    tlp = torch.zeros(batch, W, TOP_K)
    for b, (s, start, w) in enumerate(picks):
        ids[b, :w] = s.tokens[start : start + w]
        prev[b, :w] = s.features[start : start + w].float()
        tid[b, :w] = s.target_ids[start : start + w]
        tlp[b, :w] = s.target_logp[start : start + w]
    return ids, prev, tid, tlp


def soft_cross_entropy(logits: torch.Tensor, target_ids: torch.Tensor, target_logp: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of logits [.., V] against a top-K distribution renormalised over the ids that
    are in the draft vocabulary (-1: not); positions with none are skipped."""
    valid = target_ids >= 0
    p = torch.where(valid, target_logp.exp(), torch.zeros_like(target_logp))
    mass = p.sum(-1, keepdim=True)
    keep = mass[..., 0] > 0
    p = p / mass.clamp(min=1e-9)
    logq = torch.log_softmax(logits.float(), dim=-1).gather(-1, target_ids.clamp(min=0))
    return -(p * logq).sum(-1)[keep].mean()


def train_head(student: EagleStudent | Eagle3Student, seqs: list[Sequence], cfg: DistillConfig,
               progress: bool = True) -> dict:
    """Train the head on `seqs` for cfg.train_minutes (AdamW, warm-up then cosine); returns a summary."""
    params = [p for _, p, _ in student.trainable()]
    matrices = [p for p in params if p.dim() == 2]
    opt = torch.optim.AdamW([{"params": matrices, "weight_decay": cfg.weight_decay},
                             {"params": [p for p in params if p.dim() != 2], "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95))
    rng = random.Random(cfg.seed)
    budget, t0, step, losses = 60.0 * cfg.train_minutes, time.monotonic(), 0, []
    bar = tqdm(desc=f"{student.kind}: training", unit="step", disable=not progress, file=sys.stderr)
    while (elapsed := time.monotonic() - t0) < budget:
        frac = min(1.0, elapsed / budget)
        for g in opt.param_groups:
            g["lr"] = cfg.lr * min(1.0, (step + 1) / 10) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        ids, prev, tid, tlp = windows(seqs, cfg.window, cfg.train_batch, rng)
        if cfg.noise:
            scale = prev.pow(2).mean(-1, keepdim=True).sqrt() * cfg.noise
            prev = prev + (torch.rand(prev.shape, generator=student.generator) * 2 - 1) * scale
        loss = soft_cross_entropy(student.unrolled_logits(prev, ids), tid, tlp)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        losses.append(float(loss.detach()))
        bar.update(1)
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}", refresh=False)
    bar.close()
    return {"steps": step, "final_loss": round(sum(losses[-20:]) / max(1, len(losses[-20:])), 4),
            "seconds": round(time.monotonic() - t0, 1)}


def distill_eagle(verifier_dir: str | Path, out: str | Path, vocab_file: str | Path | None, cfg: DistillConfig,
                  progress: bool = True, method: str = "eagle") -> dict:
    """Collect, train, and write the checkpoint of the head `method` (eagle or eagle3) into `out`;
    returns a summary."""
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    out = Path(out)
    served = load_model(verifier_dir, weights="auto")  # decodes as it will serve
    vocab = None if vocab_file is None else load_file(vocab_file)["ids"].to(torch.long)
    student = build_student(method, served, None, k=cfg.depth, dvi_layers=2, steer_layers=None,
                            generator=torch.Generator().manual_seed(cfg.seed), device=served.lean.device, vocab=vocab)
    t0 = time.monotonic()
    seqs = collect(served, tuple(student.verifier_layers), vocab, cfg, progress)
    collected = time.monotonic() - t0
    if not seqs:
        raise ValueError("no training sequences could be decoded")
    assert isinstance(student, EagleStudent)  # method is eagle or eagle3 (an Eagle3Student is an EagleStudent)
    summary = train_head(student, seqs, cfg, progress)
    summary |= {"sequences": len(seqs), "positions": sum(len(s.target_ids) for s in seqs),
                "collect_seconds": round(collected, 1)}
    extra = {"method": method, "data": "self-distilled", "base": {"verifier": str(Path(verifier_dir).resolve())},
             "k": cfg.depth, "steps": summary["steps"], "tokens_seen": summary["positions"]} | cfg.extra
    if vocab is not None:
        extra["draft_vocab"] = save_vocab(out, vocab)
    student.export(out, extra)
    (out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
