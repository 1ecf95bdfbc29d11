"""Benchmark: speculation as users measure it, whole `specloop generate` processes, default against
`--no-speculation`, alternating.

Each condition (prompt set, temperature, batch size) runs both systems as separate processes
(start-up, model load, prefill and decode all counted), one after the other, the first system
alternating round by round; tokens/s = new tokens / the process's wall time, and in-process
tokens/s as the process itself reports them (its summary line). Ratios are per round
(default / alone), then the median over rounds. Every process gets --threads explicitly.

    .venv/bin/python bench/whole_process.py --rounds 3 --out bench/results/whole_process.json

Prompts: the last --prompts-per-set prompts of each set (held out from the fetched drafter's
self-distillation, which reads from the start of the sets).
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHARED = ROOT.parent / "shared" / "prompts"
# every answer one JSON object (`specloop generate --json-schema`): structured output as users run it
ANSWER = json.dumps({"type": "object", "properties": {"topic": {"type": "string", "maxLength": 40},
                                                      "answer": {"type": "string", "maxLength": 300},
                                                      "confident": {"type": "boolean"}},
                     "required": ["topic", "answer", "confident"], "additionalProperties": False})
# (name, prompt file, temperature, batch size, extra flags for both systems)
CONDITIONS = (("chat T=0", "chat_dev.jsonl", 0.0, 1, ()), ("chat T=1", "chat_dev.jsonl", 1.0, 1, ()),
              ("chat T=1.3", "chat_dev.jsonl", 1.3, 1, ()), ("code T=0", "code_dev.jsonl", 0.0, 1, ()),
              ("chat T=1.3 batch 8", "chat_dev.jsonl", 1.3, 8, ()),
              ("chat JSON T=0", "chat_dev.jsonl", 0.0, 1, ("--json-schema", ANSWER)))
SYSTEMS = {"alone": ["--no-speculation"], "default": []}
PAIR = Path.home() / ".cache" / "specloop" / "models" / "smollm2-135m-instruct"  # `specloop models fetch`
SUMMARY = re.compile(r"(\d+) prompts, (\d+) tokens in ([\d.]+)s = ([\d.]+) tokens/s")


def held_out(path: Path, n: int, into: Path) -> Path:
    lines = [line for line in path.read_text().splitlines() if line.strip()][-n:]
    into.write_text("\n".join(lines) + "\n")
    return into


def run(system: str, prompts: Path, temperature: float, batch: int, args, extra: tuple[str, ...] = ()) -> dict:
    cmd = [str(ROOT / ".venv" / "bin" / "specloop"), "generate", str(args.pair / "verifier"), "--drafter",
           str(args.pair / "drafter"), "--prompts", str(prompts), "--threads", str(args.threads),
           "--max-tokens", str(args.max_tokens), "--temperature", str(temperature), "--batch-size", str(batch),
           "--seed", "0", "--json", *extra, *SYSTEMS[system]]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - start
    found = SUMMARY.search(done.stderr)
    tokens = int(found.group(2)) if found else sum(len(json.loads(line)["token_ids"]) for line in done.stdout.splitlines())
    taus = [json.loads(line)["stats"]["block_efficiency"] for line in done.stdout.splitlines() if line.startswith("{")]
    return {"system": system, "wall_s": wall, "tokens": tokens, "whole_tps": tokens / wall,
            "inproc_tps": float(found.group(4)) if found else None, "tau": statistics.mean(taus) if taus else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts-per-set", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pair", type=Path, default=PAIR, help="a fetched pair: verifier/ and drafter/")
    ap.add_argument("--conditions", default=",".join(c[0] for c in CONDITIONS))
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "whole_process.json")
    args = ap.parse_args()
    from bench.machine import machine_info

    wanted = {c.strip() for c in args.conditions.split(",")}
    tmp = Path(tempfile.mkdtemp(prefix="specloop-whole-"))
    results = []
    for name, file, temperature, batch, extra in (c for c in CONDITIONS if c[0] in wanted):
        prompts = held_out(SHARED / file, args.prompts_per_set, tmp / file)
        rounds = []
        for r in range(args.rounds):
            order = list(SYSTEMS) if r % 2 == 0 else list(reversed(SYSTEMS))
            got = {s: run(s, prompts, temperature, batch, args, extra) for s in order}
            rounds.append(got)
            print(f"{name} round {r + 1}: " + "  ".join(
                f"{s} {g['whole_tps']:.1f} tok/s whole ({g['inproc_tps']} in-process, τ {g['tau'] or 0:.2f})"
                for s, g in got.items()), flush=True)
        whole = [g["default"]["whole_tps"] / g["alone"]["whole_tps"] for g in rounds]
        inproc = [g["default"]["inproc_tps"] / g["alone"]["inproc_tps"] for g in rounds]
        results.append({"condition": name, "temperature": temperature, "batch": batch, "rounds": rounds,
                        "whole_ratio": whole, "whole_median": statistics.median(whole),
                        "inproc_ratio": inproc, "inproc_median": statistics.median(inproc)})
        print(f"== {name}: default / alone whole process {statistics.median(whole):.3f}× "
              f"(rounds {', '.join(f'{x:.2f}' for x in whole)}), in-process {statistics.median(inproc):.3f}×", flush=True)
    out = {"machine": machine_info(), "threads": args.threads, "max_tokens": args.max_tokens,
           "prompts_per_set": args.prompts_per_set, "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, separators=(",", ":")) + "\n")
    plot(results, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and .png")


def plot(results: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    names = [r["condition"] for r in results]
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [r["whole_median"] for r in results], 0.4, label="whole process")
    ax.bar([i + 0.2 for i in x], [r["inproc_median"] for r in results], 0.4, label="in-process")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(0.97, color="r", lw=0.8, ls="--", label="0.97× (never slower)")
    ax.set_xticks(list(x), names, rotation=15)
    ax.set_ylabel("default / --no-speculation")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
