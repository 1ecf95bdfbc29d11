"""Benchmark: the engine's graph backend (drafter/model/graph.py) on a lent GPU, in one call.

Random bf16 weights of real shapes (SmolLM2-135M, SmolLM2-1.7B, Llama-3.1-8B), built on the device from
their shapes alone (LeanDecoder.from_parts: no files, no transformers module), 512 cached tokens:
- steps (batch 1) and batches (8, 32): the graph step (GraphDecoder.forward, T = 1 at width W = 5)
  and its bare replay (the compiled step on prepared device inputs: the step without the wrapper's
  host work), and the eager LeanDecoder's one-token step (the old path): ms, tokens/s, fraction of the
  HBM roofline = weight bytes / step time / peak bandwidth (also with the KV the step reads, in the model's dtype);
- kernels (batch 1 and the largest batch): the compiled step launched kernel by kernel under torch.profiler:
  kernels per step and per layer, device µs by kind (GEMMs, attention, copies, fused pointwise) and the top
  kernels, the GEMMs' bytes per second: where a layer's ~90 µs go (section 25: ~30 µs of it its weights);
- products (W rows and W · the largest batch): each weight product of a layer and the head, cuBLAS against
  the skinny Triton product (drafter/model/skinny_linear.py) at its own tiling and a sweep around it, µs and
  bytes/s, each in a CUDA graph over weights L2 cannot hold; the fastest tilings go to <out>.tiles.json;
- paths (batch 1 and the largest batch): the step run the other ways (PATHS: cudagraph trees, other attentions,
  tuned GEMMs, the skinny products at their own and at section products' fastest tilings) beside the default;
- long (batch 1): the same cached tokens in a pool of --long-capacity positions (4,096), each attention of LONG:
  what a server sized for long requests costs a short row (the torch and sdpa attentions read the whole
  capacity, the Triton kernel a row's own keys);
- drafter: a 135M-shaped drafter LM's step (width 2, last position only) at each batch: c = its cost
  over the 1.7B and 8B steps (shapes.ratios);
- inexact: the graph step at W = 1 (the narrowest, whose shapes differ from a verify pass's) at each batch:
  W = 5's cost over it (shapes.ratios.w5_over_w1) is what exactness by construction costs;
- verify: v_T = cost(T) / cost(1), T = 1..8, batch 1: eager, and the graph step at W = 9 (flat by
  construction);
- compile: the step's first two calls (cold: first compile, then CUDA graph capture), a second decoder
  in the same process (re-recorded, not recompiled), one after torch._dynamo.reset() (inductor's caches
  warm: a restarted worker);
- anchor: plain transformers (AutoModelForCausalLM.from_config, StaticCache, torch.compile
  mode="reduce-overhead", fullgraph) one-token decode at batch 1, same shapes and context; a failure
  (transformers API drift) is recorded, not raised.
- pair (with --models): the reference pair end to end through specloop.drafter.decode.engine.generate, greedy, 64 new
  tokens, batch 1 and 8: the verifier alone (graph and eager backends), and the pretrained, n-gram and
  eagle (untrained head: cost only) drafters at k = auto and k = 4 on the graph backend: tokens/s
  (median over alternating rounds after a warm-up pass that compiles; a k-auto system keeps one controller
  over all of them, as a server's engine does: --fresh-controllers for one per batch), τ = 1 + accepted / blocks, and
  greedy output identical to the graph verifier alone (prompts identical on every pass / prompts); on a GPU also
  the verifier alone, n-gram k = 4 and the served default with the skinny products, each against the
  verifier alone on that path.
  Prompts: the first 8 of chat_dev.jsonl and of code_dev.jsonl whose engines share one pool shape
  (`one_pool`; --any-length: the first 8 whatever their length, one compile per pool shape).
- sampling (bench/gpu_sampling.py): at T = 1 and T = 0.7 / top-p 0.9, speculative output (pretrained k = 2,
  n-gram k = 3) against the same engine's plain sampling, tiny shapes in bf16 on the graph backend, 20,000 answers
  an arm: a two-sample chi-square per position (Bonferroni), and a sampler with the dropped-residual bug, which
  the test must catch (its power).

Sections run in --sections order (default: most valuable first) under --budget-s: a step that would
not fit is recorded as "skipped: budget". The JSON is rewritten after every step (a killed run leaves
what it measured), the PNG beside it after every section. Every timing row names the device, torch
version and dtype.

    # the GPU machine (one call, ~7 minutes; a bare machine: cold compiles):
    PYTHONPATH=. python bench/gpu.py --models ../shared/models --prompts ../shared/prompts --out $OUT/gpu.json
    # here, on the CPU: tiny shapes, every section's code path (compile off: ~2 minutes)
    SPECLOOP_COMPILE=0 PYTHONPATH=. .venv/bin/python bench/gpu.py --smoke --models ../shared/models \
        --prompts ../shared/prompts --out /tmp/gpu_smoke/gpu.json
"""
from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.runs import scoped_env  # noqa: E402
from specloop.drafter.model.architecture import Architecture, StaticRope, fuse_layer
from specloop.drafter.model.attention import KEY_BLOCK  # noqa: E402
from specloop.drafter.model.decoder import LeanDecoder
from specloop.drafter.model.graph import GraphDecoder, pool_shape  # noqa: E402

# in the default order: what matters most first, so that a budget cut loses the least
SECTIONS = ("steps", "kernels", "pair", "products", "paths", "long", "batches", "inexact", "drafter", "verify",
            "compile", "anchor", "sampling")
# the step's other ways of running (section paths), each against the default (direct CUDA graphs, torch's
# attention): as environment settings read when a GraphDecoder is built
PATHS = {"trees-torch": {"SPECLOOP_CUDA_GRAPHS": "trees", "SPECLOOP_ATTENTION": "torch"},  # the last session's step
         # section 25's default: the cache in fp32 whatever the model's dtype (the default now: the model's dtype)
         "direct-kv32": {"SPECLOOP_CUDA_GRAPHS": "direct", "SPECLOOP_KV_CACHE_DTYPE": "float32"},
         # one memory-efficient attention kernel per layer for the torch path's two products and ~3 kernels
         "direct-sdpa": {"SPECLOOP_CUDA_GRAPHS": "direct", "SPECLOOP_ATTENTION": "sdpa"},
         "direct-flex": {"SPECLOOP_CUDA_GRAPHS": "direct", "SPECLOOP_ATTENTION": "flex"},  # flex decoding's split keys
         # each row's own keys, split across programs (one program per row and KV head lost on an H200)
         "direct-triton": {"SPECLOOP_CUDA_GRAPHS": "direct", "SPECLOOP_ATTENTION": "triton"},
         # the weight products through drafter/model/skinny_linear.py's kernel: its own tiling, the fastest tiling
         # section products timed (TILES_FROM_PRODUCTS: filled in at run time), and with the Triton attention
         "direct-skinny": {"SPECLOOP_CUDA_GRAPHS": "direct", "SPECLOOP_LINEAR": "skinny"},
         "direct-skinny-tuned": {"SPECLOOP_CUDA_GRAPHS": "direct", "SPECLOOP_LINEAR": "skinny",
                                 "SPECLOOP_SKINNY_TILES": "TILES_FROM_PRODUCTS"},
         "direct-skinny-triton": {"SPECLOOP_CUDA_GRAPHS": "direct", "SPECLOOP_LINEAR": "skinny",
                                  "SPECLOOP_ATTENTION": "triton"},
         "direct-autotune": {"SPECLOOP_CUDA_GRAPHS": "direct", "SPECLOOP_AUTOTUNE": "1"}}  # slow to compile: last
# section long: the attentions whose cost may grow with the pool's capacity (torch, sdpa: the whole capacity,
# masked; flex: every block, masked) against one that reads each row's own keys (triton)
LONG = ("direct-torch", "direct-sdpa", "direct-flex", "direct-triton")
ANCHOR_FIRST = "smollm2-1.7b"  # the shape the issue's ≥ 1.2× transformers target names
DRAFTER = "smollm2-135m"  # the shape whose width-2 step is the drafter's in c = drafter / verifier


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    rope_theta: float = 10000.0


SHAPES = {
    "smollm2-135m": Shape(576, 30, 9, 3, 64, 1536, 49152, True, 100000.0),
    "smollm2-1.7b": Shape(2048, 24, 32, 32, 64, 8192, 49152, True, 130000.0),
    "llama-3.1-8b": Shape(4096, 32, 32, 8, 128, 14336, 128256, False, 500000.0),
}
SMOKE_SHAPES = {  # the same names, tiny: the code path of every section on the CPU
    "smollm2-135m": Shape(64, 2, 4, 2, 16, 128, 512, True),
    "smollm2-1.7b": Shape(96, 2, 6, 6, 16, 192, 512, True),
    "llama-3.1-8b": Shape(128, 3, 8, 2, 16, 256, 512, False, 500000.0),
}


