"""Training data for aligning a drafter with the verifier: documents packed into token windows.

Data (never ShareGPT's last `HOLDOUT` conversations — `corpora.iter_sharegpt_train`):
- teacher-forced  training conversations rendered with the tokenizer's chat template
                  (`conversation_ids`);
- generated       the verifier's own samples at T = 1 from the training conversations' first user
                  turns (`first_turn_prompt`), produced once with specloop's batched decoding and
                  cached as JSON lines (`GeneratedSet`, `build_generated_set`).
Both are packed end to end (separated by the pad token) into windows of `seq_len` tokens
(`WindowStream`, resumable from its `state()`).
"""
from __future__ import annotations

import itertools
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from tqdm import tqdm

from specloop.drafter.decode.engine import generate
from specloop.drafter.decode.requests import StopRule
from specloop.drafter.decode.sampling import SamplingParams
from specloop.drafter.kinds.pretrained import PretrainedDrafter
from specloop.drafter.model.loading import LoadedModel, check_same_vocabulary, load_model
from specloop.trainer.corpora import iter_sharegpt_train, iter_stdlib_code_files, render_chat

GENERATED_FILE = "generated.jsonl"
GENERATED_META = "generated.json"


class ConversationSource:
    """Training conversations by index: ShareGPT's training split in file order, or an explicit list."""

    def __init__(self, conversations: list | None = None):
        self.conversations = conversations

    @property
    def name(self) -> str:
        return "sharegpt-train" if self.conversations is None else f"explicit-{len(self.conversations)}"

    def iter_from(self, start: int) -> Iterator[tuple[int, list]]:
        """(index, conversation) from `start` on; never a held-out conversation."""
        items = iter_sharegpt_train() if self.conversations is None else iter(self.conversations)
        return enumerate(itertools.islice(items, start, None), start)


def _ids(encoded) -> list[int]:
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def code_documents(tokenizer, start: int, max_tokens: int) -> Iterator[list[int]]:
    """The standard library's non-test source files (sorted by path) from index `start`, as raw token ids."""
    files = itertools.islice(iter_stdlib_code_files(include_tests=False), start, None)
    for _, source in files:
        yield tokenizer.encode(source[: max_tokens * 16], add_special_tokens=False)[:max_tokens]


def conversation_ids(tokenizer, messages: list, max_tokens: int) -> list[int]:
    """A whole conversation through the chat template (ours if the tokenizer has none), truncated."""
    try:
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(messages, tokenize=False)
        else:
            text = render_chat(messages)
    except Exception:  # a template that rejects this role order (jinja raises its own errors)
        return []
    return tokenizer.encode(text[: max_tokens * 16], add_special_tokens=False)[:max_tokens]


def first_turn_prompt(tokenizer, messages: list) -> list[int]:
    """The first user turn with a generation prompt, as the verifier would be asked it; [] if none."""
    user = next((m for m in messages if m["role"] == "user" and m["content"].strip()), None)
    if user is None:
        return []
    try:
        return _ids(tokenizer.apply_chat_template([user], add_generation_prompt=True))
    except Exception:
        return tokenizer.encode(render_chat([user], add_generation_prompt=True), add_special_tokens=False)


