"""Benchmark: verifier alone vs HF assisted generation vs specloop, on the reference pair.

Same prompts, max tokens and pair for every system. Writes bench/results/speculative.json,
bench/results/speculative_*.png and prints a markdown table for bench/README.md.

    .venv/bin/python bench/speculative.py --prompts-per-domain 20 --max-tokens 64 --threads 2
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specloop.drafter.decode.engine import generate  # noqa: E402
from specloop.drafter.decode.requests import StopRule  # noqa: E402
from specloop.drafter.decode.sampling import SamplingParams  # noqa: E402
from specloop.drafter.kinds.pretrained import PretrainedDrafter  # noqa: E402
from specloop.drafter.model.loading import LoadedModel, load_model  # noqa: E402
from specloop.services.prompts import encode, load_prompts  # noqa: E402

SHARED = ROOT.parent / "shared"
OUT = ROOT / "bench" / "results"


@dataclass
class Result:
    system: str  # verifier-hf | verifier-specloop | hf-assisted | specloop
    domain: str
    temperature: float
    batch: int
    k: int
    tokens: int = 0
    seconds: float = 0.0
    blocks: int = 0
    accepted: int = 0
    per_position: list[float] = field(default_factory=list)
    step_ms: dict = field(default_factory=dict)  # in-situ mean forward times: verifier (T = k+1), drafter (T = 1)
    outputs: list[list[int]] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def tau(self) -> float | None:
        return (self.accepted + self.blocks) / self.blocks if self.blocks and self.k else None

    @property
    def alpha(self) -> float | None:
        return self.accepted / (self.blocks * self.k) if self.blocks and self.k else None

    def summary(self) -> dict:
        d = asdict(self)
        d.pop("outputs")
        d.update(tokens_per_s=self.tokens_per_s, tau=self.tau, alpha=self.alpha)
        return d


def strip_eos(ids: list[int], eos: int) -> list[int]:
    return ids[: ids.index(eos)] if eos in ids else ids


class ForwardTimer:
    """Wall time of a LeanDecoder's forward passes by number of new tokens T, measured in situ."""

    def __init__(self, lean):
        self.lean, self.inner = lean, lean.forward
        self.by_T: dict[int, list[float]] = {}
        lean.forward = self._timed  # instance attribute shadows the method for this run only

    def _timed(self, cache, tokens, *args, **kwargs):
        t0 = time.perf_counter()
        out = self.inner(cache, tokens, *args, **kwargs)
        self.by_T.setdefault(tokens.shape[1], []).append(time.perf_counter() - t0)
        return out

    def mean(self, T: int) -> float:
        return statistics.mean(self.by_T[T])

    def close(self) -> None:
        del self.lean.forward


def run_specloop(v: LoadedModel, d: LoadedModel | None, prompts, k, temperature, batch, max_tokens, domain) -> Result:
    res = Result("specloop" if k else "verifier-specloop", domain, temperature, batch, k)
    timers = [ForwardTimer(v.lean)] + ([ForwardTimer(d.lean)] if k else [])
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=0)
    rule = StopRule(frozenset([v.tokenizer.eos_token_id]))
    per_pos = [0] * k
    for lo in range(0, len(prompts), batch):
        drafter = PretrainedDrafter(d.lean) if k else None
        t0 = time.perf_counter()
        gens = generate(v.lean, drafter, prompts[lo : lo + batch], params, k, rule, first_request=lo)
        res.seconds += time.perf_counter() - t0
        for g in gens:
            res.tokens += len(g.token_ids)
            res.blocks += g.stats.blocks
            res.accepted += g.stats.accepted
            per_pos = [a + b for a, b in zip(per_pos, g.stats.accepted_per_position)]
            res.outputs.append(g.token_ids)
    res.per_position = [a / res.blocks for a in per_pos] if k else []
    res.step_ms = {"verifier": timers[0].mean(k + 1) * 1e3}
    if k:
        res.step_ms["drafter"] = timers[1].mean(1) * 1e3
    for t in timers:
        t.close()
    return res


class ForwardCounter:
    """Counts forward passes of a module (HF assisted generation: one verifier pass per block)."""

    def __init__(self, module):
        self.calls = 0
        self.handle = module.register_forward_hook(self._hook)

    def _hook(self, *_):
        self.calls += 1


def hf_kwargs(temperature: float, max_tokens: int, eos: int) -> dict:
    kw = dict(max_new_tokens=max_tokens, eos_token_id=eos, pad_token_id=0)
    if temperature == 0:
        return kw | dict(do_sample=False)
    return kw | dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)