@dataclass
class Plan:
    """What to measure; `--smoke` shrinks every size."""

    device: torch.device
    dtype: torch.dtype
    shapes: dict[str, Shape]
    batches: tuple[int, ...] = (1, 8, 32)
    context: int = 512
    long_capacity: int = 4096  # section long: the same cached tokens in a pool sized for long requests
    width: int = 5  # the engine's W = k_max + 1
    verify_width: int = 9  # the graph step that v_T is read from (T = 1..8)
    drafter_width: int = 2  # a pretrained drafter's LM (PretrainedDrafter.graph_width)
    verify_tokens: tuple[int, ...] = tuple(range(1, 9))
    repeats: int = 30
    warmup: int = 5
    pair_batches: tuple[int, ...] = (1, 8)
    per_file: int = 8  # prompts from each of chat_dev.jsonl and code_dev.jsonl
    max_tokens: int = 64
    rounds: int = 3
    one_pool: bool = True  # pair: only prompts whose engines share one pool shape (`one_pool`)
    pool_prompt: int = 96
    compiled: bool = True  # SPECLOOP_COMPILE=0: the static step runs uncompiled
    compile_guess_s: float = 60.0  # a first compile's cost before one was seen
    paths: tuple[str, ...] = tuple(PATHS)  # sections paths and long: the step's other ways run (--paths)
    tiles: Path | None = None  # section products' fastest tilings (JSON), which path direct-skinny-tuned runs
    product_replays: int = 20  # section products: products a CUDA graph holds, back to back

    @property
    def capacity(self) -> int:
        return self.context + 16  # the cached tokens + room for the widest pass (T <= 9)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


# -- clocks and the budget


class Clock:
    """CUDA events on a GPU (each repeat synchronized: host gaps count, as in the engine's steps,
    which read their verdict back every step); time.perf_counter on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def seconds(self, fn) -> float:
        """One call's wall time (first calls: tracing, compiling, CUDA graph capture)."""
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - t0

    def ms(self, fn, repeats: int, warmup: int, before=None) -> list[float]:
        for _ in range(warmup):
            if before:
                before()
            fn()
        self.sync()
        times = []
        for _ in range(repeats):
            if before:
                before()
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return times


class Budget:
    def __init__(self, seconds: float):
        self.t0, self.seconds = time.perf_counter(), seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return self.seconds - self.elapsed()

    def allows(self, need_s: float = 0.0) -> bool:
        return self.left() > need_s

    def say(self, message: str) -> None:
        print(f"[{self.elapsed():6.1f}s] {message}", flush=True)


def summary(times_ms: list[float]) -> dict:
    return {"ms": statistics.median(times_ms), "ms_min": min(times_ms), "ms_max": max(times_ms),
            "repeats": len(times_ms)}


# -- the report


class Report:
    """The JSON (rewritten after every step) and its PNG (after every section)."""

    def __init__(self, path: Path, header: dict, peak: float | None):
        self.path, self.peak = path, peak
        self.tag = {"device": header["device"], "torch": header["torch"], "dtype": header["dtype"]}
        self.data = header | {"sections": {}, "rows": []}

    def section(self, name: str) -> dict:
        return self.data["sections"].setdefault(name, {})

    def row(self, **fields) -> dict:
        """A timing row: the device, torch version and dtype, then `fields`; derived rates where known."""
        row = self.tag | fields
        if "ms" in row and row.get("batch"):
            row["tokens_per_s"] = row["batch"] / (row["ms"] / 1e3)
        for key, nbytes in (("hbm_fraction", row.get("weight_bytes")),
                            ("hbm_fraction_with_kv", row.get("bytes_moved"))):
            if self.peak and nbytes and "ms" in row:
                row[key] = nbytes / (row["ms"] / 1e3) / self.peak
        self.data["rows"].append(row)
        return row

    def rows(self, **match) -> list[dict]:
        return [r for r in self.data["rows"] if all(r.get(k) == v for k, v in match.items())]

    def save(self, plot: bool = False) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, separators=(",", ":"), default=str) + "\n")
        if plot:
            try:
                _plot(self.data, self.path.with_suffix(".png"))
            except Exception as exc:  # a plot never costs the numbers
                print(f"plot failed: {type(exc).__name__}: {exc}", flush=True)


def attempt(out: dict, key: str, budget: Budget, need_s: float, fn, report: Report):
    """out[key] = fn() when the budget allows need_s more seconds; a failure is recorded, not raised."""
    if not budget.allows(need_s):
        out[key] = "skipped: budget"
        budget.say(f"{key}: skipped (budget: {budget.left():.0f} s left, ~{need_s:.0f} s needed)")
        report.save()
        return None
    try:
        out[key] = fn()
    except torch.OutOfMemoryError as exc:
        out[key] = {"error": f"out of memory: {str(exc)[:300]}"}
        budget.say(f"{key}: out of memory")
        free_memory()
    except Exception as exc:
        out[key] = {"error": f"{type(exc).__name__}: {str(exc)[:2000]}"}
        budget.say(f"{key}: FAILED {type(exc).__name__}: {str(exc)[:300]}")
        traceback.print_exc()
    report.save()
    return out[key]


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def compile_state() -> dict:
    """Dynamo's and inductor's counters (graphs compiled, CUDA graphs skipped) and the CUDA graph
    tree's recordings: how many graphs a section left behind."""
    from torch._dynamo.utils import counters

    state = {"unique_graphs": counters["stats"]["unique_graphs"],
             "cudagraph_skips": counters["inductor"]["cudagraph_skips"]}
    if torch.cuda.is_available():
        try:
            from torch._inductor import cudagraph_trees

            tree = cudagraph_trees.get_container(torch.cuda.current_device()).tree_manager
            if tree is not None:
                state["cudagraph_root_recordings"] = sum(len(nodes) for nodes in tree.roots.values())
                state["cudagraph_rerecords"] = sum(sum(d.values()) for d in tree.num_rerecord.values())
        except Exception as exc:  # private API: its names move between torch versions
            state["cudagraph_tree"] = f"unreadable: {type(exc).__name__}"
    return state


# -- section 1: real shapes, random weights


def llama_config(shape: Shape, max_positions: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                       num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                       num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim, hidden_act="silu",
                       max_position_embeddings=max_positions, rms_norm_eps=1e-5, tie_word_embeddings=shape.tied,
                       rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta})


def build_lean(shape: Shape, plan: Plan, std: float = 0.02, seed: int | None = None) -> tuple[LeanDecoder, int]:
    """A LeanDecoder of `shape` over random weights N(0, std) made on the device (no module, no file; `seed`:
    the same weights on every run), and its parameter count (the embedding once where tied)."""
    dev, dt, h, D = plan.device, plan.dtype, shape.hidden, shape.head_dim
    gen = None if seed is None else torch.Generator(dev).manual_seed(seed)
    rand = lambda *size: torch.empty(size, device=dev, dtype=dt).normal_(0.0, std, generator=gen)  # noqa: E731
    ones = lambda n: torch.ones(n, device=dev, dtype=dt)  # noqa: E731
    count = 0

    def layer():
        nonlocal count
        H, Hkv, I = shape.heads * D, shape.kv_heads * D, shape.intermediate  # noqa: E741
        w = {"input_layernorm.weight": ones(h), "post_attention_layernorm.weight": ones(h),
             "self_attn.q_proj.weight": rand(H, h), "self_attn.k_proj.weight": rand(Hkv, h),
             "self_attn.v_proj.weight": rand(Hkv, h), "self_attn.o_proj.weight": rand(h, H),
             "mlp.gate_proj.weight": rand(I, h), "mlp.up_proj.weight": rand(I, h), "mlp.down_proj.weight": rand(h, I)}
        count += sum(t.numel() for t in w.values())
        return fuse_layer(w.get)

    max_positions = plan.capacity + KEY_BLOCK
    config = llama_config(shape, max_positions)
    embed = rand(shape.vocab, h)
    head = embed if shape.tied else rand(shape.vocab, h)
    layers = [layer() for _ in range(shape.layers)]
    count += embed.numel() + (0 if shape.tied else head.numel()) + h  # + the final norm
    rope = StaticRope(1.0 / (shape.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float) / D)), 1.0)
    arch = Architecture(config, D, D ** -0.5, shape.vocab)
    return LeanDecoder.from_parts(arch, embed, ones(h), head, layers, rope, max_positions), count


@dataclass
class ModelBytes:
    weights: int  # parameter count × 2 (the roofline's bytes)
    streamed: int  # what a step reads of them: all but an untied embedding table (a gather)
    kv_per_row: int  # the KV a graph step attends per pool row: the pool's whole capacity, in the cache's dtype

    def moved(self, batch: int) -> int:
        return self.streamed + batch * self.kv_per_row


def model_bytes(shape: Shape, params: int, lean: LeanDecoder, plan: Plan) -> ModelBytes:
    _, n_kv, C, D = pool_shape(1, plan.capacity, lean)
    embed = 0 if shape.tied else shape.vocab * shape.hidden * 2
    return ModelBytes(2 * params, 2 * params - embed, 2 * shape.layers * n_kv * C * D * lean.kv_dtype.itemsize)


