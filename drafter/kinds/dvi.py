"""DVI draft head (Bhansali & Heck, "Draft, Verify & Improve"): the verifier's first s layers,
frozen, feed a draft LM head (RMSNorm + the verifier's LM head with LoRA adapters from peft).

What is reused from the verifier, and why it is exact:
- the KV cache of layers 0..s−1: drafting runs the verifier's own first s layers on the same
  tokens at the same positions, so the drafter has no KV cache, no prefill and no rollback of its
  own; it reads the verifier's cache and writes positions the verify pass then rewrites with the
  same values (the verifier's `lens` never moves during drafting);
- the embeddings and the first s layers' weights (shared tensors, nothing copied);
- the LM head's base weight (LoRA adds a low-rank delta, folded in once per load).
An untrained head (LoRA B = 0) is an early exit: the verifier's own norm and LM head after layer s.
"""
from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from specloop.drafter.decode.proposer import Proposal, VerifierView, choose, first_rows, stack_proposal, with_rows
from specloop.drafter.decode.rejection import BlockOutcome
from specloop.drafter.decode.sampling import RowParams, SamplingParams
from specloop.drafter.kinds.sd2 import MANIFEST
from specloop.drafter.model.decoder import LeanDecoder
from specloop.drafter.model.vocab import expand
from specloop.drafter.model.weights.quant import quantize_like

HEAD_FILE = "dvi_head.safetensors"


@dataclass
class DVIConfig:
    layers: int = 2  # s: verifier layers feeding the head
    rank: int = 8
    alpha: int = 16


class DraftHead(nn.Module):
    """RMSNorm + LM head with LoRA, on the verifier's layer-s residual stream."""

    def __init__(self, verifier_hf, cfg: DVIConfig):
        super().__init__()
        from peft import LoraConfig, inject_adapter_in_model

        n_layers = verifier_hf.config.num_hidden_layers
        if not 1 <= cfg.layers < n_layers:
            raise ValueError(f"DVI needs 1 <= s < {n_layers} verifier layers, got s={cfg.layers}")
        self.cfg = cfg
        self.eps = float(verifier_hf.config.rms_norm_eps)
        base_head = verifier_hf.lm_head.weight.detach()
        self.norm = nn.Parameter(verifier_hf.model.norm.weight.detach().clone())
        # an nn.Linear until inject_adapter_in_model wraps it in peft's LoRA layer (base_layer, get_delta_weight)
        self.head: Any = nn.Linear(base_head.shape[1], base_head.shape[0], bias=False)
        with torch.no_grad():
            self.head.weight.copy_(base_head)
        lora = LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, target_modules=["head"], lora_dropout=0.0)
        inject_adapter_in_model(lora, self)
        for name, p in self.named_parameters():
            p.requires_grad = name == "norm" or "lora_" in name

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., d] (verifier residual after layer s) → logits [..., V]."""
        x = nn.functional.rms_norm(hidden, (hidden.shape[-1],), self.norm, self.eps)
        return self.head(x)

    def merged_weight(self) -> torch.Tensor:
        """The LM head with the LoRA delta added, differentiable (training over a draft vocabulary)."""
        return self.head.base_layer.weight + self.head.get_delta_weight("default")

    def merged(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm weight, LM head weight with the LoRA delta folded in) for inference."""
        with torch.no_grad():
            delta = self.head.get_delta_weight("default")
            return self.norm.detach().clone(), (self.head.base_layer.weight + delta).detach()

    def trainable_state(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().contiguous().cpu() for n, p in self.named_parameters() if p.requires_grad}

    def save(self, out: Path, extra: dict) -> None:
        out.mkdir(parents=True, exist_ok=True)
        save_file(self.trainable_state(), out / HEAD_FILE)
        (out / MANIFEST).write_text(json.dumps({"kind": "dvi", "dvi": asdict(self.cfg)} | extra, indent=2))

    @classmethod
    def load(cls, directory: Path, verifier_hf) -> "DraftHead":
        manifest = json.loads((Path(directory) / MANIFEST).read_text())
        if manifest.get("kind") != "dvi":
            raise ValueError(f"{directory} holds a {manifest.get('kind')!r} checkpoint, not a DVI head")
        head = cls(verifier_hf, DVIConfig(**manifest["dvi"]))
        missing = set(head.trainable_state()) - set(state := load_file(Path(directory) / HEAD_FILE))
        if missing:
            raise ValueError(f"{directory}: DVI head file lacks {sorted(missing)}")
        head.load_state_dict(state, strict=False)
        return head