def run_hf(v: LoadedModel, d: LoadedModel | None, prompts, k, temperature, batch, max_tokens, domain) -> Result:
    """Plain transformers: `generate()` alone (d None) or with `assistant_model=d` (batch 1 only)."""
    res = Result("hf-assisted" if d else "verifier-hf", domain, temperature, batch, k)
    eos = v.tokenizer.eos_token_id
    kw = hf_kwargs(temperature, max_tokens, eos)
    if d is not None:
        cfg = d.hf.generation_config
        cfg.num_assistant_tokens, cfg.num_assistant_tokens_schedule = k, "constant"
        cfg.assistant_confidence_threshold = 0.0  # always draft k: the same policy as specloop
        kw["assistant_model"] = d.hf
    counter = ForwardCounter(v.hf)
    torch.manual_seed(0)
    for lo in range(0, len(prompts), batch):
        rows = prompts[lo : lo + batch]
        width = max(map(len, rows))
        ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])  # left padding
        mask = (torch.arange(width)[None] >= torch.tensor([width - len(r) for r in rows])[:, None]).long()
        calls0 = counter.calls
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = v.hf.generate(ids, attention_mask=mask, **kw)
        res.seconds += time.perf_counter() - t0
        for row in out[:, width:].tolist():
            row = strip_eos(row, eos)
            res.tokens += len(row)
            res.outputs.append(row)
        if d is not None:
            res.blocks += counter.calls - calls0 - 1  # minus the prefill pass
    counter.handle.remove()
    if d is not None:
        res.accepted = res.tokens - res.blocks  # each block emits n + 1 tokens
    return res


def time_forward(lean, context: int, T: int, reps: int = 60) -> float:
    cache = lean.new_cache(1, context + T + 1)
    lean.forward(cache, torch.randint(5, 1000, (1, context)))
    base = cache.lens.clone()
    x = torch.randint(5, 1000, (1, T))
    for _ in range(10):
        cache.lens = base.clone()
        lean.forward(cache, x)
    times = []
    for _ in range(reps):
        cache.lens = base.clone()
        t0 = time.perf_counter()
        lean.forward(cache, x)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cost_model(v: LoadedModel, d: LoadedModel, ks, context: int) -> dict:
    """c = drafter step / verifier step; v_k = verify(k+1) / verify(1)."""
    t_v1 = time_forward(v.lean, context, 1)
    t_d1 = time_forward(d.lean, context, 1)
    out = {"context": context, "verifier_step_ms": t_v1 * 1e3, "drafter_step_ms": t_d1 * 1e3, "c": t_d1 / t_v1}
    for k in ks:
        out[f"v_{k}"] = time_forward(v.lean, context, k + 1) / t_v1
    return out