class StepBench:
    """The timings of one model: graph steps, eager steps, verify passes, compile times."""

    def __init__(self, name: str, lean: LeanDecoder, nbytes: ModelBytes, plan: Plan, clock: Clock, report: Report,
                 budget: Budget, compiles: list[float]):
        self.name, self.lean, self.bytes, self.plan = name, lean, nbytes, plan
        self.clock, self.report, self.budget = clock, report, budget
        self.compile_s: float | None = None  # this model's first compile (its first two calls)
        self.compiles = compiles  # every new step's first call, all models: the estimate for the next one

    def tokens(self, batch: int, T: int) -> torch.Tensor:
        return torch.randint(0, self.lean.vocab_size, (batch, T), device=self.plan.device)

    def need(self) -> float:
        """Seconds a step with a new compile may take: the longest first call so far (a cache hit makes
        some short), else a guess."""
        if not self.plan.compiled:
            return 0.0
        return 1.2 * max(self.compiles) if self.compiles else self.plan.compile_guess_s

    def graph_decoder(self, batch: int, width: int, capacity: int | None = None):
        graph = GraphDecoder(self.lean, batch, width, compiled=self.plan.compiled)
        cache = graph.new_cache(batch, capacity or self.plan.capacity)
        return graph, cache

    def _at_context(self, cache, batch: int):
        lens = torch.full((batch,), self.plan.context, dtype=torch.long)
        return lambda: setattr(cache, "lens", lens.clone())  # a step advances lens: every repeat starts at 512

    def first_calls(self, call, reset) -> dict:
        reset()
        first = self.clock.seconds(call)
        reset()
        second = self.clock.seconds(call)
        if self.plan.compiled:
            self.compiles.append(first)
            if self.compile_s is None:
                self.compile_s = first + second
        return {"first_call_s": first, "second_call_s": second}

    def graph_step(self, batch: int, width: int, last_only: bool = False, path: str = "graph",
                   capacity: int | None = None) -> dict:
        """GraphDecoder.forward of one token per row (the engine's plain step: W − 1 padded queries), then
        the compiled step alone on prepared device inputs; `capacity`: the pool's positions (default: the
        plan's, the cached tokens and room for one pass)."""
        graph, cache = self.graph_decoder(batch, width, capacity)
        reset, tokens = self._at_context(cache, batch), self.tokens(batch, 1)
        call = lambda: graph.forward(cache, tokens, last_only=last_only)  # noqa: E731
        calls = self.first_calls(call, reset)
        p = self.plan
        row = self.report.row(section="shapes", model=self.name, path=path, batch=batch, width=width, T=1,
                              **summary(self.clock.ms(call, p.repeats, p.warmup, reset)), **calls,
                              weight_bytes=self.bytes.weights, bytes_moved=self.bytes.moved(batch),
                              graph_calls=graph.graph_calls, pool_positions=cache.keys[0].shape[2])
        replay = self.report.row(section="shapes", model=self.name, path=path + "-replay", batch=batch, width=width,
                                 T=1, **summary(self.clock.ms(self._replay(graph, cache, batch, last_only),
                                                              p.repeats, p.warmup)),
                                 weight_bytes=self.bytes.weights, bytes_moved=self.bytes.moved(batch))
        self.budget.say(f"{self.name} {path} W={width} B={batch}: {row['ms']:.3f} ms/step "
                        f"({row['tokens_per_s']:.0f} tok/s{_fraction(row)}), replay {replay['ms']:.3f} ms; "
                        f"first calls {calls['first_call_s']:.1f} + "
                        f"{calls['second_call_s']:.1f} s")
        return {"step": row, "replay": replay}

    def _replay(self, graph: GraphDecoder, cache, batch: int, last_only: bool):
        """The compiled step on inputs already on the device, called as GraphDecoder.forward calls it."""
        S, W, dev = graph.slots, graph.width, self.plan.device
        keys, values = graph._pool(cache)
        tokens = torch.zeros(S, W, dtype=torch.long, device=dev)
        n_new = torch.zeros(S, dtype=torch.long, device=dev)
        n_new[:batch] = 1
        lens = torch.full((S,), self.plan.context, dtype=torch.long, device=dev)

        if graph.direct:  # the captured graph on inputs already in its buffers
            with torch.inference_mode():
                captured = graph._captured((keys, values), (), last_only, None)
                captured.tokens.zero_()
                captured.meta[0].copy_(n_new)
                captured.meta[1].copy_(lens)
            return captured.replay

        def call():
            with torch.inference_mode():
                graph.step_fn(keys, values, tokens, n_new, lens, None, (), last_only)

        return call

    def eager_step(self, batch: int, T: int = 1, path: str = "eager") -> dict:
        cache = self.lean.new_cache(batch, self.plan.capacity)
        reset, tokens = self._at_context(cache, batch), self.tokens(batch, T)
        call = lambda: self.lean.forward(cache, tokens)  # noqa: E731
        row = self.report.row(section="shapes", model=self.name, path=path, batch=batch, width=T, T=T,
                              **summary(self.clock.ms(call, self.plan.repeats, self.plan.warmup, reset)),
                              weight_bytes=self.bytes.weights)
        if T == 1:
            self.budget.say(f"{self.name} {path} B={batch}: {row['ms']:.3f} ms/step ({row['tokens_per_s']:.0f} tok/s"
                            f"{_fraction(row)})")
        return row

    def verify_costs(self, batch: int = 1) -> dict:
        """v_T = cost(T) / cost(1), T = 1..8: the eager decoder, and the graph step at W = 9."""
        p = self.plan
        eager = {T: self.eager_step(batch, T, "eager-verify")["ms"] for T in p.verify_tokens}
        graph, cache = self.graph_decoder(batch, p.verify_width)
        reset = self._at_context(cache, batch)
        calls = self.first_calls(lambda: graph.forward(cache, self.tokens(batch, 1)), reset)
        wide = {}
        for T in p.verify_tokens:
            tokens = self.tokens(batch, T)
            times = self.clock.ms(lambda: graph.forward(cache, tokens), p.repeats, p.warmup, reset)
            wide[T] = self.report.row(section="shapes", model=self.name, path="graph-verify", batch=batch,
                                      width=p.verify_width, T=T, **summary(times))["ms"]
        out = {"batch": batch, "eager_ms": eager, "graph_w9_ms": wide, "graph_w9_first_calls": calls,
               "v_T_eager": {T: eager[T] / eager[1] for T in eager},
               "v_T_graph_w9": {T: wide[T] / wide[1] for T in wide},
               "graph_w9_over_eager_t1": wide[1] / eager[1]}
        self.budget.say(f"{self.name} v_T eager " + " ".join(f"{v:.2f}" for v in out["v_T_eager"].values())
                        + " | graph W=9 " + " ".join(f"{v:.2f}" for v in out["v_T_graph_w9"].values()))
        return out

    def kernel_profile(self, batch: int, width: int, steps: int = 20) -> dict:
        """The compiled step launched kernel by kernel (no CUDA graph: the same kernels, their device times
        apart) under torch.profiler for `steps` steps: each kernel's device time, grouped by kind
        (`kernel_table`), beside the step's replayed time in section steps. Where the replay takes longer than
        its kernels' sum, the gaps between kernels (launch latency inside the graph) are the cost; where the
        sum is most of it, the kernels themselves (the GEMMs' bandwidth)."""
        from torch.profiler import ProfilerActivity, profile

        graph = GraphDecoder(self.lean, batch, width, compiled=self.plan.compiled, direct=False)
        cache = graph.new_cache(batch, self.plan.capacity)
        call = self._replay(graph, cache, batch, last_only=False)
        for _ in range(3):  # compile (a cache hit after section steps) and warm
            call()
        self.clock.sync()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.plan.cuda else [])
        with profile(activities=activities) as prof:
            for _ in range(steps):
                call()
            self.clock.sync()
        out = kernel_table(profile_events(prof, self.plan.cuda), steps, self.lean.num_layers)
        out.update(model=self.name, batch=batch, width=width, device=self.report.tag["device"],
                   streamed_bytes=self.bytes.streamed, kv_bytes=batch * self.bytes.kv_per_row)
        gemm_us = out["by_kind"].get("gemm", {}).get("us_per_step")
        if gemm_us:  # the weights' bytes over the GEMMs' own time: how near the roofline the products run
            out["gemm_bytes_per_s"] = self.bytes.streamed / (gemm_us / 1e6)
        self.budget.say(f"{self.name} kernels B={batch} W={width}: {out['kernels_per_step']:.0f} a step "
                        f"({out['kernels_per_layer']:.1f} a layer), {out['device_us_per_step']:.0f} µs of device "
                        "time: " + ", ".join(f"{k} {v['count_per_step']:.0f} × {v['us_per_step']:.0f} µs"
                                             for k, v in out["by_kind"].items()))
        return out

    def compile_times(self) -> dict:
        """The step at W = 5, batch 1: its cold compile (the model's first, from steps), a decoder compiled
        in this process since the last reset, a second decoder on the same shapes (new pool and static
        addresses: a CUDA graph re-recorded, nothing recompiled), and one after torch._dynamo.reset()
        (dynamo traces again; inductor's FX graph and kernel caches are warm: a restarted worker)."""
        out = {"cold": {"first_calls_s": self.compile_s}}
        for key, reset_dynamo in (("in_process", False), ("same_process_new_decoder", False),
                                  ("warm_after_dynamo_reset", True)):
            if reset_dynamo:
                torch._dynamo.reset()
            graph, cache = self.graph_decoder(1, self.plan.width)
            out[key] = self.first_calls(lambda: graph.forward(cache, self.tokens(1, 1)), self._at_context(cache, 1))  # noqa: F821 - deleted after the last use (ruff reads the del as unbinding it)
            del graph, cache
        self.budget.say(f"{self.name} compile: cold {_s(self.compile_s)}, new decoder "
                        f"{_s(out['same_process_new_decoder']['first_call_s'])}, warm after reset "
                        f"{_s(out['warm_after_dynamo_reset']['first_call_s'])}")
        return out


