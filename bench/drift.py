"""Drift benchmark: traffic chat → code → chat through `specloop replay`, learner off / kl / klrl / lk.

Every run serves the same request stream (the first N1 chat prompts, N2 code prompts, the next N3
chat prompts of ../shared/prompts) with the verifier worker and the learner as Ray actors, exactly
as `specloop replay` does, and records τ per request. Targets (issue: the online loop):
- code: online τ ≥ 1.35 × frozen (learner off) within 200 requests of the switch;
- code: ≥ 90 % of an offline-trained oracle (the drafter trained offline on code, served frozen)
  within 500 requests;
- back on chat: τ ≥ 0.98 × frozen (no forgetting); klrl or lk beats kl.

    .venv/bin/python bench/drift.py --kinds pretrained --learners off kl klrl lk --temperatures 0 \
        --segments 100 300 100 --oracle runs/oracle-code --tag pretrained

Or any list of runs KIND:LEARNER, where KIND may carry speculators chosen per step beside the drafter
(drafter/kinds/mix.py: eagle+static+suffix), `none` is the verifier alone (tokens/s reference) and
`--frozen KIND` names the learner-off run every ratio is taken against:

    M=~/.cache/specloop/models/smollm2-135m-instruct
    .venv/bin/python bench/drift.py --verifier $M/verifier --drafter $M/drafter --k auto --frozen eagle \
        --runs none:off suffix:off eagle:off eagle:klrl eagle+static+suffix:klrl --tag real
Writes bench/results/drift_<tag>.json and drift_<tag>.png (τ against request index).
"""
from __future__ import annotations

import argparse
import ast
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from machine import machine_info  # noqa: E402

SHARED = ROOT.parent / "shared"
OUT = ROOT / "bench" / "results"
SMOOTH = 50  # requests in the rolling mean used for ratios and recovery


def traffic_files(tmp: Path, segments: tuple[int, int, int]) -> list[Path]:
    """chat[0:N1], code[0:N2], chat[N1:N1+N3] as three prompt files."""
    chat = (SHARED / "prompts" / "chat_dev.jsonl").read_text().splitlines()
    code = (SHARED / "prompts" / "code_dev.jsonl").read_text().splitlines()
    n1, n2, n3 = segments
    if n1 + n3 > len(chat) or n2 > len(code):
        raise SystemExit(f"segments {segments} exceed the prompt sets ({len(chat)} chat, {len(code)} code)")
    parts = [chat[:n1], code[:n2], chat[n1:n1 + n3]]
    tmp.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, lines in zip(("chat1", "code", "chat2"), parts):
        path = tmp / f"{name}.jsonl"
        path.write_text("\n".join(lines) + "\n")
        paths.append(path)
    return paths


def learner_settings(text: str) -> dict:
    """"lr=1e-4,batch_records=64" -> LearnerConfig overrides (values read as Python literals); an unknown
    field is refused here, before any run starts."""
    from specloop.trainer.online import LearnerConfig

    out = dict(pair.split("=", 1) for pair in filter(None, text.split(",")))
    unknown = set(out) - set(LearnerConfig.__dataclass_fields__)
    if unknown:
        fields = sorted(LearnerConfig.__dataclass_fields__)
        raise SystemExit(f"unknown learner settings {sorted(unknown)}; LearnerConfig has {fields}")
    return {key: ast.literal_eval(value) for key, value in out.items()}


