"""Loading verifier and drafter checkpoints from local Hugging Face directories."""
from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from transformers.utils import logging as hf_logging  # noqa: E402

from specloop.drafter.model.architecture import Architecture, StaticRope, check_config, fuse_layer
from specloop.drafter.model.config import plain_config
from specloop.drafter.model.decoder import LeanDecoder
from specloop.drafter.model.weights.groups import open_safetensors

hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()


class ModelError(ValueError):
    """A model directory is missing, unreadable, or incompatible with its partner."""


@dataclass
class LoadedModel:
    path: Path
    lean: LeanDecoder  # the inference decoder: what serving and generating run
    tokenizer: Any  # the transformers tokenizer
    config: Any  # the transformers config
    generation_config: Any  # the transformers generation config (end-of-sequence ids)
    dtype: torch.dtype  # the dtype the checkpoint was loaded in (before `weights` converted the decoder)
    module: torch.nn.Module | None = None  # the transformers module, where load_model kept it (keep_module)

    @property
    def hf(self) -> Any:  # a transformers PreTrainedModel: its submodules and config are read by name
        """The transformers module (training, DVI heads, saving). Where `load_model` did not keep it, it
        is loaded now from the checkpoint (in `dtype`, on the decoder's device) and held from then on:
        a copy of its own, which `lean` does not view (a serving process that builds a DVI head or a
        registry version of a drafter LM pays for it then; one that never asks, never does)."""
        if self.module is None:
            self.module = _load_module(self.path, self.lean.device, self.dtype)
        return self.module

    @property
    def vocab_size(self) -> int:
        return self.lean.vocab_size

    @property
    def served(self) -> str:
        """The weight mode it is served in ("fp32", "int4 (fp32 activations, specloop kernels)", ...): printed wherever
        the model is named."""
        from specloop.drafter.model.weights.modes import describe_mode

        return describe_mode(self.lean)

    @property
    def eos_ids(self) -> frozenset[int]:
        """End-of-sequence ids from the generation config and the tokenizer."""
        ids = self.generation_config.eos_token_id
        ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
        if self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return frozenset(ids)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device, path: str | Path | None = None) -> torch.dtype:
    """The dtype a checkpoint is read in where the caller names none. CPU: fp32 (`weights` converts the
    lean copy to the served mode). CUDA: as stored, so a bf16 checkpoint is served in bf16 there: the
    engine's graph backend (specloop.drafter.model.graph) runs every step at one query width, which makes speculative
    greedy output token-identical to plain decoding in bf16 too; `weights="fp32"` still serves fp32."""
    if torch.device(device).type != "cuda":
        return torch.float32
    from specloop.drafter.model.weights.modes import stored_mode

    return torch.bfloat16 if stored_mode(path) == "bf16" else torch.float32


def _require_dir(path: Path) -> None:
    if not path.is_dir():
        raise ModelError(f"model directory not found: {path}")
    if not (path / "config.json").is_file():
        raise ModelError(f"{path} has no config.json: not a Hugging Face model directory")


def load_tokenizer(path: str | Path):
    path = Path(path)
    _require_dir(path)
    return _tokenizer(path)