# kernel kinds by name (cuBLAS / CUTLASS / inductor's Triton kernels, by what their names say); the first match wins
KERNEL_KINDS = (("gemm", ("gemm", "gemv", "cutlass", "nvjet", "sm90_", "sm100_", "cublas", "addmm", "aten::mm",
                          "aten::bmm", "aten::linear", "aten::addmm", "aten::matmul")),
                ("attention", ("fmha", "flash", "attention", "attn", "decode_attention", "_partial", "_combine")),
                ("copy", ("copy", "memcpy", "memset", "scatter", "index", "aten::cat")),
                ("fused", ("triton_", "fused", "cpp_", "kernel")))


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, marks in KERNEL_KINDS if any(m in low for m in marks)), "other")


def profile_events(prof, cuda: bool) -> list[tuple[str, float]]:
    """(name, µs) of every kernel the profiler saw on the GPU; on the CPU (the smoke run) every top-level op, its
    CPU time (the code path, not the numbers)."""
    if cuda:
        return [(e.name, e.time_range.elapsed_us()) for e in prof.events() if str(e.device_type).endswith("CUDA")]
    return [(e.name, e.cpu_time_total) for e in prof.events() if e.cpu_parent is None and e.name.startswith("aten::")]


def kernel_table(events: list[tuple[str, float]], steps: int, layers: int, top: int = 15) -> dict:
    """Kernels per step and per layer, device µs per step, and both by kind (KERNEL_KINDS) and for the `top`
    kernels by time: what a layer of the step is made of."""
    by_kind: dict[str, list[float]] = {}
    by_name: dict[str, list[float]] = {}
    for name, us in events:
        by_kind.setdefault(kernel_kind(name), []).append(us)
        by_name.setdefault(name, []).append(us)
    per_step = lambda xs: {"count_per_step": len(xs) / steps, "us_per_step": sum(xs) / steps}  # noqa: E731
    named = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {"steps": steps, "kernels_per_step": len(events) / steps, "kernels_per_layer": len(events) / steps / layers,
            "device_us_per_step": sum(us for _, us in events) / steps,
            "by_kind": {k: per_step(v) for k, v in sorted(by_kind.items(), key=lambda kv: -sum(kv[1]))},
            "top": [{"name": n[:120], "kind": kernel_kind(n), **per_step(v)} for n, v in named]}


def _fraction(row: dict) -> str:
    return f", {100 * row['hbm_fraction']:.0f}% of HBM roofline" if "hbm_fraction" in row else ""


def _s(x) -> str:
    return "-" if x is None else f"{x:.1f} s"


class Models:
    """The random-weight decoders, built on first use and kept for the sections after (all three fit
    on one GPU: ~20 GiB of bf16 weights); each model's results go to sections.shapes[name]."""

    def __init__(self, plan: Plan, report: Report, budget: Budget, clock: Clock):
        self.plan, self.report, self.budget, self.clock = plan, report, budget, clock
        self.benches: dict[str, StepBench | None] = {}
        self.compiles: list[float] = []  # first calls of new steps, every model (StepBench.need)

    def results(self, name: str) -> dict:
        return self.report.section("shapes").setdefault(name, {"shape": asdict(self.plan.shapes[name])})

    def get(self, name: str) -> StepBench | None:
        """The model's bench, building it on first use (None where that failed)."""
        if name not in self.benches:
            res = self.results(name)
            try:
                self.benches[name] = self._build(name, res)
            except Exception as exc:  # out of memory included
                res["error"] = f"build: {type(exc).__name__}: {str(exc)[:1000]}"
                self.budget.say(f"{name}: build FAILED {type(exc).__name__}: {str(exc)[:300]}")
                self.benches[name] = None
                free_memory()
            self.report.save()
        return self.benches[name]

    def _build(self, name: str, res: dict) -> StepBench:
        shape, t0 = self.plan.shapes[name], time.perf_counter()
        lean, params = build_lean(shape, self.plan)
        self.clock.sync()
        nbytes = model_bytes(shape, params, lean, self.plan)
        res.update(params=params, weight_bytes=nbytes.weights, streamed_bytes=nbytes.streamed,
                   kv_bytes_per_row=nbytes.kv_per_row, build_s=time.perf_counter() - t0)
        self.budget.say(f"{name}: {params / 1e6:.1f} M parameters, {nbytes.weights / 2**30:.2f} GiB of weights, "
                        f"built in {res['build_s']:.1f} s")
        return StepBench(name, lean, nbytes, self.plan, self.clock, self.report, self.budget, self.compiles)

    def each(self):
        """(name, bench, results) of every model that builds."""
        for name in self.plan.shapes:
            bench = self.get(name)
            if bench is not None:
                yield name, bench, self.results(name)

    def free(self) -> None:
        self.benches.clear()
        torch._dynamo.reset()  # compiled steps and CUDA graph pools hold the weights and caches
        free_memory()


def steps_section(models: Models) -> None:
    """Batch 1, every model: the graph step and the eager step (the numbers that matter most, first)."""
    p = models.plan
    for name, bench, res in models.each():
        attempt(res, f"graph_w{p.width}_b1", models.budget, bench.need(), lambda: bench.graph_step(1, p.width),
                models.report)
        attempt(res, "eager_b1", models.budget, 5.0, lambda: bench.eager_step(1), models.report)


def kernels_section(models: Models) -> None:
    """Batch 1 and the largest of --batches, every model: the step's kernels and their device times
    (`StepBench.kernel_profile`): where a layer's time goes, for the next change to the step."""
    p = models.plan
    for name, bench, res in models.each():
        for b in sorted({1, max(p.batches)}):
            attempt(res, f"kernels_w{p.width}_b{b}", models.budget, bench.need(),
                    lambda: bench.kernel_profile(b, p.width), models.report)


def step_path() -> str:
    """The default step's path as this process runs it (recorded with every graph row)."""
    from specloop.drafter.model.graph import capture_mode, resolve_attention

    return f"{capture_mode()}-{resolve_attention(torch.device('cuda' if torch.cuda.is_available() else 'cpu'))}"


def paths_section(models: Models) -> None:
    """Batch 1 (and the largest of --batches): the step run the other ways (PATHS) beside the default one in
    section steps: what the direct graphs and the attention kernel each bring."""
    p = models.plan
    for name, bench, res in models.each():
        for label, env in ((k, v) for k, v in PATHS.items() if k in p.paths):
            why = path_missing(env, p)
            if why:
                res[f"{label}"] = f"skipped: {why}"
                continue
            env = env | ({"SPECLOOP_SKINNY_TILES": str(p.tiles)} if "SPECLOOP_SKINNY_TILES" in env else {})
            for b in sorted({1, max(p.batches)}):
                with scoped_env(env):
                    attempt(res, f"graph_w{p.width}_b{b}_{label}", models.budget, bench.need(),
                            lambda: bench.graph_step(b, p.width, path=f"graph-{label}"), models.report)


