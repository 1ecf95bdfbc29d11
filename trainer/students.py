"""Students: what each offline (and online) alignment method trains against the frozen verifier.

A `Student` maps a batch of token ids [B, T] plus the verifier's residual streams to the drafter's
next-token logits π_D [B, T, V], and names its trainable parameters; the trainer minimises a
distance to the verifier's π_V (`verifier_targets`) at every position (`specloop.trainer.losses`).

- distill     a plain drafter LM, all parameters trained           → kind "pretrained"  (`DistillStudent`)
- sd2         SD² steering (W_hml, LayerNorm, W_s) + the drafter LM  → kind "sd2"         (`SteeredStudent`)
- sd2-frozen  SD² steering only, drafter LM frozen                  → kind "sd2"         (`SteeredStudent`)
- dvi         DVI draft head (RMSNorm + LoRA on the LM head) on the verifier's layer-s residual
              stream                                                 → kind "dvi"         (`DVIStudent`)
- eagle       a feature head on the verifier's last-layer residual stream and the next token's
              embedding, unrolled over the draft depth              → kind "eagle"       (`EagleStudent`)
- eagle3      an EAGLE-3-style head: three verifier layers fused, one decoder layer over a window of
              its own inputs, trained by the training-time test      → kind "eagle3"      (`Eagle3Student`)

`build_student` constructs the one a method needs; `Student.export` writes what
`specloop.drafter.kinds.table.build_drafter(kind, verifier, out)` loads.

The eagle head trains with a random depth, as it drafts: at position t with depth δ_t ~ U{1..k}
it starts from the verifier's true feature at t − δ_t and steps δ_t times through the tokens
t − δ_t + 1 .. t, feeding back its own predicted features (`EagleStudent`), so drafts after the
first are trained on the inputs they will see.

SD² trains with a random offset: at drafter position t the steering vector g is built from the
verifier's residual streams at position t − δ_t, δ_t ~ U{1..k} (`offset_sources`), because at
inference the j-th draft of a block sits j positions after the verifier position whose hidden
states built g (`SteeredDrafter`: one g per block, reused for all k drafts). t − δ_t is clamped
at 0; position 0 gets zero features (the verifier's own state there already encodes its
prediction of the target), which is also what `prefill` gives a one-token prompt.
"""
from __future__ import annotations

import json
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specloop.drafter.kinds.dvi import DraftHead, DVIConfig
from specloop.drafter.kinds.eagle import FeatureHead, feature_layer, new_head
from specloop.drafter.kinds.eagle3 import (
    Eagle3Head,
    Window,
    chain,
    check_layers,
    new_head3,
    ttt_logits,
    window_entries,
)
from specloop.drafter.kinds.sd2 import MANIFEST, default_steer_layers, steering_for
from specloop.drafter.model.loading import LoadedModel, check_same_vocabulary, load_model

METHODS = ("distill", "sd2", "sd2-frozen", "dvi", "eagle", "eagle3")  # what `build_student` builds


def head_logits(hf, input_ids: torch.Tensor, vocab: torch.Tensor | None = None) -> torch.Tensor:
    """A causal LM's logits [B, T, V], or [B, T, |vocab|] over a draft vocabulary's rows only (FR-Spec:
    the LM head is the largest matrix of a small model; scoring the subset skips most of it)."""
    if vocab is None:
        return hf(input_ids=input_ids, use_cache=False).logits
    hidden = hf.model(input_ids=input_ids, use_cache=False).last_hidden_state
    return torch.nn.functional.linear(hidden, hf.lm_head.weight[vocab.to(hidden.device)])


def teacher_autocast(device: torch.device, dtype: str):
    """bf16 autocast for the frozen verifier's forward when asked ("bf16"), or when "auto" and the
    CPU has native bf16 dot products (AVX512-BF16 / AMX); fp32 otherwise."""
    from specloop.drafter.model.weights.modes import native_bf16

    use = dtype == "bf16" or (dtype == "auto" and (device.type == "cuda" or native_bf16()))
    return torch.autocast(device.type, dtype=torch.bfloat16) if use else nullcontext()


@torch.no_grad()
def verifier_targets(verifier_hf, input_ids: torch.Tensor, layers: tuple[int, ...] = (),
                     vocab: torch.Tensor | None = None):
    """(logits [B, T, V] float32, {i: residual stream after 0-based layer i, [B, T, d]}); with
    `vocab`, logits over those rows only ([B, T, |vocab|]).

    The residual after layer i is HF's `hidden_states[i + 1]` for i < L − 1; HF's last entry is
    taken after the final norm, so the streams are read from the decoder layers' outputs, which
    is what `LeanDecoder.forward(capture=...)` gives the drafters at inference.
    """
    captured: dict[int, torch.Tensor] = {}

    def keeper(i: int):
        def keep(module, inputs, output):
            captured[i] = (output[0] if isinstance(output, tuple) else output).float()
        return keep

    handles = [verifier_hf.model.layers[i].register_forward_hook(keeper(i)) for i in sorted(set(layers))]
    try:
        logits = head_logits(verifier_hf, input_ids, vocab).float()  # [B, T, V]
    finally:
        for h in handles:
            h.remove()
    return logits, captured


