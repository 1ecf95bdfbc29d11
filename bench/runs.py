"""Before / after comparisons of a benchmark's runs: each checkout run alone, alternating, then the runs
pooled per label (`--compare before=a1.json,a2.json after=b1.json,b2.json`)."""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


class scoped_env:
    """Environment variables set for a block, restored after (a GraphDecoder reads its capture mode and attention
    when built, a decoder its KV cache's dtype when it makes a cache)."""

    def __init__(self, env: dict[str, str]):
        self.env, self.saved = env, {}

    def __enter__(self):
        self.saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def pyplot():
    """matplotlib.pyplot drawing to files (the Agg backend: no display here)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_result(result: dict, folder: Path, out: str, plot) -> None:
    """`result` as one line of JSON at folder/out.json and plot(result, path) as folder/out.png beside it."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{out}.json").write_text(json.dumps(result, separators=(",", ":")) + "\n")
    plot(result, folder / f"{out}.png")
    print(f"wrote {folder / out}.json and .png")


def add_compare(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--compare", nargs="+", metavar="LABEL=RUN.json[,RUN.json]",
                    help="no run: pool earlier runs per label into --out (JSON + PNG), e.g. before / after a change")


def labelled_runs(labelled: list[str]) -> dict[str, list[dict]]:
    """label -> the reports of its runs, from ["label=run1.json,run2.json", ...]."""
    runs = {}
    for item in labelled:
        label, files = item.split("=", 1)
        runs[label] = [json.loads(Path(f).read_text()) for f in files.split(",")]
    return runs


def time_kernels() -> list[float]:
    """Patch the verifier's compiled layer calls (`LeanDecoder.run_layers`) and its LM head (the decoder's `linear`)
    to add their seconds to the returned one-item list (its caller zeroes it per step): a step's host time is its
    wall time less that."""
    import time

    from specloop.drafter.model import decoder

    spent = [0.0]

    def timed(fn):
        def call(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            spent[0] += time.perf_counter() - t
            return out
        return call

    decoder.LeanDecoder.run_layers = timed(decoder.LeanDecoder.run_layers)  # type: ignore[method-assign]
    decoder.linear = timed(decoder.linear)  # the LM head (the layers' products run inside their compiled calls)
    try:  # the LM head where it also finds a greedy step's choices (section 57; an earlier revision has none)
        from specloop.drafter.model.weights.own_linears import OwnW8A8Weight

        if hasattr(OwnW8A8Weight, "choose"):
            OwnW8A8Weight.choose = timed(OwnW8A8Weight.choose)  # type: ignore[method-assign]
    except ImportError:
        pass
    return spent


def plot_arms(conditions: dict[str, dict], arms: tuple[str, ...], panels: tuple[tuple[str, str, str], ...],
              path: Path, label=lambda arm: arm) -> None:
    """One bar chart a panel (key, y label, title) of conditions × arms, from cells {f"{arm}_{key}": value}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, width = list(conditions), 0.8 / len(arms)
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.5), squeeze=False)
    for ax, (key, ylabel, title) in zip(axes[0], panels):
        for i, arm in enumerate(arms):
            ax.bar([j + width * i for j in range(len(names))], [conditions[n][f"{arm}_{key}"] or 0 for n in names],
                   width, label=label(arm))
        ax.set_xticks([j + width * (len(arms) - 1) / 2 for j in range(len(names))], names)
        ax.set(ylabel=ylabel, title=title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def in_situ_args(doc: str, out: str) -> argparse.Namespace:
    """The options of an in-situ A/B on the fetched pair's held-out chat and code prompts (bench/verdict.py,
    bench/suffix_store.py)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts of each set (chat, code): the sets' last")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=out, help="bench/results/<out>.json and .png")
    return ap.parse_args()


def held_out_prompts(tokenizer, n: int) -> list[list[int]]:
    """The last n prompts of ../shared/prompts' chat_dev and code_dev (held out from the fetched drafter's
    self-distillation), chat messages templated, code as text."""
    from specloop.services.prompts import encode, load_prompts

    shared = Path(__file__).resolve().parents[2] / "shared" / "prompts"
    return [encode(tokenizer, r) for name in ("chat_dev.jsonl", "code_dev.jsonl") for r in load_prompts(shared / name)[-n:]]
