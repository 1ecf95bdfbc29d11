"""Tiny deterministic models built in-process, and the reference pair when the checkout has it."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import drafter  # noqa: F401  (sets MKL_CBWR before any product: drafter/__init__.py)

torch.set_num_threads(1)

from tests.tiny import make_pair  # noqa: E402

SHARED_MODELS = Path(__file__).resolve().parents[2] / "shared" / "models"
SHARED_PROMPTS = Path(__file__).resolve().parents[2] / "shared" / "prompts"


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """(verifier_dir, drafter_dir): tiny Llamas sharing a byte-level BPE tokenizer."""
    return make_pair(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def reference_pair():
    """The trained reference pair in ../shared/models (every checkout and CI run has it)."""
    if not (SHARED_MODELS / "verifier" / "config.json").is_file():
        pytest.skip(f"reference models not found at {SHARED_MODELS}")
    return SHARED_MODELS / "verifier", SHARED_MODELS / "drafter"


@pytest.fixture
def redis_server(tmp_path):
    """A throwaway redis-server on a free port, started; the test may stop and restart it. Killed afterwards.
    Mark the test `needs_redis_server` (tests.redis_helpers)."""
    from tests.redis_helpers import ThrowawayRedis

    server = ThrowawayRedis(tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def peaky_pair(tmp_path_factory):
    """(verifier_dir, drafter_dir): a 6-layer verifier (so the default steering layers exist) and a 1-layer
    drafter, peaky enough (init std 0.2) that their distributions differ measurably."""
    return make_pair(tmp_path_factory.mktemp("peaky"), verifier_layers=6, verifier_hidden=48, init_std=0.2)


@pytest.fixture(scope="session")
def peaky_verifier(peaky_pair):
    """The verifier directory of `peaky_pair`."""
    return peaky_pair[0]
