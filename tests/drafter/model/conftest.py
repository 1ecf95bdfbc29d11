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
