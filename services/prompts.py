"""Prompt files (JSON lines) and their encoding to token ids."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


class PromptError(ValueError):
    """A prompt file or record is malformed."""


@dataclass(frozen=True)
class PromptRecord:
    id: str
    prompt: str | None = None
    messages: tuple[dict, ...] | None = None


def parse_record(obj: object, where: str) -> PromptRecord:
    """One JSON object: {"id", "prompt"} or {"id", "messages": [{"role","content"}...]}."""
    if not isinstance(obj, dict):
        raise PromptError(f"{where}: expected a JSON object")
    pid = obj.get("id")
    if not isinstance(pid, str) or not pid:
        raise PromptError(f"{where}: 'id' must be a non-empty string")
    prompt, messages = obj.get("prompt"), obj.get("messages")
    if (prompt is None) == (messages is None):
        raise PromptError(f"{where}: give exactly one of 'prompt' or 'messages'")
    if prompt is not None:
        if not isinstance(prompt, str) or not prompt:
            raise PromptError(f"{where}: 'prompt' must be a non-empty string")
        return PromptRecord(id=pid, prompt=prompt)
    if not isinstance(messages, list) or not messages:
        raise PromptError(f"{where}: 'messages' must be a non-empty list")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise PromptError(f"{where}: each message needs string 'role' and 'content'")
    return PromptRecord(id=pid, messages=tuple({"role": m["role"], "content": m["content"]} for m in messages))


def load_prompts(path: str | Path, limit: int | None = None) -> list[PromptRecord]:
    path = Path(path)
    if not path.is_file():
        raise PromptError(f"prompt file not found: {path}")
    records = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PromptError(f"{path}:{lineno}: invalid JSON ({exc.msg})") from None
        records.append(parse_record(obj, f"{path}:{lineno}"))
        if limit and len(records) >= limit:
            break
    if not records:
        raise PromptError(f"{path}: no prompts")
    return records


def encode(tokenizer, record: PromptRecord) -> list[int]:
    """Token ids; chat messages go through the tokenizer's chat template with a generation prompt."""
    if record.messages is not None:
        ids = tokenizer.apply_chat_template(list(record.messages), add_generation_prompt=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    else:
        ids = tokenizer.encode(record.prompt, add_special_tokens=False)
    if not ids:
        raise PromptError(f"prompt {record.id!r} encodes to no tokens")
    return list(ids)