def run_one(args, kind: str, learner: str, temperature: float, drafter: Path | None, files: list[Path],
            settings: str = "") -> dict:
    from specloop.services.cli.replay_traffic import Replay, ReplayConfig

    base, *speculators = kind.split("+")
    alone = base == "none"  # the verifier alone: k = 0 with a drafter that never drafts
    cfg = ReplayConfig(verifier=args.verifier, drafter=None if alone or base in ("suffix", "ngram") else drafter,
                       kind="suffix" if alone else base, prompts=files, learner=learner, buffer=args.buffer,
                       max_tokens=args.max_tokens, k=0 if alone else args.k, temperature=temperature, seed=args.seed,
                       worker_overrides={"speculators": tuple(speculators)} if speculators else {},
                       learner_overrides=learner_settings(settings))
    t0 = time.perf_counter()
    replay = Replay(cfg)
    rows = []
    for r in replay.run(progress=not args.quiet):
        row = asdict(r)
        rows.append({key: row[key] for key in ("index", "drafter_version", "drafted", "accepted", "block_efficiency",
                                                "blocks", "seconds")} | {"tokens": len(r.token_ids)})
    summary = replay.finish()
    label = f"{learner} ({settings})" if settings else learner  # the learner's objective and its settings
    return {"kind": kind, "learner": label, "temperature": temperature, "drafter": str(drafter),
            "wall_s": round(time.perf_counter() - t0, 1), "requests": rows, "summary": _slim(summary)}


def _slim(summary) -> dict:
    """The JSON part of a run's `specloop.services.cli.replay_traffic.ReplaySummary`."""
    w = summary.worker
    out = {"swap_stall_ms": w.swap_stall_ms, "swaps": len(w.swaps), "rollbacks": w.rollbacks,
           "stale_blocks": asdict(w.stale_blocks), "records": None if w.records is None else asdict(w.records)}
    if summary.learner is not None:
        lrn = summary.learner
        out["learner"] = {"updates": lrn.learner.updates, "records_seen": lrn.learner.records_seen,
                          "stale_skipped": lrn.learner.stale_skipped, "published": len(lrn.published),
                          "promoted": sum(p.promoted for p in lrn.published),
                          "refused": [p.reason for p in lrn.published if not p.promoted][-5:],
                          "canaries": len(lrn.canaries),
                          "canary_rollbacks": [asdict(c) for c in lrn.canaries if c.rolled_back],
                          "error": lrn.error}
    if summary.buffer is not None:
        out["buffer"] = asdict(summary.buffer)
    return out


# ----------------------------------------------------------------------------- analysis


def taus(run: dict) -> list[float]:
    return [r["block_efficiency"] for r in run["requests"]]


def rolling(values: list[float], n: int = SMOOTH) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v - (values[i - n] if i >= n else 0.0)
        out.append(acc / min(i + 1, n))
    return out


def segment_means(run: dict, segments) -> dict:
    t = taus(run)
    n1, n2, n3 = segments
    code = t[n1:n1 + n2]
    return {"chat1": statistics.mean(t[:n1]), "code": statistics.mean(code),
            "code_first200": statistics.mean(code[:200]), "code_last100": statistics.mean(code[-100:]),
            "chat2": statistics.mean(t[n1 + n2:])}


def requests_to(run: dict, reference: list[float], ratio: float, segments) -> int | None:
    """First code request (counted from the switch) where the rolling τ reaches ratio × reference's."""
    n1, n2, _ = segments
    mine, ref = rolling(taus(run)[n1:n1 + n2]), rolling(reference[n1:n1 + n2])
    return next((i + 1 for i, (a, b) in enumerate(zip(mine, ref)) if i >= SMOOTH - 1 and a >= ratio * b), None)


def serving_ms_per_block(run: dict) -> float:
    """Median over requests of decode seconds per block (what the learner's CPU share costs a step)."""
    return 1e3 * statistics.median(r["seconds"] / r["blocks"] for r in run["requests"] if r["blocks"])


def tokens_per_s(run: dict) -> float:
    return sum(r["tokens"] for r in run["requests"]) / sum(r["seconds"] for r in run["requests"])


