"""SD² steered drafter (Berdoz et al., "Steering Pretrained Drafters during Speculative Decoding").

The verifier's residual streams h, m, l from three layers, at the position whose output produced
the newest committed token, form a steering vector

    g = LayerNorm(W_hml [h; m; l])            # W_hml: [d_draft, 3 d_verifier]

and in every drafter MLP the up projection becomes W_u a + W_s g (before the SiLU gate multiplies
it). W_s starts at zero, so an untrained steered drafter drafts exactly what the plain one drafts.
W_s g is computed once per block and reused for all k drafted positions.

Width mapping: W_hml starts as [P P P] so that W_hml [h; m; l] = P (h + m + l). With equal widths
P = I; otherwise P[i, j] = 1 where j belongs to the i-th of d_draft contiguous groups of verifier
dimensions (sum pooling down, repetition up). LayerNorm removes the scale either way.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from specloop.drafter.decode.proposer import VerifierView, first_rows, with_rows
from specloop.drafter.kinds.pretrained import PretrainedDrafter

MANIFEST = "manifest.json"
STEERING_FILE = "steering.safetensors"


def default_steer_layers(num_layers: int) -> tuple[int, int, int]:
    """Capture indices (0-based layer outputs) for layers 3, L/2 and L−2 (1-based). Shallow verifiers
    take layer min(3, L/3) first; where that still collides, the first, middle and last layers."""
    first = min(3, max(1, num_layers // 3))
    picks = (first - 1, num_layers // 2 - 1, num_layers - 3)
    if len(set(picks)) == 3 and min(picks) >= 0:
        return picks
    if num_layers < 3:
        raise ValueError(f"a {num_layers}-layer verifier has no three distinct steering layers; pass layers=")
    return (0, num_layers // 2, num_layers - 1)


def width_map(d_draft: int, d_verifier: int) -> torch.Tensor:
    """P: [d_draft, d_verifier] as described in the module docstring."""
    if d_draft == d_verifier:
        return torch.eye(d_draft)
    if d_draft > d_verifier:  # repetition: drafter dim i copies verifier dim i·d_v/d_d
        source = (torch.arange(d_draft) * d_verifier) // d_draft
        return (source[:, None] == torch.arange(d_verifier)[None, :]).float()
    group = (torch.arange(d_verifier) * d_draft) // d_verifier  # sum pooling: which drafter dim each feeds
    return (group[None, :] == torch.arange(d_draft)[:, None]).float()


@dataclass
class SteeringConfig:
    verifier_hidden: int
    drafter_hidden: int
    intermediate: int
    num_layers: int  # drafter layers
    layers: tuple[int, ...]  # verifier capture indices (three: default_steer_layers)


class Steering(nn.Module):
    """g = LayerNorm(W_hml [h; m; l]); per-layer up-projection bias W_s g."""

    def __init__(self, cfg: SteeringConfig):
        super().__init__()
        self.cfg = cfg
        self.w_hml = nn.Linear(3 * cfg.verifier_hidden, cfg.drafter_hidden, bias=False)
        self.norm = nn.LayerNorm(cfg.drafter_hidden)
        self.w_s = nn.Parameter(torch.zeros(cfg.num_layers, cfg.intermediate, cfg.drafter_hidden))
        with torch.no_grad():
            self.w_hml.weight.copy_(width_map(cfg.drafter_hidden, cfg.verifier_hidden).repeat(1, 3))

    def vector(self, features: torch.Tensor) -> torch.Tensor:
        """features [..., 3, d_verifier] → g [..., d_draft]."""
        return self.norm(self.w_hml(features.flatten(-2)))

    def up_bias(self, g: torch.Tensor) -> torch.Tensor:
        """g [..., d_draft] → W_s g for every drafter layer: [num_layers, ..., intermediate]."""
        return torch.einsum("lid,...d->l...i", self.w_s, g)

    def save(self, out: Path, extra: dict) -> None:
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}, out / STEERING_FILE)
        manifest = {"kind": "sd2", "steering": asdict(self.cfg)} | extra
        (out / MANIFEST).write_text(json.dumps(manifest, indent=2))

    @classmethod
    def load(cls, directory: Path) -> "Steering":
        cfg = read_manifest(directory)["steering"]
        module = cls(SteeringConfig(**(cfg | {"layers": tuple(cfg["layers"])})))
        module.load_state_dict(load_file(Path(directory) / STEERING_FILE))
        return module


def read_manifest(directory: Path) -> dict:
    return json.loads((Path(directory) / MANIFEST).read_text())


def steering_for(verifier_cfg, drafter_cfg, layers: tuple[int, int, int] | None = None) -> Steering:
    """An untrained steering module (W_s = 0) for this verifier/drafter pair."""
    return Steering(
        SteeringConfig(
            verifier_hidden=verifier_cfg.hidden_size,
            drafter_hidden=drafter_cfg.hidden_size,
            intermediate=drafter_cfg.intermediate_size,
            num_layers=drafter_cfg.num_hidden_layers,
            layers=tuple(layers or default_steer_layers(verifier_cfg.num_hidden_layers)),
        )
    )


class SteeredDrafter(PretrainedDrafter):
    """A pretrained drafter whose MLPs are biased, block by block, by the verifier's steering vector."""

    kind = "sd2"
    graph_biased = True  # every pass of its LM carries the block's steering biases

    def __init__(self, lean, steering: Steering):
        super().__init__(lean)
        self.steering = steering.to(device=lean.device, dtype=lean.dtype).eval()
        self.verifier_layers = steering.cfg.layers

    def start(self, prompts: list[list[int]], capacity: int, view: VerifierView | None = None) -> None:
        super().start(prompts, capacity, view)
        assert view is not None  # steering reads the verifier's features: the engine always passes them
        self._features = view.features

    def join(self, slots: list[int], prompts: list[list[int]], view: VerifierView | None = None) -> None:
        super().join(slots, prompts, view)
        assert view is not None  # steering reads the verifier's features: the engine always passes them
        idx = torch.tensor(slots, dtype=torch.long, device=self.lean.device)
        for i in self.verifier_layers:
            self._features[i][idx] = view.features[i].to(self._features[i].dtype)

    def observe(self, outcome, active: torch.Tensor, view: VerifierView | None = None) -> None:
        super().observe(outcome, active, view)
        assert view is not None  # steering reads the verifier's features: the engine always passes them
        keep = active[:, None].to(self.lean.device)
        self._features = {i: torch.where(keep, view.features[i], self._features[i]) for i in self.verifier_layers}

    @torch.inference_mode()
    def block_bias(self, steer: torch.Tensor | None) -> list[torch.Tensor]:
        """W_s g per drafter layer, [B, intermediate] each: once per block, reused for all k drafts."""
        assert steer is not None  # this class's block_inputs() always returns the features
        return list(self.steering.up_bias(self.steering.vector(steer.to(self.lean.dtype))))

    def block_inputs(self) -> torch.Tensor:
        return torch.stack([self._features[i] for i in self.verifier_layers], dim=1)  # [B, 3, d_verifier]

    def narrow(self, m: int) -> "SteeredDrafter":
        view = super().narrow(m)
        view._features = first_rows(self._features, m)
        return view

    def widen(self, view: "SteeredDrafter", m: int) -> None:
        super().widen(view, m)
        self._features = with_rows(self._features, view._features, m)

    def adopt(self, old: "SteeredDrafter") -> None:
        super().adopt(old)
        self._features = old._features

    def refill(self, old: "SteeredDrafter", histories: list[list[int]]) -> None:
        super().refill(old, histories)
        self._features = old._features