def load_domain(path: Path, n: int, tok) -> list[list[int]]:
    return [encode(tok, r) for r in load_prompts(path, n)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models", type=Path, default=SHARED / "models")
    ap.add_argument("--prompts-per-domain", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ks", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    v, d = load_model(args.models / "verifier"), load_model(args.models / "drafter")
    domains = {
        "chat": load_domain(SHARED / "prompts" / "chat_dev.jsonl", args.prompts_per_domain, v.tokenizer),
        "code": load_domain(SHARED / "prompts" / "code_dev.jsonl", args.prompts_per_domain, v.tokenizer),
    }
    run_specloop(v, d, domains["chat"][:2], 4, 0.0, 1, 8, "warmup")
    run_hf(v, d, domains["chat"][:2], 4, 0.0, 1, 8, "warmup")
    results: list[Result] = []
    mt = args.max_tokens
    for domain, prompts in domains.items():
        for temp in (0.0, 1.0):
            for batch in (1, 4):
                results.append(run_hf(v, None, prompts, 0, temp, batch, mt, domain))
                results.append(run_specloop(v, None, prompts, 0, temp, batch, mt, domain))
                for k in args.ks:
                    if batch == 1:  # HF assisted generation supports batch 1 only
                        results.append(run_hf(v, d, prompts, k, temp, batch, mt, domain))
                    results.append(run_specloop(v, d, prompts, k, temp, batch, mt, domain))
                print(f"done {domain} T={temp} batch={batch}", file=sys.stderr)
    context = int(statistics.mean(len(p) for ps in domains.values() for p in ps)) + mt // 2
    costs = cost_model(v, d, args.ks, context)
    report = build_report(results, costs, args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "speculative.json").write_text(json.dumps(report, separators=(",", ":")) + "\n")
    plot(report, args.out)
    print(markdown(report))
    return 0


def find(results, **kw) -> Result | None:
    return next((r for r in results if all(getattr(r, a) == b for a, b in kw.items())), None)


def build_report(results: list[Result], costs: dict, args) -> dict:
    rows = []
    for r in results:
        row = r.summary()
        base = find(results, system="verifier-specloop", domain=r.domain, temperature=r.temperature, batch=r.batch)
        hf_ref = find(results, system="verifier-hf", domain=r.domain, temperature=r.temperature, batch=r.batch)
        row["speedup_vs_verifier_specloop"] = r.tokens_per_s / base.tokens_per_s
        row["speedup_vs_verifier_hf"] = r.tokens_per_s / hf_ref.tokens_per_s
        if r.system == "specloop":
            # cost model with c and v_k measured in situ (during this run and the verifier-alone run)
            t1 = base.step_ms["verifier"]
            c, vk = r.step_ms["drafter"] / t1, r.step_ms["verifier"] / t1
            row.update(c_in_situ=c, v_k_in_situ=vk)
            row["predicted_speedup"] = r.tau / (r.k * c + vk)
            row["predicted_speedup_isolated"] = r.tau / (r.k * costs["c"] + costs[f"v_{r.k}"])
            row["break_even_c"] = (r.tau - vk) / r.k  # speculation pays while c is below this
            hf = find(results, system="hf-assisted", domain=r.domain, temperature=r.temperature, batch=1, k=r.k)
            if hf and r.batch == 1:
                row["vs_hf_assisted"] = r.tokens_per_s / hf.tokens_per_s
        if r.temperature == 0:
            ref = hf_ref if r.batch == 1 else find(results, system="verifier-hf", domain=r.domain, temperature=0.0, batch=1)
            row["greedy_identical_to_verifier_hf"] = sum(a == b for a, b in zip(r.outputs, ref.outputs))
            row["prompts"] = len(r.outputs)
        rows.append(row)
    return {
        "config": {"prompts_per_domain": args.prompts_per_domain, "max_tokens": args.max_tokens, "threads": args.threads,
                   "models": str(args.models), "device": "cpu", "torch": torch.__version__},
        "cost_model": costs,
        "rows": rows,
    }


def fmt(x, spec=".2f") -> str:
    return "–" if x is None else format(x, spec)


def markdown(report: dict) -> str:
    head = "| domain | T | batch | system | k | tokens/s | τ | α | per-position acceptance | × verifier (specloop) | × HF assisted | predicted × (in situ c, v_k) | c, v_k in situ | break-even c | greedy identical |"
    lines = [head, "|" + "---|" * 15]
    for r in report["rows"]:
        pp = " ".join(f"{x:.2f}" for x in r["per_position"])
        same = f"{r['greedy_identical_to_verifier_hf']}/{r['prompts']}" if "prompts" in r else "–"
        lines.append(
            f"| {r['domain']} | {r['temperature']:g} | {r['batch']} | {r['system']} | {r['k'] or '–'} | "
            f"{r['tokens_per_s']:.0f} | {fmt(r['tau'])} | {fmt(r['alpha'])} | {pp or '–'} | "
            f"{r['speedup_vs_verifier_specloop']:.2f} | {fmt(r.get('vs_hf_assisted'))} | "
            f"{fmt(r.get('predicted_speedup'))} | "
            + (f"{r['c_in_situ']:.2f}, {r['v_k_in_situ']:.2f} | {r['break_even_c']:.2f}" if "c_in_situ" in r else "– | –")
            + f" | {same} |"
        )
    c = report["cost_model"]
    lines.append("")
    lines.append(
        f"Isolated (hot-cache) cost model at context {c['context']}: verifier step {c['verifier_step_ms']:.2f} ms, drafter step "
        f"{c['drafter_step_ms']:.2f} ms, c = {c['c']:.3f}, "
        + ", ".join(f"{k} = {v:.2f}" for k, v in c.items() if k.startswith("v_"))
    )
    return "\n".join(lines)


def plot(report: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["rows"] if r["batch"] == 1]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, temp in zip(axes, (0.0, 1.0)):
        sel = [r for r in rows if r["temperature"] == temp]
        labels = [f"{r['domain']}\n{r['system']}" + (f"\nk={r['k']}" if r["k"] else "") for r in sel]
        colors = {"verifier-hf": "#999", "verifier-specloop": "#555", "hf-assisted": "#e69f00", "specloop": "#0072b2"}
        ax.bar(range(len(sel)), [r["tokens_per_s"] for r in sel], color=[colors[r["system"]] for r in sel])
        ax.set_xticks(range(len(sel)), labels, fontsize=6, rotation=90)
        ax.set_ylabel("tokens/s (batch 1)")
        ax.set_title(f"T = {temp:g}")
    fig.tight_layout()
    fig.savefig(out / "speculative_throughput.png", dpi=120)
    plt.close(fig)

    spec = [r for r in report["rows"] if r["system"] == "specloop"]
    fig, ax = plt.subplots(figsize=(5, 5))
    for r in spec:
        ax.scatter(r["predicted_speedup"], r["speedup_vs_verifier_specloop"], c="#0072b2" if r["domain"] == "chat" else "#d55e00")
    lim = [0, max(1.2, max(max(r["predicted_speedup"], r["speedup_vs_verifier_specloop"]) for r in spec) * 1.1)]
    ax.plot(lim, lim, "k--", lw=1)
    ax.set_xlabel("predicted speedup τ/(k·c + v_k)")
    ax.set_ylabel("measured speedup vs verifier alone")
    ax.set_title("cost model (blue chat, orange code)")
    fig.tight_layout()
    fig.savefig(out / "speculative_cost_model.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in spec:
        if r["batch"] == 1:
            ax.plot(range(1, r["k"] + 1), r["per_position"], marker="o", label=f"{r['domain']} T={r['temperature']:g} k={r['k']}")
    ax.set_xlabel("draft position")
    ax.set_ylabel("P(position accepted)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "speculative_per_position.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
