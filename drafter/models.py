"""Loading verifier and drafter checkpoints from local Hugging Face directories."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from drafter.decoder import LeanDecoder  # noqa: E402

hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()


class ModelError(ValueError):
    """A model directory is missing, unreadable, or incompatible with its partner."""


@dataclass
class LoadedModel:
    path: Path
    hf: torch.nn.Module  # the transformers module: owns the weights
    lean: LeanDecoder  # fast inference view of the same weights
    tokenizer: object

    @property
    def vocab_size(self) -> int:
        return self.lean.vocab_size

    @property
    def eos_ids(self) -> frozenset[int]:
        """End-of-sequence ids from the generation config and the tokenizer."""
        ids = self.hf.generation_config.eos_token_id
        ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
        if self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return frozenset(ids)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    """fp32: on CUDA too, where bf16 verify passes are not token-identical to one-token decoding
    (bench/README.md section 7); a lean copy can still be converted with `weights`."""
    return torch.float32


def _require_dir(path: Path) -> None:
    if not path.is_dir():
        raise ModelError(f"model directory not found: {path}")
    if not (path / "config.json").is_file():
        raise ModelError(f"{path} has no config.json: not a Hugging Face model directory")


def load_tokenizer(path: str | Path):
    path = Path(path)
    _require_dir(path)
    return AutoTokenizer.from_pretrained(path)


def load_model(path: str | Path, device: torch.device | None = None, dtype: torch.dtype | None = None,
               weights: str | None = None) -> LoadedModel:
    """The Hugging Face model (in `dtype`: it owns the weights, the learner trains it) and its lean
    inference view, converted to the weight mode `weights` (drafter.quant: fp32, bf16, int8, int4 or
    auto; None leaves it in `dtype`)."""
    path = Path(path)
    _require_dir(path)
    device = device or default_device()
    dtype = dtype or default_dtype(device)
    try:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(f"cannot load a causal LM from {path}: {exc}") from exc
    hf.to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    lean = LeanDecoder(hf)
    if weights is not None:
        from drafter.quant import quantize_decoder, resolve_mode

        quantize_decoder(lean, resolve_mode(weights, device))
    return LoadedModel(path=path, hf=hf, lean=lean, tokenizer=tokenizer)


def check_same_vocabulary(verifier: LoadedModel, drafter: LoadedModel) -> None:
    """Speculative decoding compares token ids: both models must use one vocabulary."""
    vv, dv = verifier.tokenizer.get_vocab(), drafter.tokenizer.get_vocab()
    if vv != dv:
        only = len(set(vv.items()) ^ set(dv.items()))
        raise ModelError(
            f"verifier {verifier.path} and drafter {drafter.path} use different vocabularies "
            f"({len(vv)} vs {len(dv)} tokens, {only} entries differ)"
        )
    if verifier.vocab_size != drafter.vocab_size:
        raise ModelError(
            f"verifier LM head has {verifier.vocab_size} rows, drafter {drafter.vocab_size}: "
            "logits must cover the same vocabulary"
        )