def _tokenizer(path: Path):
    """The directory's tokenizer. One whose tokenizer_config.json names the generic `TokenizersBackend`
    (what transformers 5 saves, and what specloop's own directories hold) is built by that class
    directly: the same object AutoTokenizer returns, without the ~90 MiB of modules AutoTokenizer
    imports to resolve it (measured on SmolLM2: 374 → 286 MiB resident)."""
    config = {}
    try:
        config = json.loads((path / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        pass
    if config.get("tokenizer_class") == "TokenizersBackend":
        from transformers import TokenizersBackend

        return TokenizersBackend.from_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def load_model(path: str | Path, device: torch.device | None = None, dtype: torch.dtype | None = None,
               weights: str | None = None, keep_module: bool = False) -> LoadedModel:
    """A checkpoint's lean inference decoder (read in `dtype`), converted to the weight mode `weights`
    (weights.quant: fp32, bf16, int8, int4 or auto = as the checkpoint is stored or its manifest names;
    None leaves it in `dtype`), with its tokenizer and configs.

    keep_module=False (serving, generating): the decoder is streamed from the safetensors files, layer
    by layer, each layer fused and converted as it is read (`_stream_decoder`): the process never holds
    the transformers module nor the whole float model, only the weights it serves (`LoadedModel.hf`
    still loads the module on demand). A checkpoint the stream cannot read (no safetensors, names the
    module would rename) goes through the module, which is then let go.
    keep_module=True (whatever trains or reads the module: the learner, trainer, DVI heads): the
    module (in `dtype`) owns the weights and the decoder is built from it, viewing what it can (q|k|v
    and gate|up are concatenated copies), as it always was.
    Both build the same decoder, bit for bit (tests/drafter/model/test_models.py)."""
    path = Path(path)
    _require_dir(path)
    device = device or default_device()
    dtype = dtype or default_dtype(device, path)
    mode = None
    if weights is not None:
        from specloop.drafter.model.weights.modes import resolve_mode

        mode = resolve_mode(weights, device, path=path)
    config: Any  # the transformers config and generation config
    generation_config: Any
    if keep_module:
        hf = _load_module(path, device, dtype)
        lean = _converted(LeanDecoder(hf), mode, path)
        config, generation_config = hf.config, hf.generation_config
    else:
        hf = None
        streamed = _stream_decoder(path, _load_config(path), device, dtype, mode)
        if streamed is None:
            module = _load_module(path, device, dtype)
            lean = _converted(LeanDecoder(module), mode, path)
            generation_config = module.generation_config
            del module
        else:
            lean = streamed
            generation_config = _generation_config(path)
        config = lean.config
    tokenizer = _tokenizer(path)  # after the weights: its load's temporaries are not on their peak
    if not keep_module:
        _release_freed_memory()
    return LoadedModel(path=path, lean=lean, tokenizer=tokenizer, config=config, generation_config=generation_config,
                       dtype=dtype, module=hf)


def _converted(lean: LeanDecoder, mode: str | None, path: Path, layers=None) -> LeanDecoder:
    if mode is not None:
        from specloop.drafter.model.weights.quant import quantize_decoder

        quantize_decoder(lean, mode, groups=path, layers=layers)  # groups: a GGUF's own int4 groups
    elif layers is not None:
        lean.layers.extend(layers)
    return lean


def _load_module(path: Path, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    try:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(f"cannot load a causal LM from {path}: {exc}") from exc
    # transformers wraps `to` with functools.wraps, whose stub types the bound call as if `device` were `self`
    return hf.to(device).eval()  # type: ignore[arg-type]


def _load_config(path: Path):
    """The directory's config: read plainly where it is a plain Llama config.json (specloop.drafter.model.config:
    the same values, without importing transformers' config modules), else transformers' own."""
    plain = plain_config(path)
    if plain is not None:
        return plain
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(f"cannot load a causal LM from {path}: {exc}") from exc


def _generation_config(path: Path):
    """The generation config `from_pretrained` gives the module: generation_config.json, else the one
    derived from config.json."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(path)
    except OSError:
        return GenerationConfig.from_pretrained(path, config_file_name="config.json", _from_model_config=True)


def _safetensors_files(path: Path) -> list[Path] | None:
    """The checkpoint's safetensors files (one, or the shards its index names), or None."""
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError):
            return None
        return [path / name for name in shards] if all((path / name).is_file() for name in shards) else None
    return None


STREAMED_TYPES = ("llama", "qwen2", "qwen3")  # architectures read without their module (the rest: through it)


def _layer_names(config) -> set[str] | None:
    """A streamed architecture's parameter names within layer i ("self_attn.q_proj.weight", ...), as its
    module names them, or None where the config is not one the stream reads (another model type, or
    biases the decoder has no place for)."""
    kind = config.model_type
    bias = kind == "qwen2" or bool(getattr(config, "attention_bias", False))
    if kind not in STREAMED_TYPES or (bias and kind != "qwen2") or getattr(config, "mlp_bias", False):
        return None
    names = {"input_layernorm.weight", "post_attention_layernorm.weight",
             *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")), *(f"self_attn.{p}_proj.weight" for p in "qkvo")}
    if bias:
        names |= {f"self_attn.{p}_proj.bias" for p in "qkv"}
    if kind == "qwen3":
        names |= {"self_attn.q_norm.weight", "self_attn.k_norm.weight"}
    return names


def _stream_decoder(path: Path, config, device: torch.device, dtype: torch.dtype,
                    mode: str | None) -> LeanDecoder | None:
    """The decoder `_converted(LeanDecoder(module), mode)` would build, read from the safetensors files
    tensor by tensor, without the module nor its modelling code (importing it costs ~130 MB): the
    architecture from the config (`_layer_names`, `StaticRope`), every tensor cast to `dtype` as
    `from_pretrained` casts it, then the LM head and embedding are converted, then each layer is read,
    fused and converted before the next is read (`quantize_decoder(layers=...)`). None where the files
    do not hold exactly the parameters the module has, under its names, or the architecture is not
    one read this way (the caller goes through the module, which knows the rest)."""
    files = _safetensors_files(path)
    if files is None:
        return None
    check_config(config)
    config.dtype = dtype  # as from_pretrained(dtype=...) leaves the module's config
    per_layer = _layer_names(config)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    if per_layer is None:
        return None
    rotary = StaticRope.of_config(config, head_dim)
    if rotary is None:
        return None
    tied = bool(getattr(config, "tie_word_embeddings", True))
    needed = {"model.embed_tokens.weight", "model.norm.weight", *([] if tied else ["lm_head.weight"]),
              *(f"model.layers.{i}.{n}" for i in range(config.num_hidden_layers) for n in per_layer)}
    with ExitStack() as stack:
        try:
            handles = [stack.enter_context(open_safetensors(f)) for f in files]
        except Exception as exc:  # safetensors' own error type is not exported
            raise ModelError(f"cannot read {path}: {exc}") from exc
        where = {name: h for h in handles for name in h.keys()}
        if set(where) - {"lm_head.weight"} != needed - {"lm_head.weight"} or not needed <= where.keys():
            return None

        def read(name: str) -> torch.Tensor:
            return where[name].get_tensor(name).to(dtype).to(device)  # cast on the host, as from_pretrained

        def layer(i: int):
            _release_freed_memory()  # the previous layer's float temporaries
            prefix = f"model.layers.{i}."
            return fuse_layer(lambda name: read(prefix + name) if name in per_layer else None)

        embed = read("model.embed_tokens.weight")
        head = embed if tied else read("lm_head.weight")
        arch = Architecture(config, head_dim, float(head_dim ** -0.5), head.shape[0])
        lean = LeanDecoder.from_parts(arch, embed, read("model.norm.weight"), head, [], rotary)
        del embed, head  # the decoder holds them: converting it lets the float copies go
        _converted(lean, mode, path, layers=(layer(i) for i in range(config.num_hidden_layers)))
    _release_freed_memory()
    return lean


def _release_freed_memory() -> None:
    """Hand the allocator's free pages back to the system (glibc's malloc_trim; a no-op elsewhere).
    Streaming frees a float layer's temporaries (megabytes each) after every layer, and glibc keeps
    such freed blocks in its heaps: on SmolLM2-135M int4 that held 75-95 MB more at the peak of the
    load than the weights needed."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            import ctypes

            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim: Callable[[int], int] | Literal[False] | None = None  # None: not looked up yet; False: none here


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


# ---------------------------------------------------------------- MODEL as `specloop serve` takes it (vLLM-style)

DEFAULT_MAX_POSITIONS = 4096  # what LeanDecoder assumes for a config without max_position_embeddings
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")  # owner/name, as the Hugging Face Hub spells ids


def looks_like_repo_id(model: str | Path) -> bool:
    """`owner/name`: what a Hugging Face model id looks like (a relative path of two parts may too: a directory
    that exists is always taken as one)."""
    text = str(model)
    return bool(_REPO_ID.match(text)) and ".." not in text


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache, read from the environment now (huggingface_hub reads it once, on import):
    HF_HUB_CACHE, else HUGGINGFACE_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(name):
            return Path(os.path.expanduser(os.path.expandvars(os.environ[name])))
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(os.path.expanduser(os.path.expandvars(home))) / "hub"


def resolve_model_dir(model: str | Path) -> Path:
    """MODEL as a model directory, the way `vllm serve MODEL` takes it: an existing directory as given; else
    a Hugging Face model id (`owner/name`) found in the local Hugging Face cache (`hf_cache_dir`), its
    snapshot of the `main` revision; never downloaded here (specloop serves offline). Anything else is
    returned as given, for the loaders to refuse ("model directory not found"). An id that is not in the
    cache: a ModelError naming it and how to get it."""
    path = Path(model)
    if path.is_dir() or not looks_like_repo_id(model):
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    cache = hf_cache_dir()
    try:
        found = snapshot_download(str(model), cache_dir=cache, local_files_only=True)
    except (OSError, ValueError, HFValidationError) as exc:  # LocalEntryNotFoundError is an OSError
        raise ModelError(f"{model} is neither a local directory nor in the local Hugging Face cache ({cache}), and "
                         f"specloop does not download: run `hf download {model}` on a connected machine and copy "
                         "its cache here (or point HF_HUB_CACHE at it), or pass a local model directory") from exc
    assert isinstance(found, str)  # no dry_run: a path
    return Path(found)


@dataclass(frozen=True)
class ContextFacts:
    """What bounds a model's context: the positions its rotary tables cover (`max_position_embeddings`, as
    LeanDecoder reads it) and the bytes its KV cache takes per position of one slot (every layer's keys
    and values, in the cache's dtype)."""

    max_positions: int
    kv_bytes_per_position: int


def context_facts(path: str | Path, kv_cache_dtype: str = "auto", gpu: bool = False) -> ContextFacts:
    """A model directory's ContextFacts, read from its config.json (a GGUF model `specloop models fetch`
    converted has the one transformers wrote from the GGUF's metadata): no weights are read. The cache's
    dtype as the workers choose it (`attention.kv_dtype`): `kv_cache_dtype` where it names one (float32,
    bfloat16), else fp32 on a CPU and, on a GPU (`gpu`), the checkpoint's own 16-bit dtype."""
    from specloop.drafter.model.attention import KV_DTYPE, KV_DTYPES

    path = Path(path)
    _require_dir(path)
    config = _load_config(path)
    config = getattr(config, "text_config", None) or config  # a multimodal config's language model
    positions = int(getattr(config, "max_position_embeddings", None) or DEFAULT_MAX_POSITIONS)
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    named = KV_DTYPES[kv_cache_dtype]
    stored = str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "")
    size = named.itemsize if named is not None else 2 if gpu and stored.endswith("float16") else KV_DTYPE.itemsize
    per_position = int(config.num_hidden_layers) * 2 * kv_heads * head_dim * size
    return ContextFacts(positions, per_position)