class Student:
    """What a method trains: `logits(ids, residuals)` and the named trainable parameters.

    `trainable()` lists (name, parameter, group): group "lm" (drafter LM weights, lm_lr) or
    "adapter" (steering / LoRA / head norm, lr, no weight decay).
    """

    kind: str
    verifier_layers: tuple[int, ...] = ()
    vocab: torch.Tensor | None = None  # FR-Spec draft vocabulary: logits over these rows only

    def trainable(self) -> list[tuple[str, nn.Parameter, str]]:
        raise NotImplementedError

    def logits(self, input_ids: torch.Tensor, residuals: dict[int, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def export(self, out: Path, extra: dict) -> None:
        raise NotImplementedError


def _lm_params(lm) -> list[tuple[str, nn.Parameter, str]]:
    return [(f"lm.{n}", p, "lm") for n, p in lm.named_parameters() if p.requires_grad]


def _freeze_embeddings(hf, freeze: bool) -> None:
    """Keep the token embeddings (and an LM head tied to them) fixed: on a small model they are
    most of the parameters, and a few minutes of training moves the layers more usefully."""
    if freeze:
        hf.get_input_embeddings().weight.requires_grad_(False)
        hf.lm_head.weight.requires_grad_(False)


def _save_lm(lm: LoadedModel, out: Path) -> None:
    (out / "drafter").mkdir(parents=True, exist_ok=True)
    lm.hf.save_pretrained(out / "drafter")
    lm.tokenizer.save_pretrained(out / "drafter")


class DistillStudent(Student):
    """A plain drafter LM, every parameter trained."""

    kind = "pretrained"

    def __init__(self, lm: LoadedModel, freeze_embeddings: bool = False):
        self.lm = lm
        lm.hf.requires_grad_(True).train()
        _freeze_embeddings(lm.hf, freeze_embeddings)

    def trainable(self):
        return _lm_params(self.lm.hf)

    def logits(self, input_ids, residuals):
        return head_logits(self.lm.hf, input_ids, self.vocab)  # [B, T, V]

    def export(self, out, extra):
        _save_lm(self.lm, out)
        (out / MANIFEST).write_text(json.dumps({"kind": "pretrained"} | extra, indent=2))


def offset_sources(batch: int, length: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """[B, T] source positions t − δ_t, δ_t ~ U{1..k}, clamped at 0."""
    delta = torch.randint(1, k + 1, (batch, length), generator=generator)  # [B, T]
    return (torch.arange(length)[None] - delta).clamp(min=0)


class SteeredStudent(Student):
    """SD²: the drafter LM with W_s g added to every MLP up projection (forward hooks)."""

    kind = "sd2"

    def __init__(self, lm: LoadedModel, steering, k: int, train_lm: bool, generator: torch.Generator,
                 freeze_embeddings: bool = False):
        self.lm, self.steering, self.k, self.train_lm, self.generator = lm, steering, k, train_lm, generator
        self.verifier_layers = tuple(steering.cfg.layers)
        lm.hf.requires_grad_(train_lm).train(train_lm)
        _freeze_embeddings(lm.hf, freeze_embeddings)
        steering.train()
        self._bias: torch.Tensor | None = None  # [L_draft, B, T, I] during a forward
        for layer, block in enumerate(lm.hf.model.layers):
            block.mlp.up_proj.register_forward_hook(self._adder(layer))

    def _adder(self, layer: int):
        def add_bias(module, inputs, output):
            return output if self._bias is None else output + self._bias[layer]
        return add_bias

    def trainable(self):
        lm = _lm_params(self.lm.hf) if self.train_lm else []
        return lm + [(f"steering.{n}", p, "adapter") for n, p in self.steering.named_parameters()]

    def features(self, residuals: dict[int, torch.Tensor], sources: torch.Tensor) -> torch.Tensor:
        """Verifier features at each position's source t − δ_t: [B, T, 3, d_verifier]; zeros at t = 0."""
        feats = torch.stack([residuals[i] for i in self.verifier_layers], dim=2)  # [B, T, 3, d_v]
        src = sources.to(feats.device)[:, :, None, None].expand(-1, -1, *feats.shape[2:])  # [B, T, 3, d_v]
        picked = feats.gather(1, src)
        picked[:, 0] = 0.0
        return picked

    def logits(self, input_ids, residuals):
        B, T = input_ids.shape
        feats = self.features(residuals, offset_sources(B, T, self.k, self.generator))  # [B, T, 3, d_v]
        return self.logits_from_features(input_ids, feats)

    def logits_from_features(self, input_ids: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        """Drafter logits [B, T, V] steered at each position by already-gathered verifier features
        `feats` [B, T, 3, d_verifier] (no offsets drawn here)."""
        with self.steered(feats):
            return head_logits(self.lm.hf, input_ids, self.vocab)  # [B, T, V]

    @contextmanager
    def steered(self, feats: torch.Tensor):
        """Within the block, drafter forwards add W_s g (g from `feats` [B, T, 3, d_v]) to every up projection."""
        self._bias = self.steering.up_bias(self.steering.vector(feats))  # [L_draft, B, T, I]
        try:
            yield
        finally:
            self._bias = None

    def export(self, out, extra):
        _save_lm(self.lm, out)
        self.steering.save(out, extra)


class DVIStudent(Student):
    """DVI: the draft head on the verifier's residual stream after s layers (capture index s − 1)."""

    kind = "dvi"

    def __init__(self, head: DraftHead):
        self.head = head.train()
        self.verifier_layers = (head.cfg.layers - 1,)

    def trainable(self):
        return [(f"head.{n}", p, "adapter") for n, p in self.head.named_parameters() if p.requires_grad]

    def logits(self, input_ids, residuals):
        hidden = residuals[self.verifier_layers[0]]
        if self.vocab is None:
            return self.head(hidden)  # [B, T, V]
        x = nn.functional.rms_norm(hidden, (hidden.shape[-1],), self.head.norm, self.head.eps)
        return nn.functional.linear(x, self.head.merged_weight()[self.vocab.to(x.device)])

    def export(self, out, extra):
        self.head.save(out, extra)


class EagleStudent(Student):
    """The eagle feature head (specloop.drafter.kinds.eagle) over the frozen verifier's embedding and LM head."""

    kind = "eagle"

    head: Any  # a FeatureHead here, an Eagle3Head in Eagle3Student (which reuses the rest of this class)

    def __init__(self, head: FeatureHead | Eagle3Head, verifier_lean, depth: int, generator: torch.Generator):
        """`verifier_lean`: the verifier's decoder in any weight mode (its embedding and LM head are
        read as floats: a float model's own tensors, a quantized one's dequantized values)."""
        self.head = head.train()
        self.embed, self.lm_head = _floats(verifier_lean.embed), _floats(verifier_lean.lm_head)
        self.verifier_layers = self.layers_read(head.cfg, verifier_lean.num_layers)
        self.depth, self.generator = depth, generator

    @staticmethod
    def layers_read(cfg, num_layers: int) -> tuple[int, ...]:
        return (feature_layer(cfg, num_layers),)

    def depths(self, B: int, T: int, device) -> torch.Tensor:
        """[B, T] δ_t ~ U{1..depth}, at most t + 1: how many drafts deep each position is trained."""
        depth = torch.randint(1, self.depth + 1, (B, T), generator=self.generator)
        return torch.minimum(depth, torch.arange(1, T + 1)[None]).to(device)

    def trainable(self):
        return [(f"head.{n}", p, "adapter") for n, p in self.head.named_parameters()]

    def rows(self) -> torch.Tensor:
        """The LM head rows the logits are taken over (the draft vocabulary's, or all)."""
        return self.lm_head if self.vocab is None else self.lm_head[self.vocab.to(self.lm_head.device)]

    def logits(self, input_ids, residuals):
        return self.unrolled_logits(_shift_right(residuals[self.verifier_layers[0]]), input_ids)

    def unrolled_logits(self, prev: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, V] at each position t from the true feature of t − δ_t (prev[:, t] is the
        feature at t − 1), δ_t ~ U{1..depth} (at most t + 1), stepping through the tokens up to t."""
        prev = prev.to(self.head.fc.weight.dtype)
        embedded = nn.functional.embedding(input_ids, self.embed).to(prev.dtype)
        B, T = input_ids.shape
        depth = self.depths(B, T, prev.device)
        z = picked = self.head.step(prev, embedded)  # depth 1
        for j in range(2, self.depth + 1):  # z at t: j steps from the true feature at t − j
            z = self.head.step(_shift_right(z), embedded)
            picked = torch.where((depth == j)[..., None], z, picked)
        return self.head.logits(picked, self.rows())  # [B, T, V]

    def chain_features(self, start: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """As drafting runs it: from features `start` [R, d] through tokens [R, m] → the predicted features
        [R, m, d] whose logits (`head.logits(·, lm_head)`, the full vocabulary) are the drafts' (replay records:
        the block's feature, then its first m inputs)."""
        z, out = start.to(self.head.fc.weight.dtype), []
        embedded = nn.functional.embedding(tokens, self.embed).to(z.dtype)
        for j in range(tokens.shape[1]):
            z = self.head.step(z, embedded[:, j])
            out.append(z)
        return torch.stack(out, dim=1)

    def export(self, out, extra):
        self.head.save(out, extra)


class Eagle3Student(EagleStudent):
    """The EAGLE-3-style head (specloop.drafter.kinds.eagle3) over the frozen verifier's embedding and LM head
    (the eagle student's, but three layers read and the training-time test unrolled)."""

    kind = "eagle3"
    layers_read = staticmethod(check_layers)

    def logits(self, input_ids, residuals):
        raw = torch.cat([residuals[i] for i in self.verifier_layers], dim=-1)
        return self.unrolled_logits(_shift_right(raw), input_ids)

    def unrolled_logits(self, prev: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, V] at each position t from the chain of δ_t ~ U{1..depth} drafts (at most t + 1)
        that ends there: prev[:, t] holds the raw features (low, middle, high) that produced input_ids[:, t]."""
        w = self.head.weights()
        prev = prev.to(w.fc.dtype)
        embedded = nn.functional.embedding(input_ids, self.embed).to(prev.dtype)
        B, T = input_ids.shape
        return ttt_logits(w, prev, embedded, self.depths(B, T, prev.device), self.rows(), self.depth)

    def window_logits(self, raw: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor,
                      drafted: torch.Tensor) -> torch.Tensor:
        """As drafting runs it: from windows (raw [R, W, 3d], tokens [R, W], valid [R, W], the newest
        at the end) through the drafted tokens [R, m − 1] that drafts 2..m read → logits [R, m, V]
        over the full vocabulary (replay records)."""
        w = self.head.weights()
        embed = lambda t: nn.functional.embedding(t, self.embed).to(w.fc.dtype)  # noqa: E731
        u, k, v = window_entries(w, raw.to(w.fc.dtype), embed(tokens))
        win = Window(raw, tokens, valid, k, v, u[:, -1])
        out = chain(w, win, embed, self.lm_head, drafted.shape[1] + 1,
                    lambda i, _: drafted[:, i] if i < drafted.shape[1] else None)
        return torch.stack(out, dim=1)


def _floats(weight) -> torch.Tensor:
    """A raw float tensor as fp32, or a specloop.drafter.model.weights.quant weight object dequantized."""
    return (weight if isinstance(weight, torch.Tensor) else weight.dequantize()).detach().float()


def _shift_right(x: torch.Tensor) -> torch.Tensor:
    """[B, T, d] → position t holds x at t − 1 (zeros at t = 0)."""
    return torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)


def build_student(method: str, verifier: LoadedModel, drafter_dir: str | Path | None, *, k: int, dvi_layers: int,
                  steer_layers, generator: torch.Generator, device, vocab: torch.Tensor | None = None,
                  freeze_embeddings: bool = False) -> Student:
    """`_build_student` with logits over the draft vocabulary `vocab` (None: the full vocabulary)."""
    student = _build_student(method, verifier, drafter_dir, k=k, dvi_layers=dvi_layers, steer_layers=steer_layers,
                             generator=generator, device=device, freeze_embeddings=freeze_embeddings)
    student.vocab = vocab
    return student


def _build_student(method: str, verifier: LoadedModel, drafter_dir: str | Path | None, *, k: int, dvi_layers: int,
                   steer_layers, generator: torch.Generator, device, freeze_embeddings: bool) -> Student:
    """The student of `method` (distill, sd2, sd2-frozen, dvi or eagle) against `verifier`.

    distill / sd2 / sd2-frozen start from the drafter LM in `drafter_dir`; dvi ignores it and puts
    a fresh head on `dvi_layers` verifier layers, eagle a fresh feature head unrolled up to k drafts. SD² steers
    from `steer_layers` (three 0-based verifier layers; None: `default_steer_layers`) and draws its offsets
    δ ~ U{1..k} from `generator`.
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    if method == "dvi":
        return DVIStudent(DraftHead(verifier.hf, DVIConfig(layers=dvi_layers)).to(device))
    if method == "eagle":
        return EagleStudent(new_head(verifier.lean).to(device), verifier.lean, k, generator)
    if method == "eagle3":
        return Eagle3Student(new_head3(verifier.lean).to(device), verifier.lean, k, generator)
    if drafter_dir is None:
        raise ValueError(f"method {method} needs a drafter LM directory")
    lm = load_model(drafter_dir, device=device, dtype=torch.float32, keep_module=True)  # trained in fp32
    check_same_vocabulary(verifier, lm)
    if method == "distill":
        return DistillStudent(lm, freeze_embeddings)
    layers = steer_layers or default_steer_layers(verifier.hf.config.num_hidden_layers)
    steering = steering_for(verifier.hf.config, lm.hf.config, tuple(layers)).to(device)
    return SteeredStudent(lm, steering, k, method == "sd2", generator, freeze_embeddings)