class DVIDrafter:
    """Drafts with the verifier's first s layers and the draft head, on the verifier's own cache."""

    kind = "dvi"
    verifier_layers: tuple[int, ...] = ()
    follows_plain = False  # its last tokens miss plain steps

    def __init__(self, verifier: LeanDecoder, head: DraftHead, vocab: torch.Tensor | None = None):
        self.lean = verifier
        self.layers = range(head.cfg.layers)
        # the head's input: the residual stream after layer s
        self.record_layers: tuple[int, ...] = (head.cfg.layers - 1,)
        norm, weight = head.merged()
        self.vocab = None if vocab is None else vocab.to(verifier.device)  # FR-Spec subset (model.vocab)
        self.norm = norm.to(verifier.device, verifier.dtype)
        weight = weight if vocab is None else weight[vocab.to(weight.device)]
        self.head = quantize_like(verifier, weight)  # the verifier's weight format (model.weights.quant)

    def start(self, prompts: list[list[int]], capacity: int, view: VerifierView) -> None:
        self.cache = view.cache
        self.last = torch.tensor([p[-1] for p in prompts], dtype=torch.long)

    def join(self, slots: list[int], prompts: list[list[int]], view: VerifierView) -> None:
        """New rows: the verifier prefilled them into its (our) cache; remember their last token."""
        self.last[torch.tensor(slots, dtype=torch.long)] = torch.tensor([p[-1] for p in prompts], dtype=torch.long)

    @torch.inference_mode()
    def propose(self, k: int, params: SamplingParams | RowParams, uniforms: torch.Tensor | None) -> Proposal:
        base = self.cache.lens
        tokens, steps = self.last[:, None], []
        for i in range(k):
            at = self.lean.positions(self.cache, 1)
            x = self.lean.run_layers(self.cache, at, self.lean.embed_tokens(tokens), self.layers)
            logits = self.lean.logits(x, self.norm, self.head)[:, -1]
            if self.vocab is not None:
                logits = expand(logits, self.vocab, self.lean.vocab_size)
            steps.append(choose(logits, params, None if uniforms is None else uniforms[:, i]))
            self.cache.lens = self.cache.lens + 1
            tokens = steps[-1].token[:, None]
        self.cache.lens = base  # the verify pass writes these positions again, every layer
        return stack_proposal(steps, params)

    def observe(self, outcome: BlockOutcome, active: torch.Tensor, view: VerifierView) -> None:
        self.last = torch.where(active, outcome.last_tokens, self.last)

    def narrow(self, m: int) -> "DVIDrafter":
        view = copy.copy(self)
        view.cache, view.last = first_rows(self.cache, m), first_rows(self.last, m)
        return view

    def widen(self, view: "DVIDrafter", m: int) -> None:
        self.cache, self.last = with_rows(self.cache, view.cache, m), with_rows(self.last, view.last, m)

    def adopt(self, old: "DVIDrafter") -> None:
        """Continue `old`'s rows with this head: the cache is the verifier's, valid for any head."""
        self.cache, self.last = old.cache, old.last

    def refill(self, old: "DVIDrafter", histories: list[list[int]]) -> None:
        self.adopt(old)  # nothing to recompute: the cache is the verifier's
