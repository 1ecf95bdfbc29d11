"""Tiny deterministic models built in-process, and the reference pair when the checkout has it."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run interpreted on CPU tensors (drafter/model/decode_attention.py):
    os.environ.setdefault("TRITON_INTERPRET", "1")  # set before anything imports triton (torch.compile does)

import specloop.drafter  # noqa: F401, E402  (sets MKL_CBWR before any product: drafter/__init__.py)

torch.set_num_threads(1)

from specloop.services.buffer.memory import MemoryBuffer  # noqa: E402
from specloop.services.protocol import CompletionRequest  # noqa: E402
from specloop.services.worker.worker import VerifierWorker, WorkerConfig  # noqa: E402
from tests.tiny import TEXT, make_pair  # noqa: E402

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
def wide_fp32_row_blocks(monkeypatch):
    """For the sampled-distribution tests, which decode thousands of rows in one batch: fp32 decode-shaped
    products in fixed, zero-padded blocks of 64 rows (the blocked path bf16 takes, with a wider block) instead
    of one F.linear call per row. Each row still meets the same call shape whatever the batch; what changes is
    the Python loop around the GEMMs (at 5000 rows per batch it was ~3/4 of those tests' CPU time). These
    tests compare sampled frequencies with exact probabilities at a 0.01 level over 10^4 samples, far coarser
    than anything the kernel path rounds; bit-exactness keeps its own tests (greedy equality on the product's
    default path, tests/drafter/model/test_decoder.py and test_kernels.py)."""
    from specloop.drafter.model.weights import linears

    monkeypatch.setitem(linears.ROW_BLOCK, torch.float32, 64)


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


@pytest.fixture(scope="session")
def payloads(tiny_pair) -> list[bytes]:
    """Encoded replay records logged by a verifier worker serving 12 prompts (greedy, k 4)."""
    verifier, drafter = tiny_pair
    buffer = MemoryBuffer()
    worker = VerifierWorker(WorkerConfig(str(verifier), str(drafter), "pretrained"), buffer)
    tok = worker.verifier.tokenizer
    prompts = [tok.encode(text[start : start + 20]) for text in TEXT for start in (0, 15, 30)]
    for i, ids in enumerate(prompts):
        worker.serve(CompletionRequest(f"p{i}", ids, max_tokens=32, k=4, stream_index=i))
    worker.close()
    out = [e.payload for e in buffer.read("collect", 100_000)]
    assert len(out) >= 60
    return out


# Integration tests start something beside the test process (Redis, Ray, a uvicorn server, nginx,
# Prometheus, docker-compose, a specloop subprocess); the rest are unit tests. `-m "not integration"` runs
# the unit tests alone; the README's test command runs both.
STARTS_SOMETHING = {"redis_server", "redis_buffers", "redis_buffer_factory", "local_ray", "cluster", "server", "runs"}
INTEGRATION_MODULES = {"test_deploy", "test_dashboards", "test_faithful_defaults", "test_cluster", "test_actors",
                       "test_deployment", "test_launch", "test_drain", "test_cli"}


# Modules that run for minutes, collected near the end: moved to the front of the run. pytest-xdist (scripts/test.sh:
# --dist load) hands each worker a contiguous chunk first and refills them as they go, so a long module at the end of
# the collection leaves the other worker idle while it runs (seen: test_faithful_defaults, ~200 s of the last ~260 s
# of a run, on one worker). At the front it runs while the other worker takes the rest. Order within a module kept.
RUN_FIRST = ("tests/test_faithful_defaults.py",)


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in RUN_FIRST)  # stable: every other order kept
    for item in items:
        module = item.module.__name__.rpartition(".")[2] if item.module else ""
        uses_redis = any(m.name == "skipif" and "Redis" in str(m.kwargs.get("reason", "")) for m in item.iter_markers())
        if module in INTEGRATION_MODULES or uses_redis or STARTS_SOMETHING & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)
