"""`specloop train offline`: align a drafter with the verifier before it serves.

Every method minimises a distance between the verifier's next-token distribution π_V and the
drafter's π_D at every position of training sequences (`specloop.trainer.losses`: forward KL, TV or LK).
What each method (distill, sd2, sd2-frozen, dvi, eagle) trains is a `specloop.trainer.students.Student`, including
SD²'s random offset; the training windows come from `specloop.trainer.data` (teacher-forced or generated,
packed into windows of `seq_len` tokens). Targets are computed on the fly by the frozen verifier
(fp32), which also supplies SD²/DVI features.

Out dir: manifest.json, drafter/ (HF format; distill and sd2), steering.safetensors (sd2),
dvi_head.safetensors (dvi), eagle_head.safetensors (eagle) — all loadable with
`specloop.drafter.kinds.table.build_drafter(kind, verifier, out)` — plus train_log.jsonl (one line per step) and
checkpoint/ (safetensors + JSON, for --resume).
The config and its command line: specloop.trainer.offline_config (its names are importable from here too).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm import tqdm

from specloop.drafter.model.loading import load_model
from specloop.drafter.model.vocab import save_vocab
from specloop.trainer.data import (
    ConversationSource,
    GeneratedSet,
    GenerationSpec,
    WindowStream,
    code_documents,
    conversation_ids,
)
from specloop.trainer.losses import distribution_loss, expected_acceptance
from specloop.trainer.offline_config import KIND_OF_METHOD, OfflineConfig
from specloop.trainer.students import build_student, teacher_autocast, verifier_targets

CHECKPOINT_DIR = "checkpoint"
CHECKPOINT_TENSORS = "state.safetensors"
CHECKPOINT_JSON = "state.json"
LOG_FILE = "train_log.jsonl"


# ----------------------------------------------------------------------------- schedule


@dataclass
class Schedule:
    """Linear warm-up by steps, then cosine to min_lr_ratio over the budget (steps or wall clock)."""

    warmup_steps: int
    min_lr_ratio: float
    max_steps: int | None
    seconds: float | None

    def factor(self, step: int, elapsed: float) -> float:
        warm = min(1.0, (step + 1) / self.warmup_steps) if self.warmup_steps > 0 else 1.0
        done = 0.0
        if self.max_steps:
            done = max(done, step / self.max_steps)
        if self.seconds:
            done = max(done, elapsed / self.seconds)
        cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, done)))
        return warm * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine)


# ----------------------------------------------------------------------------- trainer


class OfflineTrainer:
    """Builds the models, data and optimizer for a config (resuming if asked) and trains."""

    def __init__(self, cfg: OfflineConfig, progress: bool = True):
        cfg.validate()
        self.cfg, self.progress = cfg, progress
        self.out = Path(cfg.out_dir)
        torch.set_num_threads(cfg.threads)
        torch.manual_seed(cfg.seed)
        self.verifier = load_model(cfg.verifier, dtype=torch.float32, keep_module=True)  # its forward gives the targets
        self.verifier.hf.requires_grad_(False).eval()
        self.device = self.verifier.lean.device
        self.generator = torch.Generator().manual_seed(cfg.seed)  # SD² offsets
        self.vocab = None if cfg.draft_vocab is None else load_file(cfg.draft_vocab)["ids"].to(torch.long)
        self.student = build_student(cfg.method, self.verifier, cfg.drafter, k=cfg.k, dvi_layers=cfg.dvi_layers,
                                     steer_layers=cfg.steer_layers, generator=self.generator,
                                     device=self.device, vocab=self.vocab, freeze_embeddings=cfg.freeze_embeddings)
        self.params = self.student.trainable()
        self.optimizer = self._build_optimizer()
        self.schedule = Schedule(cfg.warmup_steps, cfg.min_lr_ratio, cfg.max_steps,
                                 None if cfg.minutes is None else 60.0 * cfg.minutes)
        self.step_count, self.tokens_seen, self.elapsed = 0, 0, 0.0
        self.acceptance: float | None = None  # EMA of Σ min(p, q)
        self.generated: GeneratedSet | None = None
        data_state = None
        ckpt = self.out / CHECKPOINT_DIR
        if cfg.resume:
            if not (ckpt / CHECKPOINT_JSON).is_file():
                raise ValueError(f"--resume: {ckpt} holds no checkpoint")
            data_state = self.load_checkpoint(ckpt)
        elif (ckpt / CHECKPOINT_JSON).is_file():
            raise ValueError(f"{self.out} already holds a checkpoint: pass --resume, or choose another --out")
        self.data = self._build_data(data_state)

    # -- construction

    def _build_optimizer(self) -> torch.optim.Optimizer:
        """AdamW over three groups in a fixed order (their state indices follow `self.params`)."""
        self.params.sort(key=lambda item: GROUPS.index(_group_name(item)))
        groups = []
        for name in GROUPS:
            params = [p for item in self.params if _group_name(item) == name for p in [item[1]]]
            if params:
                groups.append({"params": params, "name": name, **self._group_hyper(name)})
        return torch.optim.AdamW(groups, betas=(0.9, 0.95))

    def _group_hyper(self, name: str) -> dict:
        """Peak LR and weight decay of a parameter group, from the config."""
        cfg = self.cfg
        lr = cfg.lr if name == "adapter" else cfg.lm_lr
        return {"base_lr": lr, "lr": lr, "weight_decay": cfg.weight_decay if name == "lm-matrices" else 0.0}

    def _build_data(self, state: dict | None) -> WindowStream:
        cfg, tok = self.cfg, self.verifier.tokenizer
        source = ConversationSource(cfg.conversations)
        separator = tok.pad_token_id if tok.pad_token_id is not None else min(self.verifier.eos_ids)
        if cfg.data == "teacher-forced":
            def documents(start: int) -> Iterator[list[int]]:
                for _, conv in source.iter_from(start):
                    yield conversation_ids(tok, conv, cfg.max_doc_tokens)
        elif cfg.data == "code":
            def documents(start: int) -> Iterator[list[int]]:
                return code_documents(tok, start, cfg.max_doc_tokens)
        else:
            spec = GenerationSpec(cfg.seed, cfg.gen_max_tokens, cfg.gen_max_prompt_tokens, cfg.gen_batch, cfg.gen_k)
            cache = Path(cfg.data_cache) if cfg.data_cache else self.out / "data"
            self.generated = GeneratedSet(cache, self.verifier, source, spec, cfg.drafter)
            documents = self.generated.documents
        return WindowStream(documents, cfg.seq_len, separator, state)

    # -- one step

    def _forward(self, input_ids: torch.Tensor):
        ids = input_ids.to(self.device)
        with teacher_autocast(self.device, self.cfg.teacher_dtype):
            p_logits, residuals = verifier_targets(self.verifier.hf, ids, self.student.verifier_layers, self.vocab)
        residuals = {i: r.float() for i, r in residuals.items()}
        q_logits = self.student.logits(ids, residuals)  # [B, T, V]
        return p_logits, q_logits

    def step(self, input_ids: torch.Tensor) -> dict:
        """One optimisation step on a batch [B, T]; returns its loss, acceptance and λ."""
        for group in self.optimizer.param_groups:
            group["lr"] = group["base_lr"] * self.schedule.factor(self.step_count, self.elapsed)
        p_logits, q_logits = self._forward(input_ids)
        acc = float(expected_acceptance(p_logits, q_logits))
        beta = self.cfg.acceptance_ema
        self.acceptance = acc if self.acceptance is None else beta * self.acceptance + (1 - beta) * acc
        loss, lam = distribution_loss(self.cfg.loss, p_logits, q_logits, self.acceptance)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for _, p, _ in self.params], self.cfg.grad_clip)
        self.optimizer.step()
        self.step_count += 1
        self.tokens_seen += input_ids.numel()
        return {"loss": float(loss.detach()), "acceptance": acc, "lambda": lam}

    @torch.no_grad()
    def evaluate(self, input_ids: torch.Tensor) -> dict:
        """Loss and expected acceptance on a batch without training (SD² draws fresh offsets)."""
        p_logits, q_logits = self._forward(input_ids)
        loss, lam = distribution_loss(self.cfg.loss, p_logits, q_logits, self.acceptance or 0.0)
        return {"loss": float(loss), "acceptance": float(expected_acceptance(p_logits, q_logits)), "lambda": lam}

    # -- the loop

    def run(self, stop_at: int | None = None) -> dict:
        """Train until the budget (steps and/or minutes, counted across resumed runs) is spent.

        `stop_at` pauses at that step (checkpoint and outputs written) without changing the schedule.
        """
        cfg = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        budget = None if cfg.minutes is None else 60.0 * cfg.minutes
        start, start_step, start_tokens, data_seconds = time.monotonic(), self.step_count, self.tokens_seen, 0.0
        base_elapsed, losses, accs = self.elapsed, [], []
        mode = "a" if self.step_count else "w"  # a resumed (or paused) run appends
        if cfg.max_steps is not None:
            total = cfg.max_steps
        else:
            assert budget is not None  # OfflineConfig.validate: minutes where there is no max_steps
            total = round(budget)
        unit = "step" if cfg.max_steps is not None else "s"
        bar = tqdm(total=total, initial=self.step_count if unit == "step" else round(self.elapsed), unit=unit,
                   desc=f"{cfg.method}/{cfg.data}", disable=not self.progress, file=sys.stderr)
        with open(self.out / LOG_FILE, mode) as log, bar:
            while not self._done(budget, stop_at, start_step, base_elapsed):
                t0 = time.monotonic()
                batch = self.data.batch(cfg.batch_size)
                data_seconds += time.monotonic() - t0
                rec = self.step(batch)
                self.elapsed = base_elapsed + time.monotonic() - start
                losses.append(rec["loss"])
                accs.append(rec["acceptance"])
                rec = {"step": self.step_count, **rec, "acceptance_ema": self.acceptance,
                       "lr": {g["name"]: g["lr"] for g in self.optimizer.param_groups}, "tokens": self.tokens_seen,
                       "seconds": round(self.elapsed, 3)}
                log.write(json.dumps(rec) + "\n")
                log.flush()
                bar.n = self.step_count if unit == "step" else min(total, round(self.elapsed))
                bar.set_postfix(loss=f"{rec['loss']:.3f}", acc=f"{self.acceptance:.3f}", refresh=False)
                bar.update(0)
                if self.step_count % cfg.checkpoint_every == 0:
                    self.save_checkpoint()
        self.elapsed = base_elapsed + time.monotonic() - start
        self.save_checkpoint()
        self.export()
        seconds = time.monotonic() - start
        tokens = self.tokens_seen - start_tokens
        summary = {
            "method": cfg.method, "kind": KIND_OF_METHOD[cfg.method], "data": cfg.data, "loss": cfg.loss,
            "out_dir": str(self.out), "steps": self.step_count, "steps_this_run": self.step_count - start_step,
            "tokens_seen": self.tokens_seen, "seconds": round(seconds, 2), "data_seconds": round(data_seconds, 2),
            "tokens_per_s": round(tokens / max(seconds, 1e-9), 1),
            "minutes_total": round(self.elapsed / 60.0, 3),
            "final_loss": _tail_mean(losses), "final_acceptance": _tail_mean(accs),
            "acceptance_ema": self.acceptance,
        }
        if self.generated is not None:
            g = self.generated
            summary["generated"] = {"cached_sequences": len(g), "new_sequences": g.new_sequences,
                                    "new_tokens": g.new_tokens, "seconds": round(g.seconds, 2)}
        return summary

    def _done(self, budget: float | None, stop_at: int | None, start_step: int, base_elapsed: float) -> bool:
        if stop_at is not None and self.step_count >= stop_at:
            return True
        if self.cfg.max_steps is not None and self.step_count >= self.cfg.max_steps:
            return True
        if budget is not None:
            steps = self.step_count - start_step
            per_step = (self.elapsed - base_elapsed) / steps if steps else 0.0
            return self.elapsed + per_step > budget
        return False

    # -- outputs and checkpoints

    def manifest_extra(self) -> dict:
        cfg, student = self.cfg, self.student
        layers = list(student.verifier_layers) if cfg.method != "dvi" else cfg.dvi_layers
        return {
            "method": cfg.method,
            "base": {"verifier": str(Path(cfg.verifier).resolve()),
                     "drafter": None if cfg.drafter is None else str(Path(cfg.drafter).resolve())},
            "layers": layers, "k": cfg.k, "loss": cfg.loss, "data": cfg.data, "steps": self.step_count,
            "tokens_seen": self.tokens_seen, "minutes": round(self.elapsed / 60.0, 3), "seq_len": cfg.seq_len,
            "batch_size": cfg.batch_size, "lr": cfg.lr, "lm_lr": cfg.lm_lr, "seed": cfg.seed,
        }

    def export(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        extra = self.manifest_extra()
        if self.vocab is not None:
            extra["draft_vocab"] = save_vocab(self.out, self.vocab)
        self.student.export(self.out, extra)

    def save_checkpoint(self) -> None:
        """Trainable parameters, optimizer, schedule position, RNG and data position: safetensors + JSON."""
        tensors = {f"param.{n}": p.detach().contiguous().cpu() for n, p, _ in self.params}
        opt = self.optimizer.state_dict()
        for idx, state in opt["state"].items():
            for key, value in state.items():
                tensors[f"opt.{idx}.{key}"] = value.detach().contiguous().cpu()
        tensors["rng.offsets"] = self.generator.get_state()
        tensors["rng.torch"] = torch.get_rng_state()
        groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in opt["param_groups"]]
        meta = {
            "step": self.step_count, "tokens_seen": self.tokens_seen, "elapsed_seconds": self.elapsed,
            "acceptance_ema": self.acceptance, "data": self.data.state(), "param_groups": groups,
            "schedule": asdict(self.schedule), "params": [n for n, _, _ in self.params],
            "config": self.cfg.description(),
        }
        tmp = self.out / (CHECKPOINT_DIR + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file(tensors, tmp / CHECKPOINT_TENSORS)
        (tmp / CHECKPOINT_JSON).write_text(json.dumps(meta) + "\n")
        final = self.out / CHECKPOINT_DIR
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)

    def load_checkpoint(self, directory: Path) -> dict:
        """Restore everything `save_checkpoint` wrote; returns the data position."""
        meta = json.loads((directory / CHECKPOINT_JSON).read_text())
        saved = meta["config"]
        now = self.cfg.description()
        for key in ("method", "data", "loss", "k", "dvi_layers", "steer_layers", "seq_len", "seed"):
            if saved[key] != now[key]:
                raise ValueError(f"checkpoint in {directory} was trained with {key}={saved[key]!r}, not {now[key]!r}")
        names = [n for n, _, _ in self.params]
        if meta["params"] != names:
            raise ValueError(f"checkpoint in {directory} trains other parameters than this configuration")
        tensors = load_file(directory / CHECKPOINT_TENSORS)
        with torch.no_grad():
            for n, p, _ in self.params:
                p.copy_(tensors[f"param.{n}"])
        state: dict[int, dict] = {}
        for key, value in tensors.items():
            if key.startswith("opt."):
                _, idx, name = key.split(".", 2)
                state.setdefault(int(idx), {})[name] = value
        groups = [dict(g, betas=tuple(g["betas"])) for g in meta["param_groups"]]
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})
        for group in self.optimizer.param_groups:  # a resumed run may change the peak LRs / decay
            hyper = self._group_hyper(group["name"])
            group["base_lr"], group["weight_decay"] = hyper["base_lr"], hyper["weight_decay"]
        self.generator.set_state(tensors["rng.offsets"])
        torch.set_rng_state(tensors["rng.torch"])
        self.step_count, self.tokens_seen = meta["step"], meta["tokens_seen"]
        self.elapsed, self.acceptance = meta["elapsed_seconds"], meta["acceptance_ema"]
        return meta["data"]


GROUPS = ("lm-matrices", "lm-vectors", "adapter")


def _group_name(item: tuple[str, nn.Parameter, str]) -> str:
    """Optimizer group of a (name, parameter, kind) entry: LM matrices decay, nothing else does."""
    _, p, kind = item
    return "adapter" if kind == "adapter" else ("lm-matrices" if p.dim() >= 2 else "lm-vectors")


def _tail_mean(values: list[float], n: int = 10) -> float | None:
    tail = values[-n:]
    return round(sum(tail) / len(tail), 5) if tail else None


def train_offline(cfg: OfflineConfig, progress: bool = True) -> dict:
    """Train per `cfg` into cfg.out_dir; returns the run's summary (also written to OUT/summary.json)."""
    if cfg.data == "self-distilled":
        cfg.validate()
        summary = self_distilled(cfg, progress)
    else:
        summary = OfflineTrainer(cfg, progress).run()
    (Path(cfg.out_dir) / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def self_distilled(cfg: OfflineConfig, progress: bool) -> dict:
    """The eagle head from the verifier's own answers (specloop.trainer.selfdistill): 4/9 of the minutes
    decoding them, 5/9 training, unrolled up to k drafts."""
    from specloop.trainer.selfdistill import DistillConfig, distill_eagle

    lr = cfg.lr if cfg.lr != OfflineConfig.lr else DistillConfig.lr  # the head's own default unless --lr was given
    assert cfg.minutes is not None  # OfflineConfig.validate: self-distilled data needs --minutes
    distill = DistillConfig(collect_minutes=cfg.minutes * 4 / 9, train_minutes=cfg.minutes * 5 / 9, depth=cfg.k,
                            lr=lr, seed=cfg.seed, threads=cfg.threads, weight_decay=cfg.weight_decay)
    return {"method": cfg.method, "data": "self-distilled", "out_dir": cfg.out_dir} | distill_eagle(
        cfg.verifier, cfg.out_dir, cfg.draft_vocab, distill, progress, method=cfg.method)

