"""`specloop models bootstrap`: train a tokenizer, a verifier and a smaller drafter from scratch.

Budget (wall clock, ``minutes`` in all): ~10% tokenizer and data, then the rest
split 2:1 between the verifier (ShareGPT chat + stdlib code, 2:1 by tokens) and
the drafter (chat only, so code is a drift domain for it). The last `holdout`
ShareGPT conversations are never read here (see `corpora.iter_sharegpt_train`).
Output, Hugging Face format: DIR/verifier, DIR/drafter (each with the shared
tokenizer and chat template) and DIR/bootstrap.json (what was trained).
"""
from __future__ import annotations

import itertools
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from specloop.trainer.corpora import HOLDOUT, iter_sharegpt_train, iter_stdlib_code_files, render_chat

SPECIAL_TOKENS = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
PAD_ID, EOS_ID = 0, 4  # <|endoftext|>, <|end|>
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SUMMARY_FILE = "bootstrap.json"


@dataclass
class ModelSpec:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    mlp: int
    peak_lr: float


@dataclass
class BootstrapConfig:
    out_dir: str
    minutes: float = 4.0  # total wall-clock budget
    seed: int = 0
    vocab_size: int = 4096
    threads: int = 2
    seq_len: int = 256
    batch: int = 8  # at equal tokens, 8 x 256 beat 16 x 256 on a few-minute budget (more steps)
    holdout: int = HOLDOUT
    data_share: float = 0.10  # tokenizer + tokenized data
    verifier_share: float = 0.60  # the drafter gets the rest
    verifier: ModelSpec = field(default_factory=lambda: ModelSpec(4, 192, 4, 2, 512, 2e-3))
    drafter: ModelSpec = field(default_factory=lambda: ModelSpec(2, 96, 2, 1, 256, 3e-3))
    code_per_chat: float = 0.5  # verifier's code:chat token ratio (1:2)
    conversations_per_minute: int = 1000  # conversation pool, scaled with the budget
    max_conversations: int = 6000
    chat_tokens_per_minute: int = 600_000  # tokenized chat target, scaled with the budget
    max_doc_chars: int = 20_000  # long conversations / files contribute only their head
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    eval_conversations: int = 8  # unseen training-split conversations for greedy agreement


@dataclass
class TrainResult:
    steps: int
    tokens_seen: int
    seconds: float
    final_loss: float  # mean over the last 10 steps
    last_loss: float
    parameters: int


@dataclass
class Corpus:
    chat: torch.Tensor  # [n_chat_tokens] documents joined by <|endoftext|>
    code: torch.Tensor  # [n_code_tokens]
    eval_texts: list
    conversations: int
    code_files: int


# ----------------------------------------------------------------------------- data


def _pool(cfg: BootstrapConfig) -> tuple[list, list]:
    """(training pool, eval conversations), both from the training split only."""
    n = int(min(cfg.max_conversations, max(40, cfg.conversations_per_minute * cfg.minutes)))
    conversations = list(itertools.islice(iter_sharegpt_train(cfg.holdout), n + cfg.eval_conversations))
    pool, evals = conversations[:n], conversations[n:]
    random.Random(cfg.seed).shuffle(pool)
    return pool, evals


def _code_files(cfg: BootstrapConfig) -> list:
    files = [source for _, source in iter_stdlib_code_files(include_tests=False)]
    random.Random(cfg.seed + 1).shuffle(files)
    return files