class WindowStream:
    """Documents (token lists) packed end to end, each followed by `separator`, cut into windows.

    Resumable: `state()` is (next document index, epoch, tokens carried into the next window); a
    stream built with that state yields the same windows the original would have.
    """

    def __init__(self, documents: Callable[[int], Iterator[list[int]]], seq_len: int, separator: int,
                 state: dict | None = None):
        self.documents, self.seq_len, self.separator = documents, seq_len, separator
        state = state or {}
        self.next_document = int(state.get("next_document", 0))
        self.epoch = int(state.get("epoch", 0))
        self.carry = list(state.get("carry", []))
        self._it: Iterator[list[int]] | None = None
        self._gained = self.next_document > 0

    def state(self) -> dict:
        return {"next_document": self.next_document, "epoch": self.epoch, "carry": list(self.carry)}

    def _read(self) -> list[int]:
        while True:
            if self._it is None:
                self._it = self.documents(self.next_document)
            doc = next(self._it, None)
            if doc is not None:
                self.next_document += 1
                self._gained = self._gained or bool(doc)
                return doc
            if not self._gained:
                raise ValueError("no training documents (every conversation rendered to nothing)")
            self._it, self.next_document, self.epoch, self._gained = None, 0, self.epoch + 1, False

    def window(self) -> list[int]:
        while len(self.carry) < self.seq_len:
            doc = self._read()
            if doc:
                self.carry.extend(doc + [self.separator])
        out, self.carry = self.carry[: self.seq_len], self.carry[self.seq_len:]
        return out

    def batch(self, size: int) -> torch.Tensor:
        return torch.tensor([self.window() for _ in range(size)], dtype=torch.long)  # [B, T]


@dataclass
class GenerationSpec:
    """What a generated set holds; seed, lengths and source must match to reuse a cache."""

    seed: int = 0
    max_tokens: int = 128
    max_prompt_tokens: int = 64
    batch_size: int = 32
    k: int = 0  # 0: the verifier alone