def analyse(runs: list[dict], oracle: dict | None, segments, frozen_kind: str | None = None) -> list[dict]:
    table = []
    for run in runs:
        if run["kind"] == "none":
            continue
        want = frozen_kind or run["kind"]
        frozen = next(r for r in runs if r["kind"] == want and r["temperature"] == run["temperature"]
                      and r["learner"] == "off")
        alone = next((r for r in runs if r["kind"] == "none" and r["temperature"] == run["temperature"]), None)
        seg, ref = segment_means(run, segments), segment_means(frozen, segments)
        row = {"kind": run["kind"], "learner": run["learner"], "temperature": run["temperature"], **seg,
               "code_first200_vs_frozen": seg["code_first200"] / ref["code_first200"],
               "chat2_vs_frozen": seg["chat2"] / ref["chat2"],
               "requests_to_1.35x_frozen": requests_to(run, taus(frozen), 1.35, segments),
               "ms_per_block": serving_ms_per_block(run),
               "tokens_per_s": tokens_per_s(run),
               "vs_verifier_alone": None if alone is None else tokens_per_s(run) / tokens_per_s(alone),
               "swap_stall_ms": run["summary"]["swap_stall_ms"]}
        if oracle is not None and oracle["temperature"] == run["temperature"]:
            o = segment_means(oracle, segments)
            row["oracle_code"] = o["code"]
            row["code_last100_vs_oracle"] = seg["code_last100"] / o["code"]
            row["requests_to_0.9x_oracle"] = requests_to(run, taus(oracle), 0.9, segments)
        table.append(row)
    return table