def train_tokenizer(texts: list, vocab_size: int):
    """Byte-level BPE with the five special tokens at ids 0..4, as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|end|>", pad_token="<|endoftext|>",
        extra_special_tokens=SPECIAL_TOKENS[1:4], chat_template=CHAT_TEMPLATE,
    )


def _tokenize_until(tokenizer, texts: list, target: int, deadline: float, bar) -> tuple[torch.Tensor, int]:
    """Tokenizes texts in batches until `target` tokens or `deadline`; returns (stream, texts used)."""
    ids: list[int] = []
    used = 0
    while used < len(texts) and len(ids) < target and (used == 0 or time.monotonic() < deadline):
        batch = texts[used:used + 32]
        for row in tokenizer(batch, add_special_tokens=False)["input_ids"]:
            ids.extend(row + [PAD_ID])
        used += len(batch)
        bar.update(len(batch))
    return torch.tensor(ids, dtype=torch.long), used


def build_corpus(cfg: BootstrapConfig, deadline: float, progress: bool):
    """Trains the tokenizer and tokenizes chat and code within the data budget."""
    pool, evals = _pool(cfg)
    code = _code_files(cfg)
    cut = cfg.max_doc_chars
    chat_texts = [render_chat(c)[:cut] for c in pool]
    code_texts = [source[:cut] for source in code[: max(20, len(chat_texts) // 4)]]
    tokenizer = train_tokenizer(chat_texts + code_texts, cfg.vocab_size)
    target = int(max(cfg.seq_len * cfg.batch * 4, cfg.chat_tokens_per_minute * cfg.minutes))
    with tqdm(desc="tokenize", unit="doc", disable=not progress, file=sys.stderr) as bar:
        chat, n_chat = _tokenize_until(tokenizer, chat_texts, target, deadline, bar)
        code_stream, n_code = _tokenize_until(  # a little grace: chat may have used the whole deadline
            tokenizer, [s[:cut] for s in code], int(target * cfg.code_per_chat), deadline + 2.0, bar)
    evals = [render_chat(c) for c in evals]
    return tokenizer, Corpus(chat, code_stream, evals, n_chat, n_code)


# ----------------------------------------------------------------------------- models


def make_model(spec: ModelSpec, vocab_size: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=spec.hidden, intermediate_size=spec.mlp,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads, max_position_embeddings=2048, rms_norm_eps=1e-6,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
    )
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = EOS_ID
    model.generation_config.pad_token_id = PAD_ID
    return model


def sample_batch(streams: list, weights: list, batch: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    """Random windows of seq_len + 1 tokens, each from a stream drawn by weight. [batch, seq_len + 1]"""
    choice = torch.multinomial(torch.tensor(weights, dtype=torch.float), batch, replacement=True, generator=gen)
    rows = []
    for i in choice.tolist():
        stream = streams[i]
        if len(stream) <= seq_len + 1:
            stream = stream.repeat(seq_len // max(1, len(stream)) + 2)
        start = int(torch.randint(0, len(stream) - seq_len - 1, (1,), generator=gen))
        rows.append(stream[start:start + seq_len + 1])
    return torch.stack(rows)


def lr_at(step: int, time_fraction: float, peak: float, cfg: BootstrapConfig) -> float:
    """Linear warm-up by steps, then cosine to min_lr_ratio * peak by elapsed wall-clock fraction."""
    warm = min(1.0, (step + 1) / cfg.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, time_fraction)))
    return peak * warm * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def _optimizer(model, spec: ModelSpec, cfg: BootstrapConfig) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=spec.peak_lr, betas=(0.9, 0.95))


def _room_for_another_step(start: float, steps_done: int, seconds: float) -> bool:
    elapsed = time.monotonic() - start
    return elapsed * (steps_done + 1) / steps_done <= seconds


def train_lm(model, spec: ModelSpec, streams: list, weights: list, seconds: float,
             cfg: BootstrapConfig, seed: int, desc: str, progress: bool) -> TrainResult:
    """Next-token cross-entropy on random windows until `seconds` of wall clock have passed."""
    gen = torch.Generator().manual_seed(seed)
    opt = _optimizer(model, spec, cfg)
    model.train()
    losses, step, start = [], 0, time.monotonic()
    with tqdm(total=round(seconds), desc=desc, unit="s", disable=not progress, file=sys.stderr,
              bar_format="{l_bar}{bar}| {n:.0f}/{total_fmt}s {postfix}") as bar:
        while step == 0 or _room_for_another_step(start, step, seconds):
            for group in opt.param_groups:
                group["lr"] = lr_at(step, (time.monotonic() - start) / seconds, spec.peak_lr, cfg)
            window = sample_batch(streams, weights, cfg.batch, cfg.seq_len, gen)
            logits = model(input_ids=window[:, :-1]).logits  # [batch, seq_len, vocab]
            loss = F.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
            step += 1
            bar.n = min(bar.total, round(time.monotonic() - start))
            bar.set_postfix(loss=f"{losses[-1]:.3f}", step=step)
    model.eval()
    tail = losses[-10:]
    return TrainResult(step, step * cfg.batch * cfg.seq_len, round(time.monotonic() - start, 2),
                       round(sum(tail) / len(tail), 4), round(losses[-1], 4), model.num_parameters())


@torch.no_grad()
def greedy_agreement(verifier, drafter, tokenizer, texts: list, max_tokens: int = 256) -> float:
    """Fraction of positions where the drafter's argmax equals the verifier's (teacher-forced)."""
    same = total = 0
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][:, :max_tokens]
        if ids.shape[1] == 0:
            continue
        v = verifier(input_ids=ids).logits.argmax(-1)
        d = drafter(input_ids=ids).logits.argmax(-1)
        same += int((v == d).sum())
        total += ids.numel()
    return same / max(1, total)


# ----------------------------------------------------------------------------- entry points


def _save(model, tokenizer, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)


def _spec_summary(spec: ModelSpec, result: TrainResult) -> dict:
    return {**asdict(spec), **asdict(result)}


def bootstrap_models(cfg: BootstrapConfig, progress: bool = True) -> dict:
    """Trains tokenizer, verifier and drafter into cfg.out_dir; returns (and writes) the summary."""
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    total = cfg.minutes * 60.0
    start = time.monotonic()
    tokenizer, corpus = build_corpus(cfg, start + cfg.data_share * total, progress)
    remaining = max(1.0, total - (time.monotonic() - start) - min(5.0, 0.03 * total))
    v_share = cfg.verifier_share / (1.0 - cfg.data_share)
    vocab = len(tokenizer)
    verifier = make_model(cfg.verifier, vocab, cfg.seed)
    v_result = train_lm(verifier, cfg.verifier, [corpus.chat, corpus.code], [1.0, cfg.code_per_chat],
                        remaining * v_share, cfg, cfg.seed, "verifier", progress)
    remaining = max(1.0, total - (time.monotonic() - start) - min(5.0, 0.03 * total))
    drafter = make_model(cfg.drafter, vocab, cfg.seed + 1)
    d_result = train_lm(drafter, cfg.drafter, [corpus.chat], [1.0], remaining, cfg, cfg.seed + 1,
                        "drafter", progress)
    out = Path(cfg.out_dir)
    _save(verifier, tokenizer, out / "verifier")
    _save(drafter, tokenizer, out / "drafter")
    summary = {
        "seed": cfg.seed, "minutes": cfg.minutes, "vocab_size": vocab, "holdout_conversations": cfg.holdout,
        "seq_len": cfg.seq_len, "batch": cfg.batch,
        "data": {"conversations": corpus.conversations, "chat_tokens": len(corpus.chat),
                 "code_files": corpus.code_files, "code_tokens": len(corpus.code)},
        "verifier": _spec_summary(cfg.verifier, v_result),
        "drafter": _spec_summary(cfg.drafter, d_result),
        "greedy_agreement": round(greedy_agreement(verifier, drafter, tokenizer, corpus.eval_texts), 4),
        "seconds": round(time.monotonic() - start, 2),
    }
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def ensure_models(cache_dir: str | Path, minutes: float = 4.0, seed: int = 0,
                  progress: bool = True, threads: int = 2) -> tuple[Path, Path]:
    """(verifier_dir, drafter_dir): the cached pair if it was trained with `seed`, else a fresh bootstrap."""
    out = Path(cache_dir)
    summary_path = out / SUMMARY_FILE
    dirs = (out / "verifier", out / "drafter")
    if summary_path.exists() and all((d / "config.json").exists() for d in dirs):
        if json.loads(summary_path.read_text()).get("seed") == seed:
            return dirs
    cfg = BootstrapConfig(out_dir=str(out), minutes=minutes, seed=seed, threads=threads)
    bootstrap_models(cfg, progress=progress)
    return dirs
