"""Training data: packed windows resume exactly, and generated sets are built within a budget and
extended later."""
import json

import torch

from specloop.trainer.data import GENERATED_FILE, GenerationSpec, WindowStream, build_generated_set
from tests.tiny import CONVERSATIONS

torch.set_num_threads(1)


def test_window_stream_resumes_with_the_same_windows():
    docs = [[i] * (3 + i % 5) for i in range(1, 9)]

    def documents(start):
        return iter(docs[start:])

    stream = WindowStream(documents, 7, 0)
    [stream.window() for _ in range(3)]
    state = json.loads(json.dumps(stream.state()))
    expected = [stream.window() for _ in range(10)]  # wraps into a second epoch
    resumed = WindowStream(documents, 7, 0, state)
    assert [resumed.window() for _ in range(10)] == expected
    assert stream.epoch >= 1


def test_a_generated_set_is_built_within_a_sequence_budget_and_extended_later(peaky_verifier, tmp_path):
    spec = GenerationSpec(max_tokens=8, batch_size=2)
    first = build_generated_set(peaky_verifier, tmp_path, sequences=3, spec=spec, conversations=CONVERSATIONS,
                                progress=False)
    assert first["new_sequences"] == first["sequences"] == 4  # whole batches
    more = build_generated_set(peaky_verifier, tmp_path, sequences=2, spec=spec, conversations=CONVERSATIONS,
                               progress=False)
    assert (more["new_sequences"], more["sequences"]) == (2, 6)
    conversations = [json.loads(line)["conversation"] for line in (tmp_path / GENERATED_FILE).read_text().splitlines()]
    assert conversations == sorted(set(conversations))
