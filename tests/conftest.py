"""Tiny deterministic models built in-process, and the reference pair when the checkout has it."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

from tests.tiny import make_model, make_tokenizer  # noqa: E402

SHARED_MODELS = Path(__file__).resolve().parents[2] / "shared" / "models"
SHARED_PROMPTS = Path(__file__).resolve().parents[2] / "shared" / "prompts"


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """(verifier_dir, drafter_dir): tiny Llamas sharing a byte-level BPE tokenizer."""
    root = tmp_path_factory.mktemp("tiny")
    tok = make_tokenizer(root / "tokenizer")
    verifier = make_model(root / "verifier", tok, layers=3, hidden=64, seed=1)
    drafter = make_model(root / "drafter", tok, layers=1, hidden=32, seed=2)
    return verifier, drafter


@pytest.fixture(scope="session")
def reference_pair():
    """The trained reference pair in ../shared/models (every checkout and CI run has it)."""
    if not (SHARED_MODELS / "verifier" / "config.json").is_file():
        pytest.skip(f"reference models not found at {SHARED_MODELS}")
    return SHARED_MODELS / "verifier", SHARED_MODELS / "drafter"
