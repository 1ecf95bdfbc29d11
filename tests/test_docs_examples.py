"""The docs' client examples run as written: every ```python block of docs/usage.md that talks to a server through
the official `openai` client is executed against a real serving loop over the reference pair (a worker with its
drafter, speculation on), its base URL pointed at that server. An example that raises, or whose own checks (a
json.loads, a tool call's arguments) fail, fails here."""
from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
import torch

from specloop.drafter.model.loading import load_tokenizer
from specloop.services.api.app import create_app
from specloop.services.worker.serving_loop import LocalBackend, wait_ready
from tests.admin_helpers import serving

DOCS = Path(__file__).resolve().parents[1] / "docs"
DOCUMENTED_URL = "http://127.0.0.1:8000/v1"


def client_examples(doc: Path) -> list[str]:
    blocks = re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.S)
    return [b for b in blocks if "OpenAI(" in b]


EXAMPLES = client_examples(DOCS / "usage.md")


def test_usage_md_has_client_examples_that_name_the_documented_url():
    assert EXAMPLES, "docs/usage.md has no openai client example"
    assert all(DOCUMENTED_URL in block for block in EXAMPLES)


@pytest.fixture(scope="module")
def base_url(reference_pair):
    torch.set_num_threads(1)
    backend = LocalBackend.open(str(reference_pair[0]), str(reference_pair[1]), "pretrained", model="reference",
                                slots=2, max_queue=8)
    try:
        assert wait_ready(backend.loop, 60), "the worker did not warm up"
        info = asyncio.run(backend.workers())[0]
        app = create_app(backend, load_tokenizer(info.verifier), "reference", info.max_context)
        with serving(app) as base:
            yield f"{base}/v1"
    finally:
        asyncio.run(backend.close())


@pytest.mark.parametrize("i", range(len(EXAMPLES)))
def test_each_client_example_in_usage_md_runs_against_a_real_server(base_url, i, capsys):
    code = EXAMPLES[i].replace(DOCUMENTED_URL, base_url)
    exec(compile(code, f"docs/usage.md example {i}", "exec"), {"__name__": "docs_example"})
    print(capsys.readouterr().out)