def path_missing(env: dict[str, str], p: Plan) -> str | None:
    """Why a path of PATHS cannot run here (None: it can)."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"  # the code path on a CPU, not a timing
    if not (p.cuda or interpreted) and (env.get("SPECLOOP_ATTENTION") == "triton"
                                        or env.get("SPECLOOP_LINEAR") == "skinny"):
        return "the Triton kernels need a GPU (or TRITON_INTERPRET=1: their code path, interpreted)"
    if interpreted and not p.cuda and p.compiled and env.get("SPECLOOP_LINEAR") == "skinny":
        return "inductor does not take an interpreted Triton op on a CPU (SPECLOOP_COMPILE=0: the path uncompiled)"
    if "SPECLOOP_SKINNY_TILES" in env and not (p.tiles and p.tiles.exists()):
        return "no tilings: section products did not run before it"
    return None


def products_section(models: Models) -> None:
    """Each model's weight products (layer 0's qkv, o, gate-up and down, and the head) at M = W rows (batch 1) and
    W · the largest batch: cuBLAS (F.linear, the default step's) against the skinny kernel
    (drafter/model/skinny_linear.py) at its own tiling and at the tilings of `sweep_tilings`, µs a product and
    bytes/s, each timed as one CUDA graph of `product_replays` products back to back over as many copies of the
    weight as keep them out of L2 (launches excluded, as in a captured step). The fastest tiling of each shape
    goes to plan.tiles, which path direct-skinny-tuned runs (SPECLOOP_SKINNY_TILES)."""
    p = models.plan
    tiles: dict[str, list[int]] = json.loads(p.tiles.read_text()) if p.tiles and p.tiles.exists() else {}
    for name, bench, res in models.each():
        out = res.setdefault("products", {})
        for label, weight in product_weights(bench.lean):
            for rows in sorted({p.width, p.width * max(p.batches)}):
                key = f"{rows},{weight.shape[0]},{weight.shape[1]}"
                timed = attempt(out, f"{label}_m{rows}", models.budget, 5.0,
                                lambda: time_product(weight, rows, p, models.clock), models.report)
                if isinstance(timed, dict) and timed.get("best_tiling"):
                    tiles[key] = timed["best_tiling"]
                    if p.tiles:
                        p.tiles.write_text(json.dumps(tiles, separators=(",", ":")) + "\n")
                if isinstance(timed, dict):
                    us = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
                    models.budget.say(f"{name} {label} M={rows}: cuBLAS {timed['cublas_us']:.1f} µs, skinny "
                                      f"{us(timed.get('skinny_us'))} µs, best {us(timed.get('best_us'))} µs "
                                      f"{timed.get('best_tiling')}")


def product_weights(lean) -> list[tuple[str, torch.Tensor]]:
    from specloop.drafter.model.graph import _float_weight

    layer = lean.layers[0]
    return [(n, _float_weight(getattr(layer, n))[0]) for n in ("qkv", "o", "gate_up", "down")] + [
        ("head", _float_weight(lean.lm_head)[0])]


def sweep_tilings(m: int, n: int, k: int, sms: int) -> list:
    """The skinny kernel's own tiling, and around it: 32-128 outputs and 64-256 inputs a tile, half and twice
    the split (each an exact tiling: the split stays a function of the shapes)."""
    from specloop.drafter.model import skinny_linear as sl

    own = sl.tiling(m, n, k, sms)
    found = {own}
    for block_n in (32, 64, 128):
        for block_k in (64, 128, 256):
            base = sl.tiling(m, n, k, sms, block_n=block_n, block_k=block_k).split
            for split in {max(1, base // 2), base, base * 2}:
                found.add(sl.ranges(m, k, block_n, block_k, split, 4, 4))
    return [own] + sorted(found - {own}, key=lambda t: (t.block_n, t.block_k, t.split))


def time_product(weight: torch.Tensor, rows: int, p: Plan, clock: Clock) -> dict:
    """µs of one [rows, K] × weightᵀ product: F.linear, then (on a GPU) the skinny kernel at each tiling."""
    import torch.nn.functional as F

    from specloop.drafter.model import skinny_linear as sl

    n, k = weight.shape
    nbytes = weight.numel() * weight.element_size()
    copies = [weight] + [weight.clone() for _ in range(max(0, -(-(200 << 20) // nbytes) - 1))] if p.cuda else [weight]
    x = torch.randn(rows, k, device=p.device, dtype=weight.dtype)
    cublas = _product_us(lambda w: F.linear(x, w), copies, p, clock)
    out = {"rows": rows, "n": n, "k": k, "weight_bytes": nbytes, "cublas_us": cublas,
           "cublas_bytes_per_s": nbytes / cublas * 1e6}
    if not (sl.available() and (p.cuda or os.environ.get("TRITON_INTERPRET") == "1")):  # interpreted: the code path
        return out | {"skinny": "needs a GPU"}
    expected = F.linear(x, weight).float()
    tried = []
    for t in sweep_tilings(rows, n, k, sl.sm_count(str(p.device))):
        err = (sl.skinny_linear(x, weight, tiles=t).float() - expected).abs().max().item()
        us = _product_us(lambda w, t=t: sl.skinny_linear(x, w, tiles=t), copies, p, clock)
        tried.append({"tiling": [t.block_n, t.block_k, t.split, t.warps, t.stages], "us": us,
                      "bytes_per_s": nbytes / us * 1e6, "max_abs_diff_vs_cublas": err})
    best = min(tried, key=lambda r: r["us"])
    del copies
    return out | {"skinny_us": tried[0]["us"], "skinny_bytes_per_s": tried[0]["bytes_per_s"], "tilings": tried,
                  "best_us": best["us"], "best_tiling": best["tiling"], "best_bytes_per_s": best["bytes_per_s"]}


def _product_us(fn, copies: list[torch.Tensor], p: Plan, clock: Clock) -> float:
    """Median µs of one product: a CUDA graph of p.product_replays calls, weights taken in turn from
    `copies` (so that L2 holds none of them), replayed p.repeats times; on the CPU, calls one by one."""
    fn(copies[0])
    if not p.cuda:
        return statistics.median(clock.ms(lambda: fn(copies[0]), p.repeats, 1)) * 1e3
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(p.product_replays):
            fn(copies[i % len(copies)])
    per = statistics.median(clock.ms(graph.replay, p.repeats, 2)) * 1e3 / p.product_replays
    del graph
    return per


def long_section(models: Models) -> None:
    """Batch 1: the same cached tokens in a pool of --long-capacity positions (a server sized for long
    requests running a short one), each attention of LONG: what the pool's size costs a short row."""
    p = models.plan
    for name, bench, res in models.each():
        for label in (x for x in LONG if x == "direct-torch" or x in p.paths):
            why = path_missing(PATHS.get(label, {}), p)
            if why:
                res[f"{label}_c{p.long_capacity}"] = f"skipped: {why}"
                continue
            with scoped_env(PATHS.get(label, {"SPECLOOP_CUDA_GRAPHS": "direct", "SPECLOOP_ATTENTION": "torch"})):
                attempt(res, f"graph_w{p.width}_b1_{label}_c{p.long_capacity}", models.budget, bench.need(),
                        lambda: bench.graph_step(1, p.width, path=f"graph-{label}-c{p.long_capacity}",
                                                 capacity=p.long_capacity), models.report)


def batches_section(models: Models) -> None:
    p = models.plan
    for name, bench, res in models.each():
        for b in (b for b in p.batches if b != 1):
            attempt(res, f"graph_w{p.width}_b{b}", models.budget, bench.need(), lambda: bench.graph_step(b, p.width),
                    models.report)
            attempt(res, f"eager_b{b}", models.budget, 5.0, lambda: bench.eager_step(b), models.report)


def inexact_section(models: Models) -> None:
    """The fastest inexact step: the graph step at W = 1 (a one-token step whose shapes differ from a
    verify pass's), at each batch: W = 5's cost over it is what exactness by construction costs."""
    for name, bench, res in models.each():
        for b in models.plan.batches:
            attempt(res, f"graph_w1_b{b}", models.budget, bench.need(), lambda: bench.graph_step(b, 1), models.report)


def drafter_section(models: Models) -> None:
    """The 135M-shaped drafter LM's step (width 2, last position only, as PretrainedDrafter runs it)."""
    p = models.plan
    bench = models.get(DRAFTER) if DRAFTER in p.shapes else None
    if bench is None:
        return
    res = models.results(DRAFTER)
    for b in p.batches:
        attempt(res, f"drafter_w{p.drafter_width}_b{b}", models.budget, bench.need(),
                lambda: bench.graph_step(b, p.drafter_width, last_only=True, path="drafter-graph"), models.report)


def verify_section(models: Models) -> None:
    for name, bench, res in models.each():
        attempt(res, "verify", models.budget, bench.need(), bench.verify_costs, models.report)


def compile_section(models: Models) -> None:
    for name, bench, res in models.each():
        attempt(res, "compile", models.budget, 2 * bench.need(), bench.compile_times, models.report)
        res["compile_state"] = compile_state()


def ratios(report: Report, plan: Plan) -> dict:
    """eager / graph per model and batch; c = the 135M-shaped drafter step / each verifier's step."""
    step = {(r["model"], r["batch"]): r["ms"] for r in report.rows(section="shapes", path="graph", width=plan.width)}
    eager = {(r["model"], r["batch"]): r["ms"] for r in report.rows(section="shapes", path="eager", T=1)}
    draft = {r["batch"]: r["ms"] for r in report.rows(section="shapes", path="drafter-graph", model=DRAFTER)}
    narrow = {(r["model"], r["batch"]): r["ms"] for r in report.rows(section="shapes", path="graph", width=1)}
    out = {"eager_over_graph": {}, "drafter_over_verifier": {}, "w5_over_w1": {}}
    for (model, b), ms in step.items():
        if (model, b) in narrow:  # what exactness by construction costs: the fixed width against the narrowest step
            out["w5_over_w1"].setdefault(model, {})[b] = ms / narrow[(model, b)]
        if (model, b) in eager:
            out["eager_over_graph"].setdefault(model, {})[b] = eager[(model, b)] / ms
        if model != DRAFTER and b in draft:
            out["drafter_over_verifier"].setdefault(model, {})[b] = draft[b] / ms
    return out


# -- section 2: the reference pair end to end


@dataclass
class System:
    name: str
    drafter: object
    k: int | None
    backend: str
    note: str = ""
    rates: list[float] = field(default_factory=list)
    identical: list[bool] = field(default_factory=list)  # per prompt: equal to the graph verifier alone on every pass
    tau: float | None = None
    first_pass_s: float | None = None
    error: str | None = None  # a failed build or run: the system sits out the passes after
    env: dict[str, str] = field(default_factory=dict)  # the step's path (PATHS) where not the default
    reference: str = "alone-graph"  # the system whose outputs this one's must equal (the verifier alone, same path)
    split: list[dict] = field(default_factory=list)  # per pass: seconds in admissions (prefills), in steps, the rest
    controller: object = None  # k auto: one controller over every pass, as a server's engine keeps one (None: a new
    #                            one per batch, --fresh-controllers)


def build_systems(verifier, models: Path, eagle_head: Path | None = None) -> list[System]:
    """Fresh drafters per batch size: the engine wraps a drafter's own LM for the slot count of the
    first engine it joins (specloop.drafter.decode.engine.Engine._graph_drafter) and keeps that wrapper. A drafter that
    fails to build leaves its systems with the error."""
    from specloop.drafter.kinds.table import build_drafter

    untrained = "untrained head: drafts noise; its cost is real, its τ is not"
    systems = [System("alone-graph", None, 0, "graph"), System("alone-eager", None, 0, "eager"),
               System("alone-trees-torch", None, 0, "graph", "the last session's graph step", env=PATHS["trees-torch"])]
    eagle = ("eagle", eagle_head, "") if eagle_head else ("eagle", None, untrained)  # --eagle-head: a trained one
    # the served default: the eagle head with suffix decoding beside it (drafter/kinds/mix.py), k auto
    served = ("eagle+suffix", eagle_head, "the served default" + ("" if eagle_head else f"; {untrained}"))
    for kind, path, note in (("pretrained", models / "drafter", ""), ("ngram", None, ""), eagle, served):
        base, _, beside = kind.partition("+")
        try:
            drafter, error = build_drafter(base, verifier, path, weights="bf16" if path else None,
                                           speculators=(beside,) if beside else ()), None
        except Exception as exc:
            drafter, error = None, f"build: {type(exc).__name__}: {str(exc)[:500]}"
        for suffix, k in (("auto", None),) if beside else (("auto", None), ("k4", 4)):
            systems.append(System(f"{kind}-{suffix}", drafter, k, "graph", note, error=error))
    return systems + skinny_systems(systems)


def skinny_systems(systems: list[System]) -> list[System]:
    """The verifier alone, n-gram k = 4 and the served default with the step's products through the skinny kernel
    (path direct-skinny), each compared with the verifier alone on that path (its own rounding): on a GPU only."""
    if not torch.cuda.is_available():
        return []
    env = PATHS["direct-skinny"]
    out = [System("alone-skinny", None, 0, "graph", "products through the skinny kernel", env=env,
                  reference="alone-skinny")]
    for s in systems:
        if s.name in ("ngram-k4", "eagle+suffix-auto"):
            out.append(System(f"{s.name}-skinny", s.drafter, s.k, "graph", s.note, error=s.error, env=env,
                              reference="alone-skinny"))
    return out


def pair_section(plan: Plan, args, report: Report, budget: Budget, clock: Clock) -> None:
    from specloop.drafter.decode.requests import StopRule
    from specloop.drafter.decode.sampling import SamplingParams
    from specloop.drafter.model.loading import load_model
    from specloop.services.prompts import encode, load_prompts

    out = report.section("pair")
    # the entries other models compiled go: dynamo's recompile-reason code can fail across models of
    # different depths when GraphDecoder.warm passes one tensor as both n_new and lens
    torch._dynamo.reset()
    verifier = load_model(args.models / "verifier", device=plan.device, weights=args.weights)
    fits = one_pool(verifier.lean, plan) if plan.one_pool else range(1, 1 << 30)
    prompts = []
    for name in ("chat_dev.jsonl", "code_dev.jsonl"):
        encoded = (encode(verifier.tokenizer, r) for r in load_prompts(args.prompts / name))
        prompts += [ids for ids in encoded if len(ids) in fits][: plan.per_file]
    widest = max(plan.pair_batches)
    prompts = prompts[: max(widest, len(prompts) // widest * widest)]  # whole batches: every engine has the same slots
    out.update(controllers="a new one per batch of prompts" if args.fresh_controllers else
               "one per k-auto system over the warm-up pass and every round (as a server keeps its engine's)")
    out.update(verifier=str(args.models / "verifier"), served=verifier.served, prompts=len(prompts),
               prompt_tokens=[len(p) for p in prompts], prompt_lengths_kept=[fits.start, fits.stop - 1] if plan.one_pool
               else "any", max_tokens=plan.max_tokens)
    budget.say(f"pair: verifier {verifier.served} on {verifier.lean.device}, {len(prompts)} prompts of "
               f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens")
    params, rule = SamplingParams(max_tokens=plan.max_tokens), StopRule(verifier.eos_ids)
    for batch in plan.pair_batches:
        attempt(out, f"batch_{batch}", budget, 10.0,
                lambda: pair_batch(verifier, prompts, batch, params, rule, plan, args, budget, clock), report)  # noqa: F821 - deleted after the last use (ruff reads the del as unbinding it)
    out["compile_state_after"] = compile_state()
    del verifier
    torch._dynamo.reset()
    free_memory()
    report.save(plot=True)


def one_pool(lean, plan: Plan) -> range:
    """Prompt lengths for which every system's engine gets the same pool: generate() sizes the pool from
    the batch's longest prompt, max_tokens and k (specloop.drafter.decode.capacity), and each distinct pool shape is
    another compile of the static step (dynamic=False). Kept: the lengths whose pool, for k = 0 and for
    k up to k_max alike, is that of a `pool_prompt`-token prompt (default 96: 62-117 tokens at 64 new)."""
    from specloop.drafter.decode.capacity import AUTO_K_MAX, positions_needed

    def pool(length: int, k: int) -> int:
        return pool_shape(1, positions_needed(length, plan.max_tokens, k, AUTO_K_MAX), lean)[2]

    target = pool(plan.pool_prompt, AUTO_K_MAX)
    kept = [n for n in range(1, 4 * target) if pool(n, 0) == pool(n, AUTO_K_MAX) == target]
    return range(kept[0], kept[-1] + 1)


def pair_batch(verifier, prompts, batch: int, params, rule, plan: Plan, args, budget: Budget, clock: Clock) -> dict:
    from specloop.drafter.decode.controller import Controller
    from specloop.drafter.decode.engine import generate

    systems = build_systems(verifier, args.models, args.eagle_head)
    if args.systems:  # the references stay: alone-graph and the alone of every path kept
        wanted = set(args.systems.split(","))
        kept = {s.reference for s in systems if s.name in wanted} | {"alone-graph"}
        systems = [s for s in systems if s.name in wanted | kept]
    for system in systems:  # a server's engine keeps its controller; generate() per batch would start a new one
        system.controller = None if args.fresh_controllers or system.k is not None else Controller()

    def run(system: System):
        gens, t0 = [], time.perf_counter()
        with scoped_env(system.env), split_time(clock) as split:
            for lo in range(0, len(prompts), batch):
                gens += generate(verifier.lean, system.drafter, prompts[lo : lo + batch], params, system.k, rule,
                                 backend=system.backend, controller=system.controller)
        clock.sync()
        system.split.append(split)
        return gens, time.perf_counter() - t0

    references: dict[str, list[list[int]]] = {}  # the verifier alone's outputs on each path (System.reference)
    passes = []
    for r in range(1 + plan.rounds):  # pass 0: every pool shape's compile, the reference outputs, τ
        if r and not budget.allows(min(passes)):  # a timed pass costs about the fastest one so far
            budget.say(f"pair batch {batch}: round {r} skipped (budget)")
            break
        t_pass = time.perf_counter()
        for system in systems if r % 2 == 0 else systems[::-1]:
            if system.error:
                continue
            try:
                gens, seconds = run(system)
            except Exception as exc:
                system.error = f"{type(exc).__name__}: {str(exc)[:1000]}"
                budget.say(f"pair batch {batch} {system.name}: FAILED {system.error[:300]}")
                traceback.print_exc()
                continue
            if system.name == system.reference and system.name not in references:
                references[system.name] = [g.token_ids for g in gens]
            reference = references.get(system.reference)
            same = [reference is not None and g.token_ids == ref for g, ref in zip(gens, reference or gens)]
            system.identical = same if not system.identical else [a and b for a, b in zip(system.identical, same)]
            if r == 0:
                system.first_pass_s = seconds
                blocks = sum(g.stats.blocks for g in gens)
                system.tau = (sum(g.stats.accepted for g in gens) + blocks) / blocks if blocks else None
            else:
                system.rates.append(sum(len(g.token_ids) for g in gens) / seconds)
            chosen = system.split[-1]["chosen_k"]
            budget.say(f"pair batch {batch} {'warm-up' if r == 0 else f'round {r}'} {system.name}: {seconds:.2f} s, "
                       f"identical {sum(same)}/{len(same)}" + (f", k chosen {chosen}" if chosen else ""))
        passes.append(time.perf_counter() - t_pass)
    out = pair_rows(systems, batch, passes, budget)
    profiled = [s for s in systems if s.name in ("alone-graph", "ngram-k4", "eagle-k4", "eagle-auto") and not s.error]
    out["host_profile"] = {s.name: host_profile(run, s) for s in profiled if budget.allows(5.0)}
    out["device_profile"] = {s.name: device_profile(run, s) for s in profiled if budget.allows(5.0)}
    return out


def device_profile(run, system: "System", top: int = 20) -> dict:
    """One more pass of `system` under torch.profiler (CPU and, on a GPU, CUDA activity): how busy the device
    was over the pass (its kernels' time over the wall time: a host-bound step leaves it idle), and the ops by
    the host time they took (launches included), what the next session's host work should cut."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        _, seconds = run(system)
    system.split.pop()  # the profiled pass is not one of the timed ones
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events if str(e.device_type).endswith("CUDA"))  # kernels
    table = events.table(sort_by="self_cpu_time_total", row_limit=top)
    return {"seconds_under_profiler": seconds, "device_busy_s": device_us / 1e6,
            "device_busy_fraction": device_us / 1e6 / seconds if seconds else None,
            "top_by_host_time": table.splitlines()[: top + 6]}


def host_profile(run, system: "System", top: int = 25) -> dict:
    """Where one more pass of `system` spends its host time (cProfile, by own time): what the next session's
    host work should cut."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    _, seconds = run(system)
    prof.disable()
    system.split.pop()  # the profiled pass is not one of the timed ones
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return {"seconds_under_profiler": seconds, "top": text.getvalue().splitlines()[:top + 12]}


class split_time:
    """Seconds a pass spends admitting requests (their prefills), stepping, and outside both (engine set-up and
    warm-up, pools, Python between calls): Engine.admit and Engine.step wrapped for the block, each call
    synchronized at its end (a step reads its verdict back anyway)."""

    def __init__(self, clock: Clock):
        self.clock = clock
        # chosen_k: the controller's k per step ("untimed": left plain, timed by nothing), where it chose
        self.out: dict = {"admit_s": 0.0, "step_s": 0.0, "steps": 0, "wall_s": 0.0, "chosen_k": {}}

    def _timed(self, original, key: str):
        def wrapped(engine, *args, **kwargs):
            t0 = time.perf_counter()
            result = original(engine, *args, **kwargs)
            self.clock.sync()
            self.out[key + "_s"] += time.perf_counter() - t0
            self.out["steps"] += key == "step"
            choice = engine.timing.choice if key == "step" else None
            if choice is not None:
                name = str(choice.k) if choice.timed else "untimed"
                self.out["chosen_k"][name] = self.out["chosen_k"].get(name, 0) + 1
            return result
        return wrapped

    def __enter__(self) -> dict:
        from specloop.drafter.decode.engine import Engine

        self.saved = Engine.admit, Engine.step
        Engine.admit, Engine.step = self._timed(Engine.admit, "admit"), self._timed(Engine.step, "step")
        self.t0 = time.perf_counter()
        return self.out

    def __exit__(self, *exc) -> None:
        from specloop.drafter.decode.engine import Engine

        Engine.admit, Engine.step = self.saved
        self.out["wall_s"] = time.perf_counter() - self.t0
        self.out["other_s"] = self.out["wall_s"] - self.out["admit_s"] - self.out["step_s"]


def pair_rows(systems: list[System], batch: int, passes: list[float], budget: Budget) -> dict:
    from specloop.drafter.model.graph import GraphDecoder

    base = next(s for s in systems if s.name == "alone-graph").rates
    rows = {}
    for s in systems:
        lean = getattr(s.drafter, "lean", None)
        rows[s.name] = {
            "k": "auto" if s.k is None else s.k, "backend": s.backend, "tokens_per_s_median": _median(s.rates),
            "tokens_per_s_rounds": s.rates,
            "x_alone_graph": _median([a / b for a, b in zip(s.rates, base)]) if len(s.rates) == len(base) else None,
            "tau": s.tau, "identical_to_graph_alone": f"{sum(s.identical)}/{len(s.identical)}",
            "identical_to": s.reference,
            "first_pass_s": s.first_pass_s,
            "drafter_lm_graph_calls": lean.graph_calls if isinstance(lean, GraphDecoder) else None,
            "split_per_pass": s.split,  # admit (prefills) / step / other seconds, the k chosen: every pass, warm-up first
            "step_ms_median": _median([1e3 * x["step_s"] / x["steps"] for x in s.split[1:] if x["steps"]]),
        } | ({"note": s.note} if s.note else {}) | ({"error": s.error} if s.error else {})
        if s.rates:
            x = rows[s.name]["x_alone_graph"]
            budget.say(f"pair batch {batch} {s.name}: {rows[s.name]['tokens_per_s_median']:.0f} tok/s, "
                       f"x{x or float('nan'):.2f} alone-graph, τ {s.tau or 0:.2f}, "
                       f"identical {rows[s.name]['identical_to_graph_alone']}")
    return {"systems": rows, "pass_s": passes, "rounds_done": max(0, len(passes) - 1)}


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


# -- section sampling: the sampled distribution on the device (bench/gpu_sampling.py)


SAMPLING_NEED_S = 90.0  # section sampling on a GPU: its compiles and 8 engines of 20,000 rows (an estimate)


def sampling(plan: Plan, args, report: Report, budget: Budget) -> None:
    from bench.gpu_sampling import SamplingPlan, build_pair, sampling_section

    if plan.cuda and not budget.allows(SAMPLING_NEED_S):  # a verdict cut off by the call's timeout is none at all
        report.section("sampling")["skipped"] = f"budget: {budget.left():.0f} s left, ~{SAMPLING_NEED_S:.0f} s needed"
        budget.say("sampling: skipped (budget)")
        return
    torch._dynamo.reset()  # its tiny shapes compile anew, whatever ran before
    # on a CPU by default the code path only (the test's power needs the GPU's size)
    sized = SamplingPlan(samples=args.samples) if args.samples else \
        SamplingPlan() if plan.cuda else SamplingPlan(samples=2_000, chunk=1_000)
    sampling_section(report.section("sampling"), build_pair(Shape, build_lean, plan), sized, budget.say)
    torch._dynamo.reset()
    free_memory()


# -- section 3: plain transformers, static cache, compiled


def hf_anchor(name: str, shape: Shape, plan: Plan, report: Report, budget: Budget, clock: Clock) -> dict:
    """transformers' own decode at batch 1 (the docs' static-cache recipe: prefill eagerly into a
    StaticCache, then a compiled one-token forward), at the same context and cache length."""
    from transformers import AutoModelForCausalLM, StaticCache

    config = llama_config(shape, plan.capacity + KEY_BLOCK)
    with torch.device(plan.device):
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=plan.dtype)
        except TypeError:  # transformers before `dtype` replaced `torch_dtype`
            model = AutoModelForCausalLM.from_config(config, torch_dtype=plan.dtype)
    model.eval()
    length = pool_shape(1, plan.capacity, SimpleNamespace(n_kv=shape.kv_heads, head_dim=shape.head_dim))[2]
    cache = StaticCache(config=config, max_cache_len=length)
    dev = plan.device
    # transformers before 5.2x placed tokens by `cache_position`; later ones count them in the cache itself
    by_position = "cache_position" in inspect.signature(model.model.forward).parameters

    def where(start: int, n: int) -> dict:
        return {"cache_position": torch.arange(start, start + n, device=dev)} if by_position else {}

    with torch.inference_mode():
        model(input_ids=torch.randint(0, shape.vocab, (1, plan.context), device=dev), past_key_values=cache,
              use_cache=True, **where(0, plan.context))

    def decode_one(token, position_ids, **placed):
        logits = model(input_ids=token, position_ids=position_ids, past_key_values=cache, use_cache=True,  # noqa: F821 - deleted after the last use (ruff reads the del as unbinding it)
                       return_dict=False, **placed)[0]
        return torch.argmax(logits[:, -1], dim=-1)

    step = torch.compile(decode_one, mode="reduce-overhead", fullgraph=True) if plan.compiled else decode_one
    token = torch.randint(0, shape.vocab, (1, 1), device=dev)
    at, placed = torch.tensor([[plan.context]], device=dev), where(plan.context, 1)

    def call():
        with torch.inference_mode():
            _rewind(cache, plan.context)  # every call writes position `context` again, as the graph steps do  # noqa: F821 - deleted after the last use (ruff reads the del as unbinding it)
            step(token, at, **placed)  # noqa: F821 - deleted after the last use (ruff reads the del as unbinding it)

    first, second = clock.seconds(call), clock.seconds(call)
    weights = 2 * sum(p.numel() for p in model.parameters())
    row = report.row(section="anchor", model=name, path="hf-compiled", batch=1, width=1, T=1,
                     **summary(clock.ms(call, plan.repeats, plan.warmup)), first_call_s=first, second_call_s=second,
                     weight_bytes=weights, cache_len=length)
    graph = report.rows(section="shapes", model=name, path="graph", batch=1, width=plan.width)
    if graph:
        row["graph_over_hf"] = graph[0]["ms"] / row["ms"]
    budget.say(f"{name} transformers compiled B=1: {row['ms']:.3f} ms/step{_fraction(row)}; first calls "
               f"{first:.1f} + {second:.1f} s" + (f"; graph step / HF {row['graph_over_hf']:.2f}" if graph else ""))
    del model, cache, step
    return row


def _rewind(cache, length: int) -> None:
    """A StaticCache that counts its own tokens (transformers 5.2x: `cumulative_length` per layer) back to
    `length`; a no-op where positions come from `cache_position`."""
    for layer in getattr(cache, "layers", ()):
        count = getattr(layer, "cumulative_length", None)
        if isinstance(count, torch.Tensor):
            count.fill_(length)
        elif isinstance(count, int):
            layer.cumulative_length = length


def anchor_section(plan: Plan, report: Report, budget: Budget, clock: Clock, compiles: list[float]) -> None:
    """`compiles`: first calls of the static step so far; transformers' compile of the same shapes
    took about twice as long where both were measured (the estimate grows with each anchor's)."""
    out = report.section("anchor")
    import transformers

    out["transformers"] = transformers.__version__
    for name, shape in sorted(plan.shapes.items(), key=lambda item: item[0] != ANCHOR_FIRST):
        need = max(plan.compile_guess_s, 2 * max(compiles, default=0.0)) if plan.compiled else 0.0
        row = attempt(out, name, budget, need, lambda: hf_anchor(name, shape, plan, report, budget, clock), report)
        if isinstance(row, dict) and "first_call_s" in row:
            compiles.append(row["first_call_s"] / 2)
        torch._dynamo.reset()
        free_memory()
    report.save(plot=True)


# -- the plot


def _plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["rows"]
    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    models = list(dict.fromkeys(r["model"] for r in rows if r.get("section") == "shapes"))
    colors = {m: f"C{i}" for i, m in enumerate(models)}
    width = data["settings"]["width"]

    ax = axes[0, 0]
    for m in models:
        for kind, style in (("graph", "-o"), ("graph-replay", ":."), ("eager", "--s")):
            pts = sorted((r["batch"], r["ms"]) for r in rows if r["model"] == m and r["path"] == kind and r["T"] == 1
                         and (kind == "eager" or r["width"] == width))
            if pts:
                ax.plot(*zip(*pts), style, color=colors[m], label=f"{m} {kind}")
        hf = [r for r in rows if r["model"] == m and r["path"] == "hf-compiled"]
        if hf:
            ax.plot([1], [hf[0]["ms"]], "*", ms=12, color=colors[m], label=f"{m} transformers compiled")
    ax.set(xscale="log", yscale="log", xlabel="batch (rows)", ylabel="ms per one-token step (median)",
           title=f"decode step at {data['settings']['context']} cached tokens")
    _legend(ax)

    ax = axes[0, 1]
    for m in models:
        pts = sorted((r["batch"], r["hbm_fraction"]) for r in rows
                     if r["model"] == m and r["path"] == "graph" and r["width"] == width and "hbm_fraction" in r)
        if pts:
            ax.plot(*zip(*pts), "-o", color=colors[m], label=f"{m} graph step")
        pts = sorted((r["batch"], r["hbm_fraction"]) for r in rows if r["model"] == m and r["path"] == "eager"
                     and r["T"] == 1 and "hbm_fraction" in r)
        if pts:
            ax.plot(*zip(*pts), "--s", color=colors[m], label=f"{m} eager")
    ax.set(xscale="log", xlabel="batch (rows)", ylabel="weight bytes / step time / peak",
           title=f"fraction of the HBM roofline (peak {data.get('peak_bytes_per_s') or 0:.3g} B/s)")
    _legend(ax)

    ax = axes[1, 0]
    for m in models:
        for kind, style in (("eager-verify", "--s"), ("graph-verify", "-o")):
            pts = sorted((r["T"], r["ms"]) for r in rows if r["model"] == m and r["path"] == kind)
            if pts:
                ax.plot([t for t, _ in pts], [ms / pts[0][1] for _, ms in pts], style, color=colors[m],
                        label=f"{m} {kind}")
    ax.set(xlabel="tokens per verify pass (T = k + 1)", ylabel="v_T = cost(T) / cost(1)",
           title="verify pass cost, batch 1")
    _legend(ax)

    ax = axes[1, 1]
    pair = data["sections"].get("pair", {})
    batches = [k for k in pair if k.startswith("batch_") and isinstance(pair[k], dict) and "systems" in pair[k]]
    for i, key in enumerate(batches):
        systems = pair[key]["systems"]
        names = list(systems)
        rates = [systems[n]["tokens_per_s_median"] or 0 for n in names]
        xs = [j + i * 0.4 for j in range(len(names))]
        ax.bar(xs, rates, width=0.4, label=key.replace("_", " "))
        ax.set_xticks([j + 0.2 for j in range(len(names))], names, rotation=45, ha="right", fontsize=7)
    ax.set(ylabel="tokens/s (median over rounds)", title="reference pair end to end")
    _legend(ax)

    fig.suptitle(f"{data['device']}, torch {data['torch']}, {data['dtype']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=6)


# -- main


def peak_bandwidth(device_name: str, override_gbs: float | None) -> float | None:
    """HBM bytes/s: --peak-gbs, else the datasheet's for the device's name (None where unknown)."""
    if override_gbs:
        return override_gbs * 1e9
    name = device_name.upper()
    if "H200" in name:
        return 4.8e12
    if "H100" in name:
        return 2.0e12 if "PCIE" in name else 3.9e12 if "NVL" in name else 3.35e12  # SXM: 3.35e12
    return None


def make_plan(args) -> Plan:
    device = torch.device(args.device or ("cpu" if args.smoke or not torch.cuda.is_available() else "cuda"))
    compiled = os.environ.get("SPECLOOP_COMPILE", "1") != "0"
    plan = Plan(device, torch.bfloat16, SHAPES, compiled=compiled)
    if args.smoke:
        plan = Plan(device, torch.bfloat16, SMOKE_SHAPES, batches=(1, 4), context=32, long_capacity=256, repeats=3,
                    warmup=1,
                    pair_batches=(1, 2), per_file=1, max_tokens=8, rounds=1, compiled=compiled, compile_guess_s=0.0)
        torch.set_num_threads(1)  # tiny shapes: threads only wait on each other (and on whatever else runs here)
    if args.shapes:
        plan.shapes = {name: plan.shapes[name] for name in args.shapes.split(",")}
    for key in ("batches", "pair_batches"):
        if getattr(args, key):
            setattr(plan, key, tuple(int(b) for b in getattr(args, key).split(",")))
    for key in ("context", "long_capacity", "repeats", "warmup", "per_file", "max_tokens", "rounds"):
        if getattr(args, key) is not None:
            setattr(plan, key, getattr(args, key))
    plan.one_pool = not args.any_length
    plan.tiles = args.out.with_suffix(".tiles.json")
    if args.paths:
        unknown = [p for p in args.paths.split(",") if p not in PATHS]
        if unknown:
            raise SystemExit(f"unknown path {unknown[0]!r}; choose from {', '.join(PATHS)}")
        plan.paths = tuple(args.paths.split(","))
    return plan


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gpu.json")
    ap.add_argument("--models", type=Path, help="DIR with verifier/ and drafter/ (the reference pair): section pair")
    ap.add_argument("--prompts", type=Path, default=ROOT.parent / "shared" / "prompts")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"in this order, from {', '.join(SECTIONS)}")
    ap.add_argument("--shapes", help=f"comma-separated, from {', '.join(SHAPES)}")
    ap.add_argument("--paths", help=f"sections paths and long: only these of {', '.join(PATHS)} (default: all)")
    ap.add_argument("--batches", help="section shapes' batch sizes (default 1,8,32)")
    ap.add_argument("--pair-batches", help="section pair's batch sizes (default 1,8)")
    ap.add_argument("--context", type=int)
    ap.add_argument("--long-capacity", type=int, help="section long: the pool's positions (default 4096)")
    ap.add_argument("--repeats", type=int)
    ap.add_argument("--warmup", type=int)
    ap.add_argument("--per-file", type=int, help="prompts from each prompt file (default 8)")
    ap.add_argument("--max-tokens", type=int)
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--systems", help="pair: only these systems (alone-graph always; default: all)")
    ap.add_argument("--fresh-controllers", action="store_true",
                    help="pair: a new controller for every batch of prompts (default: one per system, as served)")
    ap.add_argument("--weights", default="bf16", help="pair: the verifier's weight mode (weights.quant; auto: as "
                    "served, e.g. the fetched model's w4a8 on a CPU: the CPU's own figure beside a GPU's)")
    ap.add_argument("--eagle-head", type=Path, help="pair: a trained eagle head's directory (the fetched pair's drafter)")
    ap.add_argument("--any-length", action="store_true",
                    help="pair: the first --per-file prompts whatever their length (default: those of one pool shape)")
    ap.add_argument("--samples", type=int, help="section sampling: answers per arm (default 20000; 2000 on a CPU)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="skip what would not fit in this many seconds")
    ap.add_argument("--peak-gbs", type=float, help="HBM peak in GB/s (default: from the device's name)")
    ap.add_argument("--device", help="default: cuda when available (cpu with --smoke)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: the code path, not the numbers")
    return ap


def main() -> None:
    args = parser().parse_args()
    budget = Budget(args.budget_s)
    plan = make_plan(args)
    clock = Clock(plan.device)
    import transformers

    from bench.machine import machine_info

    device_name = torch.cuda.get_device_name(plan.device) if plan.cuda else f"cpu: {machine_info()['cpu']}"
    peak = peak_bandwidth(device_name, args.peak_gbs)
    header = {"benchmark": "gpu", "device": device_name, "torch": torch.__version__,
              "transformers": transformers.__version__, "dtype": str(plan.dtype).removeprefix("torch."),
              "cuda": torch.version.cuda, "peak_bytes_per_s": peak, "compiled": plan.compiled, "smoke": args.smoke,
              "tf32_matmul": torch.backends.cuda.matmul.allow_tf32, "step_path": step_path(),
              "settings": {k: v for k, v in asdict(plan).items() if k not in ("shapes", "device", "dtype")}
              | {"capacity": plan.capacity, "budget_s": args.budget_s, "sections": args.sections},
              "machine": machine_info()}
    report = Report(args.out, header, peak)
    budget.say(f"{device_name}, torch {torch.__version__}, transformers {transformers.__version__}, "
               f"compile {'on' if plan.compiled else 'off'}, HBM peak {f'{peak:.3g} B/s' if peak else 'unknown'}, "
               f"budget {args.budget_s:.0f} s")
    models = Models(plan, report, budget, clock)
    run = {"steps": steps_section, "kernels": kernels_section, "batches": batches_section, "drafter": drafter_section,
           "verify": verify_section, "compile": compile_section, "inexact": inexact_section, "paths": paths_section,
           "products": products_section,
           "long": long_section,
           "pair": lambda _: pair_section(plan, args, report, budget, clock),
           "sampling": lambda _: sampling(plan, args, report, budget),
           "anchor": lambda m: (m.free(), anchor_section(plan, report, budget, clock, m.compiles))}
    sections = args.sections.split(",")
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        raise SystemExit(f"unknown section {unknown[0]!r}; choose from {', '.join(SECTIONS)}")
    for section in sections:
        if section == "pair" and args.models is None:
            report.section("pair")["skipped"] = "no --models"
            continue
        if not budget.allows():
            report.section(section)["skipped"] = "budget"
            budget.say(f"{section}: skipped (budget)")
            continue
        budget.say(f"== {section}")
        try:
            run[section](models)
        except Exception as exc:  # one section's failure leaves the others their turn
            report.section(section)["error"] = f"{type(exc).__name__}: {str(exc)[:2000]}"
            traceback.print_exc()
        report.section("shapes")["ratios"] = ratios(report, plan)
        report.save(plot=True)
    models.free()
    report.data["elapsed_s"] = budget.elapsed()
    report.save(plot=True)
    budget.say(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