class GeneratedSet:
    """The verifier's samples at T = 1 from training first-user-turn prompts, cached as JSON lines
    `{"conversation", "prompt_ids", "generated_ids", "finish"}` and extended on demand.

    Request i (i = conversation index) samples from its own stream seeded from (seed, i), so the
    cache is reproducible batch by batch. A document is prompt + generated ids (+ EOS if it stopped).
    """

    def __init__(self, directory: str | Path, verifier: LoadedModel, source: ConversationSource,
                 spec: GenerationSpec, drafter_dir: str | Path | None = None):
        self.dir = Path(directory)
        self.path = self.dir / GENERATED_FILE
        self.verifier, self.source, self.spec, self.drafter_dir = verifier, source, spec, drafter_dir
        self.eos = verifier.eos_ids
        self.seconds = 0.0  # spent generating in this process
        self.new_sequences = 0
        self.new_tokens = 0
        self._prompts: Iterator[tuple[int, list[int]]] | None = None
        self._drafter: PretrainedDrafter | None = None
        self._check_meta()
        self.records = self._read()

    def _meta(self) -> dict:
        return {"verifier": str(Path(self.verifier.path).resolve()), "source": self.source.name,
                "temperature": 1.0, "seed": self.spec.seed, "max_tokens": self.spec.max_tokens,
                "max_prompt_tokens": self.spec.max_prompt_tokens}

    def _check_meta(self) -> None:
        meta_path = self.dir / GENERATED_META
        if meta_path.is_file():
            found = json.loads(meta_path.read_text())
            if found != self._meta():
                raise ValueError(f"{self.dir} caches data generated with {found}, not {self._meta()}; "
                                 "give another data cache directory")
        else:
            self.dir.mkdir(parents=True, exist_ok=True)
            meta_path.write_text(json.dumps(self._meta(), indent=2) + "\n")

    def _read(self) -> list[dict]:
        records, good_bytes = [], 0
        if self.path.is_file():
            with open(self.path, "rb") as f:
                for line in f:
                    try:
                        records.append(json.loads(line))
                    except json.JSONDecodeError:
                        break  # a line cut off by an interrupted run: drop it and what follows
                    good_bytes += len(line)
            if good_bytes != self.path.stat().st_size:
                with open(self.path, "r+b") as f:
                    f.truncate(good_bytes)
        return records

    def __len__(self) -> int:
        return len(self.records)

    def document(self, i: int) -> list[int]:
        r = self.records[i]
        eos = [min(self.eos)] if r["finish"] == "stop" and self.eos else []
        return r["prompt_ids"] + r["generated_ids"] + eos

    def documents(self, start: int) -> Iterator[list[int]]:
        """Documents from index `start`, generating more when the cache runs out."""
        i = start
        while True:
            while i >= len(self.records):
                if not self.extend_batch():
                    return
            yield self.document(i)
            i += 1

    def _prompt_iter(self) -> Iterator[tuple[int, list[int]]]:
        if self._prompts is None:
            start = self.records[-1]["conversation"] + 1 if self.records else 0
            tok = self.verifier.tokenizer
            limit = self.spec.max_prompt_tokens
            self._prompts = (
                (i, p) for i, conv in self.source.iter_from(start)
                if 0 < len(p := first_turn_prompt(tok, conv)) <= limit
            )
        return self._prompts

    def _generation_drafter(self) -> PretrainedDrafter | None:
        if not self.spec.k or self.drafter_dir is None:
            return None
        if self._drafter is None:
            lm = load_model(self.drafter_dir, device=self.verifier.lean.device, dtype=self.verifier.dtype)
            check_same_vocabulary(self.verifier, lm)
            self._drafter = PretrainedDrafter(lm.lean)
        return self._drafter

    def extend_batch(self) -> int:
        """Generate one batch of sequences from the next prompts; returns how many (0: no prompts left)."""
        batch = list(itertools.islice(self._prompt_iter(), self.spec.batch_size))
        if not batch:
            return 0
        t0 = time.monotonic()
        drafter = self._generation_drafter()
        params = SamplingParams(temperature=1.0, max_tokens=self.spec.max_tokens, seed=self.spec.seed)
        gens = generate(self.verifier.lean, drafter, [p for _, p in batch], params,
                        self.spec.k if drafter else 0, StopRule(self.eos), first_request=batch[0][0])
        lines = []
        for (i, prompt), g in zip(batch, gens):
            record = {"conversation": i, "prompt_ids": prompt, "generated_ids": g.token_ids, "finish": g.finish_reason}
            self.records.append(record)
            lines.append(json.dumps(record) + "\n")
            self.new_tokens += len(g.token_ids)
        with open(self.path, "a") as f:
            f.write("".join(lines))
        self.new_sequences += len(batch)
        self.seconds += time.monotonic() - t0
        return len(batch)

    def extend(self, sequences: int | None = None, minutes: float | None = None, progress: bool = True) -> dict:
        """Generate until `sequences` more are cached, `minutes` have passed, or the prompts run out."""
        if sequences is None and minutes is None:
            raise ValueError("give a budget: sequences and/or minutes")
        start, before, tokens_before = time.monotonic(), len(self), self.new_tokens
        deadline = None if minutes is None else start + 60.0 * minutes
        with tqdm(total=sequences, desc="generate", unit="seq", disable=not progress, file=sys.stderr) as bar:
            while sequences is None or len(self) - before < sequences:
                if deadline is not None and time.monotonic() >= deadline:
                    break
                added = self.extend_batch()
                if not added:
                    break
                rate = (self.new_tokens - tokens_before) / max(1e-9, time.monotonic() - start)
                bar.update(added)
                bar.set_postfix(tok_s=f"{rate:.0f}")
        seconds = time.monotonic() - start
        new = self.new_tokens - tokens_before
        return {"path": str(self.path), "sequences": len(self), "new_sequences": len(self) - before,
                "new_tokens": new, "seconds": round(seconds, 2), "tokens_per_s": round(new / max(seconds, 1e-9), 1)}


def build_generated_set(verifier_dir: str | Path, cache_dir: str | Path, sequences: int | None = None,
                        minutes: float | None = None, drafter_dir: str | Path | None = None,
                        spec: GenerationSpec | None = None, conversations: list | None = None,
                        progress: bool = True) -> dict:
    """Fill (or extend) a generated-data cache in `cache_dir` within a budget; returns its statistics."""
    verifier = load_model(verifier_dir, dtype=torch.float32)
    data = GeneratedSet(cache_dir, verifier, ConversationSource(conversations), spec or GenerationSpec(), drafter_dir)
    return data.extend(sequences=sequences, minutes=minutes, progress=progress)
