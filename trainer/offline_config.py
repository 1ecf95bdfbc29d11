"""What `specloop train offline` is asked to do: `OfflineConfig` (every option, checked by
`validate`), the data modes and methods it accepts, and `config_from_options` (the command line's
options as a config). The training itself: specloop.trainer.offline."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from specloop.drafter.kinds.table import KINDS
from specloop.trainer.losses import LOSSES
from specloop.trainer.students import METHODS

DATA_MODES = ("teacher-forced", "generated", "code", "self-distilled")  # code: the standard library's non-test
# source, raw; self-distilled (eagle only): specloop.trainer.selfdistill, the verifier's answers with its features
# the kind each method trains, from the table of kinds (sd2-frozen: SD² with its drafter LM left frozen)
KIND_OF_METHOD = {spec.method: name for name, spec in KINDS.items() if spec.method} | {"sd2-frozen": "sd2"}
NEEDS_DRAFTER = {method for method, kind in KIND_OF_METHOD.items() if KINDS[kind].needs_dir}


@dataclass
class OfflineConfig:
    method: str  # one of METHODS
    verifier: str  # verifier model directory
    out_dir: str
    drafter: str | None = None  # drafter LM directory (distill / sd2 / sd2-frozen; dvi: only to generate data)
    data: str = "teacher-forced"  # one of DATA_MODES
    loss: str = "kl"  # one of specloop.trainer.losses.LOSSES
    k: int = 8  # SD²: δ ~ U{1..k}; eagle: unrolled up to k drafts
    minutes: float | None = None  # wall-clock budget (all runs of this out dir together)
    max_steps: int | None = None  # step budget; give this and/or minutes
    lr: float = 1e-3  # steering and LoRA parameters
    lm_lr: float = 3e-4  # drafter LM parameters (distill, sd2)
    weight_decay: float = 0.0  # drafter LM matrices only; steering / LoRA never decay
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1  # cosine decays to this fraction of the peak
    grad_clip: float = 0.5
    batch_size: int = 8
    seq_len: int = 128
    seed: int = 0
    threads: int = 1
    dvi_layers: int = 2  # s: verifier layers under the DVI head
    steer_layers: tuple[int, int, int] | None = None  # default: specloop.drafter.kinds.sd2.default_steer_layers
    resume: bool = False
    checkpoint_every: int = 100
    acceptance_ema: float = 0.95  # decay of the running acceptance estimate (LK's λ)
    max_doc_tokens: int = 1024  # a conversation contributes at most this many tokens
    data_cache: str | None = None  # generated data lives here (default: OUT/data); share it between runs
    gen_batch: int = 32  # prompts decoded together when generating
    gen_k: int = 0  # speculation while generating (0: the verifier alone, fastest on CPU at batch >= 8)
    gen_max_tokens: int = 128  # new tokens per generated sequence
    gen_max_prompt_tokens: int = 64  # longer first turns are skipped
    draft_vocab: str | None = None  # FR-Spec: a draft_vocab.safetensors file; the loss scores its rows only
    freeze_embeddings: bool = False  # distill / sd2: keep the drafter's embeddings (and tied head) fixed
    teacher_dtype: str = "fp32"  # the frozen verifier's forward: fp32, bf16, or auto (bf16 where the CPU has it)
    conversations: list | None = field(default=None, repr=False)  # in-memory conversations (tests) instead of ShareGPT

    def validate(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        need(self.method in METHODS, f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        need(self.data in DATA_MODES, f"unknown data mode {self.data!r}; choose one of {', '.join(DATA_MODES)}")
        need(self.loss in LOSSES, f"unknown loss {self.loss!r}; choose one of {', '.join(LOSSES)}")
        need(self.method not in NEEDS_DRAFTER or self.drafter is not None, f"method {self.method} needs --drafter DIR")
        need(self.minutes is not None or self.max_steps is not None, "give a budget: --minutes and/or --max-steps")
        need(self.data != "self-distilled" or (self.method in ("eagle", "eagle3") and self.minutes is not None
                                               and not self.resume),
             "--data self-distilled trains --method eagle or eagle3 within --minutes (it does not resume)")
        need(self.minutes is None or self.minutes > 0, "--minutes must be > 0")
        need(self.max_steps is None or self.max_steps >= 0, "--max-steps must be >= 0")
        need(self.k >= 1, "--k must be >= 1")
        need(self.batch_size >= 1 and self.seq_len >= 2, "--batch-size must be >= 1 and --seq-len >= 2")
        need(self.checkpoint_every >= 1, "--checkpoint-every must be >= 1")
        need(self.gen_batch >= 1 and self.gen_k >= 0, "--gen-batch must be >= 1 and --gen-k >= 0")
        need(self.teacher_dtype in ("fp32", "bf16", "auto"), "--teacher-dtype must be fp32, bf16 or auto")
        need(self.draft_vocab is None or Path(self.draft_vocab).is_file(),
             f"--draft-vocab {self.draft_vocab}: no such file")
        need(self.steer_layers is None or len(set(self.steer_layers)) == 3,
             "--steer-layers needs three distinct layers")

    def description(self) -> dict:
        """The JSON-able fields (what a checkpoint remembers)."""
        d = asdict(self)
        d.pop("conversations")
        d["steer_layers"] = None if self.steer_layers is None else list(self.steer_layers)
        return d


def config_from_options(options: dict, threads: int = 1) -> OfflineConfig:
    """The OfflineConfig of `specloop train offline`'s options (specloop.services.cli.train.OfflineOptions, by
    field name; `out` is out_dir), with paths as strings and the top-level --threads."""
    fields = dict(options, out_dir=options["out"], threads=threads)
    del fields["out"]
    for name in ("verifier", "drafter", "out_dir", "data_cache", "draft_vocab"):
        fields[name] = None if fields.get(name) is None else str(fields[name])
    if fields.get("steer_layers") is not None:
        fields["steer_layers"] = tuple(fields["steer_layers"])
    return OfflineConfig(**fields)
