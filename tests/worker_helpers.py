"""Helpers several test modules share (moved from test_worker.py)."""
from __future__ import annotations

import torch

from specloop.drafter.model.loading import load_model
from specloop.services.registry.registry import Registry


def base_weights(drafter_dir) -> dict:
    """Version weights equal to the base drafter, in the learner's naming ("lm.<hf name>")."""
    hf = load_model(drafter_dir).hf
    return {"lm." + n: p.detach().clone() for n, p in hf.named_parameters()}


def noisy(weights: dict, std: float, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {n: t + std * torch.randn(t.shape, generator=gen) for n, t in weights.items()}


def publish(reg: Registry, weights: dict, parent: str | None, sim: float) -> str:
    return reg.publish(weights, parent=parent, learner_step=0, objective="base", loss=None,
                       sim_acceptance=sim, kind="pretrained").id
