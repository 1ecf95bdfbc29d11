"""A Llama checkpoint's config.json read without transformers' config classes, where that reading is plain.

`AutoConfig.from_pretrained` of a Llama directory imports transformers' config modules, which pull
torch._dynamo and torch.distributed: ~2.5 s of the ~7.7 s a one-answer `specloop generate` took, before
any weight was read. For what the decoder reads (shapes, norm epsilon, rotary base, token ids, dtype),
a config.json that transformers 5 wrote for a Llama model holds the very values transformers' config
holds: `PlainConfig` serves those from the file and asks transformers for anything else (the whole
config, loaded on first need, with what was set here carried over), so every reader gets
transformers' value either way. `plain_config` returns None, and the caller loads the transformers
config, wherever the file is not that plain case: another model type, a key outside `PLAIN_KEYS` (rope
scaling, sliding windows, quantization, ...), a field missing whose default transformers would fill in,
or a value of an unexpected type.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

# Fields served from the file, with the type a plain value of each has.
SERVED: dict[str, type] = {
    "model_type": str, "hidden_act": str, "hidden_size": int, "intermediate_size": int, "num_hidden_layers": int,
    "num_attention_heads": int, "num_key_value_heads": int, "head_dim": int, "max_position_embeddings": int,
    "vocab_size": int, "rms_norm_eps": float, "tie_word_embeddings": bool, "attention_bias": bool, "mlp_bias": bool,
    "rope_parameters": dict, "dtype": str,
}
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")  # int, a list of ints, or null; absent: None
# Keys that may be in a plain file besides those: none of them changes a value served here (transformers keeps
# them as given, or they describe training).
PLAIN_KEYS = {*SERVED, *TOKEN_IDS, "architectures", "attention_dropout", "initializer_range", "pretraining_tp",
              "transformers_version", "use_cache", "unk_token_id", "_model_name_or_path"}
# What a Llama config has no attribute for (transformers' config raises AttributeError): readers' defaults apply.
ABSENT = frozenset({"text_config", "use_sliding_window", "layer_types", "quantization_config", "sliding_window"})


def plain_config(path: str | Path) -> "PlainConfig | None":
    """The directory's config.json as a PlainConfig, or None where it is not the plain case (module docstring)."""
    try:
        raw = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict) or raw.get("model_type") != "llama" or not raw.keys() <= PLAIN_KEYS:
        return None
    if not all(_typed(raw.get(k), t) for k, t in SERVED.items()):
        return None
    rope = raw["rope_parameters"]
    if rope.keys() != {"rope_type", "rope_theta"} or rope["rope_type"] != "default":
        return None
    if type(rope["rope_theta"]) is not float:  # an int base: transformers' own reading
        return None
    if not hasattr(torch, raw["dtype"]) or not all(_token_ids(raw.get(k)) for k in TOKEN_IDS):
        return None
    return PlainConfig(Path(path), raw)


def _typed(value: Any, kind: type) -> bool:
    """`value` is a `kind` (a bool is not an int here, though Python's bool is one)."""
    return isinstance(value, kind) and (kind is bool or not isinstance(value, bool))


def _token_ids(value: Any) -> bool:
    return value is None or all(_typed(v, int) for v in (value if isinstance(value, list) else [value]))


class PlainConfig:
    """What the decoder reads of a plain Llama config.json (`SERVED`, token ids, `dtype` as a torch dtype), as
    attributes of its own; any other attribute is the transformers config's (`full`, loaded once on first need).
    Attributes set on it are its own, and are set on the full config too."""

    _OWN = ("_path", "_full")  # its own state, not config fields

    def __init__(self, path: Path, raw: dict):
        fields = {k: raw[k] for k in SERVED} | {k: raw.get(k) for k in TOKEN_IDS}
        fields["rope_parameters"] = dict(raw["rope_parameters"])
        fields["dtype"] = getattr(torch, raw["dtype"])
        self.__dict__.update(fields, _path=path, _full=None)

    def __getattr__(self, name: str) -> Any:  # only for names that are not attributes of this object
        if name.startswith("__") or name in ABSENT or name in self._OWN:  # copy/pickle probes; what Llama lacks
            raise AttributeError(name)
        return getattr(self.full, name)

    def __setattr__(self, name: str, value: Any) -> None:
        self.__dict__[name] = value
        if self._full is not None:
            setattr(self._full, name, value)

    @property
    def full(self):
        """The transformers config of the same directory (imported and read now, once), with what was set here."""
        if self._full is None:
            from transformers import AutoConfig

            full = AutoConfig.from_pretrained(self._path)
            for name, value in self._fields().items():
                if getattr(full, name, None) != value:
                    setattr(full, name, value)
            self.__dict__["_full"] = full
        return self._full

    def _fields(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in self._OWN}

    def __repr__(self) -> str:
        return f"PlainConfig({self._path}, {self._fields()})"
