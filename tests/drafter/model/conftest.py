"""Fixtures of the Triton kernels' tests (test_decode_attention.py, test_skinny_linear.py)."""
import os

import pytest

from specloop.drafter.model.loading import load_model


@pytest.fixture(scope="module")
def tiny_verifier(tiny_pair):
    """The tiny reference verifier (tests/conftest.py's tiny_pair), loaded once a module."""
    return load_model(tiny_pair[0])

@pytest.fixture
def row_by_row_dot(monkeypatch):
    """Under the interpreter, tl.dot is numpy's matmul of the whole tile, and how the BLAS behind it rounds a row
    may depend on where the row sits in the tile (OpenBLAS's kernel for an AMD EPYC gives a tile's edge rows
    another order of accumulation; its Intel one did not). A GPU's MMA computes every output row the same way
    wherever it sits, the property these tests check of the kernel's own logic: here each row is its own product."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import numpy as np
    from triton.runtime import interpreter

    plain = interpreter.InterpreterBuilder.create_dot

    def by_rows(self, a, b, d, input_precision, max_num_imprecise_acc):
        out = plain(self, a, b, d, input_precision, max_num_imprecise_acc)
        if a.data.ndim == 2 and a.dtype.primitive_bitwidth > 8:
            rows = [np.matmul(a.data[i : i + 1], b.data, dtype=d.data.dtype) for i in range(a.data.shape[0])]
            out.data = np.concatenate(rows, axis=0) + d.data
        return out

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", by_rows)


@pytest.fixture
def graph_decode(tiny_pair):
    """decode(kind, k, check) → each prompt's greedy tokens from a fresh engine on the graph backend (the step
    the test's environment sets: SPECLOOP_COMPILE=0 on the CPU), the tiny pair's `kind` drafter at k (0: the
    verifier alone); `check` is called with the engine first (what the test asserts of its step)."""
    from specloop.drafter.decode.engine import Engine
    from specloop.drafter.decode.requests import EngineRequest, StopRule
    from specloop.drafter.decode.sampling import SamplingParams
    from specloop.drafter.kinds.table import build_drafter

    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]

    def decode(kind: str, k: int, check=lambda engine: None) -> list[list[int]]:
        verifier = load_model(tiny_pair[0])
        drafter = build_drafter(kind, verifier, tiny_pair[1] if kind == "pretrained" else None) if k else None
        engine = Engine(verifier.lean, drafter, 3, 128, StopRule(verifier.eos_ids), backend="graph")
        check(engine)
        engine.admit([EngineRequest(str(i), p, SamplingParams(max_tokens=12), k) for i, p in enumerate(prompts)])
        out = {}
        while engine.running:
            out.update((u.id, u.generation.token_ids) for u in engine.step() if u.generation is not None)
        return [out[str(i)] for i in range(len(prompts))]

    return decode