def markdown(table: list[dict]) -> str:
    """The README table: τ per segment, ratios, requests to recover, serving cost."""
    head = ("| kind | T | learner | chat1 τ | code τ (first 200) | code τ (last 100) | chat2 τ | code vs frozen |"
            " req. to 1.35× | last 100 vs oracle | req. to 0.9× oracle | chat2 vs frozen | ms/block | tokens/s |"
            " × verifier alone |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in table:
        opt = lambda key, fmt: "–" if r.get(key) is None else format(r[key], fmt)  # noqa: E731
        lines.append(f"| {r['kind']} | {r['temperature']:g} | {r['learner']} | {r['chat1']:.2f} | {r['code_first200']:.2f} |"
                     f" {r['code_last100']:.2f} | {r['chat2']:.2f} | {r['code_first200_vs_frozen']:.2f}× |"
                     f" {opt('requests_to_1.35x_frozen', 'd')} | {opt('code_last100_vs_oracle', '.2f')} |"
                     f" {opt('requests_to_0.9x_oracle', 'd')} | {r['chat2_vs_frozen']:.2f}× | {r['ms_per_block']:.1f} |"
                     f" {r['tokens_per_s']:.1f} | {opt('vs_verifier_alone', '.2f')} |")
    return "\n".join(lines)


def plot(runs: list[dict], oracle: dict | None, segments, path: Path, together: bool = False,
         oracle_label: str = "oracle (offline on code)") -> None:
    """τ (rolling 20) against the request index: one panel per kind and temperature, or with
    `together` (runs of several kinds compared: --frozen) every run in one panel per temperature."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = sorted({r["temperature"] for r in runs})
    if together:
        runs = [dict(r, learner=f"{r['kind']} ({r['learner']})", kind="all") for r in runs if r["kind"] != "none"]
    kinds = sorted({r["kind"] for r in runs})
    fig, axes = plt.subplots(len(kinds), len(temps), figsize=(7 * len(temps), 3.6 * len(kinds)), squeeze=False)
    for i, kind in enumerate(kinds):
        for j, temp in enumerate(temps):
            ax = axes[i][j]
            for run in (r for r in runs if r["kind"] == kind and r["temperature"] == temp):
                ax.plot(rolling(taus(run), 20), label=run["learner"], lw=1.2)
            if oracle is not None and (together or oracle["kind"] == kind) and oracle["temperature"] == temp:
                ax.plot(rolling(taus(oracle), 20), label=oracle_label, lw=1, ls="--", color="gray")
            for x in (segments[0], segments[0] + segments[1]):
                ax.axvline(x, color="black", lw=0.6, ls=":")
            ax.set_title(f"{'' if together else kind + ', '}T={temp:g}: chat → code → chat")
            ax.set_xlabel("request")
            ax.set_ylabel("τ (rolling 20)")
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--verifier", type=Path, default=SHARED / "models" / "verifier")
    p.add_argument("--drafter", type=Path, default=SHARED / "models" / "drafter")
    p.add_argument("--drafter-of", nargs="+", default=[], metavar="KIND=DIR",
                   help="another drafter directory for runs of KIND (e.g. eagle3=runs/eagle3)")
    p.add_argument("--kinds", nargs="+", default=["pretrained"])
    p.add_argument("--learners", nargs="+", default=["off", "kl", "klrl", "lk"])
    p.add_argument("--temperatures", nargs="+", type=float, default=[0.0])
    p.add_argument("--segments", nargs=3, type=int, default=[100, 300, 100])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--k", type=lambda s: None if s == "auto" else int(s), default=4, help="K or auto")
    p.add_argument("--runs", nargs="+", metavar="KIND:LEARNER[:SETTINGS]",
                   help="instead of --kinds x --learners; SETTINGS: LearnerConfig fields, "
                        "e.g. lr=1e-4,batch_records=64")
    p.add_argument("--frozen", help="the learner-off kind every ratio is taken against (default: the run's own)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--buffer", default="memory")
    p.add_argument("--oracle", type=Path, help="drafter trained offline on code (served frozen, pretrained kind)")
    p.add_argument("--oracle-kind", default="pretrained")
    p.add_argument("--oracle-label", default="oracle (offline on code)", help="the oracle's name in the plot")
    p.add_argument("--tag", default="pretrained")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--replot", type=Path, help="redraw the PNG (and print the table) of a results JSON, run nothing")
    args = p.parse_args()
    if args.replot is not None:
        saved = json.loads(args.replot.read_text())
        segs = tuple(saved["segments"])
        plot(saved["runs"], saved["oracle"], segs, args.replot.with_suffix(".png"), together=args.frozen is not None,
             oracle_label=args.oracle_label)
        print(markdown(analyse(saved["runs"], saved["oracle"], segs, args.frozen)))
        return
    segments = tuple(args.segments)
    files = traffic_files(Path(tempfile.mkdtemp(prefix="specloop-drift-")), segments)
    OUT.mkdir(parents=True, exist_ok=True)
    out = OUT / f"drift_{args.tag}.json"
    runs = []
    oracle = None
    for temp in args.temperatures:
        if args.oracle is not None:
            oracle = run_one(args, args.oracle_kind, "off", temp, args.oracle, files)
        plan = [tuple(r.split(":")) for r in args.runs] if args.runs else [
            (kind, learner) for kind in args.kinds for learner in args.learners]
        for _, _, *settings in plan:
            learner_settings(*settings)  # a typo fails now, not after the runs before it
        for kind, learner, *settings in plan:
            own = dict(pair.split("=", 1) for pair in args.drafter_of)
            base = kind.split("+")[0]
            drafter = None if kind == "dvi" else Path(own[base]).expanduser() if base in own else args.drafter
            runs.append(run_one(args, kind, learner, temp, drafter, files, *settings))
            ready = any(r["learner"] == "off" and r["kind"] == (args.frozen or r["kind"]) for r in runs)
            table = analyse(runs, oracle, segments, args.frozen) if ready and runs[-1]["kind"] != "none" else []
            out.write_text(json.dumps({"machine": machine_info(), "segments": segments, "max_tokens": args.max_tokens,
                                       "k": args.k, "table": table, "oracle": oracle, "runs": runs}, separators=(",", ":")) + "\n")
            print(json.dumps(table[-1] if table else {}, default=str), file=sys.stderr)
    plot(runs, oracle, segments, OUT / f"drift_{args.tag}.png", together=args.frozen is not None,
         oracle_label=args.oracle_label)
    if any(r["learner"] == "off" for r in runs):  # the ratios need the frozen run
        print(markdown(analyse(runs, oracle, segments, args.frozen)))


if __name__ == "__main__":
    main()
