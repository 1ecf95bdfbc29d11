"""Builders for tiny models and tokenizers used by the tests (no downloads)."""
from __future__ import annotations

from pathlib import Path

import torch

from specloop.trainer.bootstrap import train_tokenizer

TEXT = [
    "def main():\n    print('hello world')\n    return 0\n",
    "The quick brown fox jumps over the lazy dog. A hash table maps keys to values.",
    "Sure, here is an example of how you could write a function in Python.",
    "import os\nimport sys\n\nclass Config:\n    def __init__(self, path):\n        self.path = path\n",
]

# 12 two-turn chats cut from TEXT: the conversations of the offline-training and generated-data tests
CONVERSATIONS = [
    [{"role": "user", "content": TEXT[i % 4][: 20 + 7 * i]}, {"role": "assistant", "content": TEXT[(i + 1) % 4]}]
    for i in range(12)
]


def make_tokenizer(out: Path, vocab_size: int = 320):
    """The bootstrap's byte-level BPE (same special tokens and chat template), trained on TEXT."""
    tok = train_tokenizer(TEXT * 4, vocab_size)
    tok.save_pretrained(out)
    return tok


def llama_config(vocab: int, layers: int, hidden: int, arch: str = "llama", **extra):
    from transformers import AutoConfig

    base = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        eos_token_id=4,
        pad_token_id=0,
        bos_token_id=None,
    )
    base.update(extra)
    return AutoConfig.for_model(arch, **base)


def build_model(config, seed: int, init_std: float = 0.02):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config.initializer_range = init_std
    return AutoModelForCausalLM.from_config(config).eval()


def make_model(out: Path, tok, layers: int, hidden: int, seed: int, arch: str = "llama", init_std: float = 0.02):
    model = build_model(llama_config(len(tok), layers, hidden, arch), seed, init_std)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def make_pair(root: Path, verifier_layers: int = 3, verifier_hidden: int = 64, init_std: float = 0.02):
    """(verifier_dir, drafter_dir) under `root`: a verifier (seed 1) and a 1-layer, 32-wide drafter (seed 2)
    sharing one tokenizer; a larger `init_std` makes both peakier (sharper distributions)."""
    tok = make_tokenizer(root / "tokenizer")
    verifier = make_model(root / "verifier", tok, layers=verifier_layers, hidden=verifier_hidden, seed=1,
                          init_std=init_std)
    drafter = make_model(root / "drafter", tok, layers=1, hidden=32, seed=2, init_std=init_std)
    return verifier, drafter


class CountingDecode:
    """A decode callable that counts the tokens it is given (work bounds, not wall time)."""

    def __init__(self, decode):
        self.decode, self.tokens = decode, 0

    def __call__(self, ids):
        self.tokens += len(ids)
        return self.decode(ids)
