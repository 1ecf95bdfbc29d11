"""What crosses the API ↔ worker boundary: dataclasses with explicit dict round trips, strict shapes."""
from __future__ import annotations

import pytest

from specloop.drafter.decode.sampling import SamplingParams
from specloop.services.protocol import Chunk, CompletionRequest, ErrorInfo, ProtocolError, Usage, WorkerInfo, overloaded


def test_sampling_params_of_a_request_match_its_fields():
    r = CompletionRequest("x", [1], max_tokens=5, temperature=0.5, top_k=3, top_p=0.9, seed=4, stop=["a"])
    assert r.sampling() == SamplingParams(0.5, 3, 0.9, 5, ("a",), 4)
    assert CompletionRequest.from_dict(r.to_dict()) == r


def test_a_chunk_round_trips_with_its_usage_and_error():
    chunk = Chunk("x", [1, 2], "hi", "stop", Usage(3, 2, 4, 1, 1, "v0001"))
    assert Chunk.from_dict(chunk.to_dict()) == chunk and chunk.last
    err = overloaded("y")
    assert Chunk.from_dict(err.to_dict()) == err and err.error.status == 503 and err.last
    assert not Chunk("z", [1], "a").last


def test_unknown_or_missing_fields_are_refused():
    with pytest.raises(ProtocolError, match="unknown fields"):
        CompletionRequest.from_dict({"id": "a", "prompt_ids": [1], "pickle": "x"})
    with pytest.raises(ProtocolError):
        CompletionRequest.from_dict({"id": "a"})
    with pytest.raises(ProtocolError, match="expected a dict"):
        WorkerInfo.from_dict(["not", "a", "dict"])
    with pytest.raises(ProtocolError):
        Chunk.from_dict({"id": "a", "error": {"message": "m"}})
    assert ErrorInfo("m", "server_error", 500).param is None
