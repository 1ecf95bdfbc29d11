"""Issue 28's targets read off bench/gpu.py's results: one line each, met / unmet / not measured.

A GPU session has minutes, not hours: each stage of bench/gpu_calls.py ends by printing this table for what its
$OUT holds, so the call's own output says where the targets stand. Pure reads of the JSON; nothing is timed here.

    python3 bench/gpu_targets.py $OUT/gpu.json $OUT/fetched.json $OUT/b16.json
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CPU_FETCHED = ROOT / "bench" / "results" / "gpu_fetched_cpu.json"  # the fetched pair alone on the CPU (section 39)


@dataclass(frozen=True)
class Target:
    name: str
    value: float | str | None  # None: not measured in these results
    goal: str
    met: bool | None

    def line(self) -> str:
        verdict = "not measured" if self.met is None else "MET" if self.met else "unmet"
        shown = "-" if self.value is None else f"{self.value:.3g}" if isinstance(self.value, float) else self.value
        return f"{self.name:62s} {shown:>14s}  {self.goal:8s} {verdict}"


def at_least(name: str, value: float | None, goal: float, suffix: str = "") -> Target:
    return Target(name, value, f">= {goal}{suffix}", None if value is None else value >= goal)


def at_most(name: str, value: float | None, goal: float) -> Target:
    return Target(name, value, f"<= {goal}", None if value is None else value <= goal)


def merged(results: list[dict]) -> dict:
    """Rows of every file; sections by name, the later file's where two have one (a stage's own file wins)."""
    rows = [r for d in results for r in d.get("rows", [])]
    sections: dict = {}
    for d in results:
        for name, section in d.get("sections", {}).items():
            if isinstance(section, dict):
                sections.setdefault(name, {}).update(section)
    return {"rows": rows, "sections": sections}


def roofline(data: dict, model: str) -> tuple[float | None, str]:
    """The best fraction of the HBM roofline at batch 1 over the default step and every path run (W = 5)."""
    rows = [r for r in data["rows"] if r.get("section") == "shapes" and r.get("model") == model and r.get("batch") == 1
            and r.get("width") == 5 and str(r.get("path", "")).startswith("graph") and "replay" not in r["path"]
            and "hbm_fraction" in r]
    if not rows:
        return None, ""
    best = max(rows, key=lambda r: r["hbm_fraction"])
    return best["hbm_fraction"], best["path"]


def w5_over_w1(data: dict, batch: int) -> float | None:
    step = {r["width"]: r["ms"] for r in data["rows"] if r.get("section") == "shapes" and r.get("path") == "graph"
            and r.get("model") == "smollm2-1.7b" and r.get("batch") == batch and r.get("width") in (1, 5)}
    return step[5] / step[1] if len(step) == 2 else None


def pair_systems(data: dict, batch: int) -> dict:
    entry = data["sections"].get("pair", {}).get(f"batch_{batch}")
    return entry.get("systems", {}) if isinstance(entry, dict) else {}


def identity(data: dict) -> Target:
    """Every drafter's greedy output equal to its reference's (the verifier alone on the same engine and path) at
    batch 1 and 8 (the verifier alone on other paths, other kernels, is no drafter: not counted)."""
    seen = [(b, n, s["identical_to_graph_alone"]) for b in (1, 8) for n, s in pair_systems(data, b).items()
            if not n.startswith("alone") and s.get("tokens_per_s_median")]
    if not seen:
        return Target("greedy identity, every drafter, batch 1 and 8", None, "all", None)
    wrong = [f"{n}@b{b} {x}" for b, n, x in seen if x.split("/")[0] != x.split("/")[1]]
    return Target("greedy identity, every drafter, batch 1 and 8", f"{len(seen) - len(wrong)}/{len(seen)} systems",
                  "all", not wrong)


def speedups(data: dict, batch: int, auto_only: bool) -> dict[str, float]:
    return {n: s["x_alone_graph"] for n, s in pair_systems(data, batch).items()
            if not n.startswith("alone") and s.get("x_alone_graph") is not None
            and (not auto_only or "-auto" in n)}


def sampling(data: dict) -> Target:
    verdict = data["sections"].get("sampling", {}).get("verdict")
    if not verdict:
        return Target("chi-square on the device, bf16, graph step", None, "holds", None)
    return Target("chi-square on the device, bf16, graph step", f"min p {verdict['min_pvalue']:.3g}", "holds",
                  verdict["holds"] and verdict["wrong_sampler_caught"])


def fetched_over_cpu(fetched: dict, cpu: dict, batch: int) -> float | None:
    gpu = pair_systems(fetched, batch).get("alone-graph", {}).get("tokens_per_s_median")
    here = pair_systems(cpu, batch).get("alone-eager", {}).get("tokens_per_s_median")
    return gpu / here if gpu and here else None


def targets(main: dict, fetched: dict, cpu: dict) -> list[Target]:
    r17, p17 = roofline(main, "smollm2-1.7b")
    r8, p8 = roofline(main, "llama-3.1-8b")
    hf = [r["ms"] for r in main["rows"] if r.get("path") == "hf-compiled" and r.get("model") == "smollm2-1.7b"]
    ours = [r["ms"] for r in main["rows"] if r.get("section") == "shapes" and r.get("path") == "graph"
            and r.get("model") == "smollm2-1.7b" and r.get("batch") == 1 and r.get("width") == 5]
    b1 = speedups(main, 1, auto_only=False)
    b8 = speedups(main, 8, auto_only=True)
    eagle = {n: x for n, x in speedups(fetched, 1, auto_only=False).items() if n.startswith("eagle")}
    return [
        at_least(f"1.7B roofline, batch 1 ({p17 or '-'})", r17, 0.6),
        at_least(f"8B roofline, batch 1 ({p8 or '-'})", r8, 0.7),
        at_least("1.7B step over compiled transformers", hf[0] / ours[0] if hf and ours else None, 1.2),
        at_most("verify of 5 / one-token step, batch 1", w5_over_w1(main, 1), 1.10),
        at_most("verify of 5 / one-token step, batch 16", w5_over_w1(main, 16), 1.3),
        identity(main),
        sampling(main),
        at_least(f"reference pair, best drafter, batch 1 ({max(b1, key=b1.get) if b1 else '-'})",
                 max(b1.values()) if b1 else None, 1.3),
        at_least(f"reference pair, k auto, batch 8, lowest ({min(b8, key=b8.get) if b8 else '-'})",
                 min(b8.values()) if b8 else None, 0.97),
        at_least("fetched pair alone, GPU / CPU tokens/s, batch 1", fetched_over_cpu(fetched, cpu, 1), 10.0),
        at_least("fetched pair alone, GPU / CPU tokens/s, batch 8", fetched_over_cpu(fetched, cpu, 8), 10.0),
        at_least(f"fetched pair, eagle over alone, batch 1 ({max(eagle, key=eagle.get) if eagle else '-'})",
                 max(eagle.values()) if eagle else None, 1.3),
    ]


def load(paths: list[Path]) -> tuple[dict, dict, dict]:
    """(every file but the fetched pair's, the fetched pair's, the CPU's figure of the fetched pair)."""
    read = {p: json.loads(p.read_text()) for p in paths if p.is_file()}
    fetched = [d for p, d in read.items() if p.stem.startswith("fetched")]
    main = [d for p, d in read.items() if not p.stem.startswith("fetched")]
    cpu = json.loads(CPU_FETCHED.read_text()) if CPU_FETCHED.is_file() else {}
    return merged(main), merged(fetched), merged([cpu])


def main(argv: list[str]) -> int:
    main_data, fetched, cpu = load([Path(a) for a in argv])
    device = next((r["device"] for r in main_data["rows"] + fetched["rows"] if r.get("device")), "?")
    print(f"issue 28's targets on {device} ({len(argv)} result file(s)):")
    for t in targets(main_data, fetched, cpu):
        print("  " + t.line())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
