"""Several speculators behind one Drafter, chosen per step and row (ATLAS's static + adaptive pair,
and suffix decoding beside a model drafter, as ArcticInference pairs it).

Members, by name (every one follows plain steps, so each stays current whichever one drafts):
- "adaptive": the served drafter version, the one the online learner trains;
- "static": a frozen copy of the base drafter beside it (optional): a drift never costs more than
  the static speculator, and the adaptive one takes over once it has learned;
- "suffix": suffix decoding over the row's history and earlier outputs (optional, no model).

The choice, from live acceptance kept per member (specloop.drafter.decode.controller.Acceptance: decayed counts of
per-position trials and hits, shrunk to a prior):

    E_m(k) = 1 + Σ_{i≤k} Π_{j≤i} a_{m,j}                 a model member's expected tokens per block
    model  = argmax over {adaptive, static} of E_m(k)     one of them drafts for the batch; the other
                                                           drafts once every `explore` steps it sat out
    row b takes the suffix draft when 1 + c_b · Σ_i p_{b,i} ≥ E_model(k), where p_{b,i} is the suffix
    draft's own path probability and c_b what such drafts really earn over what they promise, as the engine's
    controller judges row b's (`Controller.free_scales`: suffix decoding's calibration, apart for rows that sample,
    with the row's request's own outcomes beside it and a first draft taken at its word; 1 without a controller)

and the model member is not run at all when every row took a suffix draft (its cost is saved).
On steps where the controller chose not to draft (the model members do not pay), `lookup` offers the
suffix member's drafts alone (specloop.drafter.decode.engine verifies what their confidence pays for); so does a step
where it chose k > 0 but every row's suffix draft, up to the widest pass, promises at least what the
model's k would (`prefers_free`): a copy is not cut to the model's k.
Every row's speculator is in `Proposal.sources`, for metrics and for the replay records (only a
model member's drafts are records; the learner's policy terms use the adaptive member's alone).
"""
from __future__ import annotations

import copy
from typing import cast

import torch

from specloop.drafter.decode.controller import Acceptance, Controller, ControllerConfig, calibrated_as, expected_tokens
from specloop.drafter.decode.proposer import Drafter, Proposal, VerifierView, steer_now
from specloop.drafter.decode.rejection import BlockOutcome
from specloop.drafter.decode.sampling import RowParams, SamplingParams
from specloop.drafter.kinds.suffix import Draft, SuffixDrafter, proposal_of

SPECULATORS = ("static", "suffix")  # what may join the served ("adaptive") drafter
MODELS = ("adaptive", "static")


class SpeculatorMix:
    """The Drafter protocol over named members (see the module doc)."""

    def __init__(self, members: dict[str, Drafter], explore: int = 32):
        bad = [name for name, d in members.items() if not getattr(d, "follows_plain", False)]
        if bad:
            raise ValueError(f"a mix of speculators needs members that follow plain steps; "
                             f"{', '.join(f'{n} ({members[n].kind})' for n in bad)} do not: use an eagle drafter")
        if "adaptive" not in members:
            raise ValueError("a mix of speculators needs the served ('adaptive') drafter")
        self.members = members
        self.kind = members["adaptive"].kind
        self.verifier_layers = tuple(sorted({i for d in members.values() for i in d.verifier_layers}))
        self.record_layers = tuple(members["adaptive"].record_layers)
        self.follows_plain = True
        self.feature_window = max(getattr(d, "feature_window", 0) for d in members.values())
        self.explore = explore
        cfg = ControllerConfig(k_max=8)
        self.acceptance = {name: Acceptance(cfg) for name in members if name != "suffix"}
        self.idle = {name: 0 for name in self.acceptance}  # drafting steps each model member sat out
        self.controller: Controller | None = None  # what judges the suffix member's drafts (`calibrated_by`)
        self.served: dict[str, int] = {name: 0 for name in members}  # blocks drafted by each member
        self._last: list[str] | None = None  # each row's speculator in the step being verified (None: a plain step)
        self._lazy: SpeculatorMix | None = None  # `lazy_part`, made on first use

    @property
    def follows_lazily(self) -> bool:
        """Whether the engine may leave the model members behind on plain steps nothing times (each an eagle head,
        whose state is the verifier's newest feature: `follows_lazily`): the suffix member still follows them
        (`lazy_part`), so that lookups on the steps left plain draft from every token."""
        return all(getattr(d, "follows_lazily", False) for name, d in self.members.items() if name != "suffix")

    def lazy_part(self) -> "SpeculatorMix | None":
        """The mix as it follows a step its model members skip: its suffix member alone, capturing nothing (a view:
        lookups and counts are the whole mix's); None without a suffix member."""
        if "suffix" not in self.members:
            return None
        if self._lazy is None:  # made once (a copy costs a plain step ~15 µs): what it shares is never reassigned
            self._lazy = copy.copy(self)
            self._lazy.members = {"suffix": self.members["suffix"]}
            self._lazy.verifier_layers = self._lazy.record_layers = ()
        return self._lazy

    def use_chain(self, slots: int | None, depth: int = 0, compiled: bool = True) -> None:
        """The engine's graph backend asks (decode.engine `Chained`): each member whose greedy drafts run as one
        captured graph (an eagle head) is told, as it would be serving alone."""
        for member in self.members.values():
            if hasattr(member, "use_chain"):
                member.use_chain(slots, depth, compiled)

    def calibrated_by(self, controller: Controller) -> None:
        """The engine's controller, whose calibration of suffix decoding's drafts (the one its gate cuts them by)
        weighs a row's suffix draft against the model's: one estimate of what those drafts earn, not two (the
        mix's own, one for every request and greedy and sampled rows alike, could stay low after sampled chat and
        keep a grounded request's copies from being drafted: bench/README.md section 54)."""
        self.controller = controller

    def steer_now(self) -> torch.Tensor | None:
        """The served ("adaptive") member's: an observed record of a step left plain is the adaptive drafter's."""
        return steer_now(self.members["adaptive"])

    # -- the choice

    def expected(self, name: str, k: int) -> float:
        return expected_tokens(self.acceptance[name].rates(), k)

    def pick_model(self, k: int) -> str:
        """The model member that drafts this step: the best by expected tokens, or one that sat out too long."""
        models = [n for n in MODELS if n in self.acceptance]
        starved = [n for n in models if self.idle[n] >= self.explore]
        return starved[0] if starved else max(models, key=lambda n: (self.expected(n, k), n == "adaptive"))

    def propose(self, k: int, params: SamplingParams | RowParams, uniforms: torch.Tensor | None) -> Proposal:
        model = self.pick_model(k)
        suffix = self._suffix()
        if suffix is None:
            return self._model_proposal(model, k, params, uniforms)
        drafts = suffix.drafts(k)
        bar = self.expected(model, k)
        worth = self.worths(list(range(len(drafts))), drafts, sampled_rows(params, len(drafts)))
        takes = [w >= bar for w in worth]
        mine = proposal_of(drafts, k, suffix.fillers())
        if all(takes):
            mine.sources = ["suffix"] * len(drafts)
            self._remember(mine.sources, model=None)
            return mine
        theirs = self._model_proposal(model, k, params, uniforms)
        rows = torch.tensor(takes)
        merged = merge(theirs, mine, rows)
        merged.sources = ["suffix" if t else model for t in takes]
        self._remember(merged.sources, model)
        return merged

    def prefers_free(self, k: int, width: int, live: list[int], sampled: list[bool]) -> bool:
        """Whether, on a step the controller gave the model members k drafts, every live row (`sampled`: whether
        each samples) is expected to do at least as well with its suffix draft of up to `width` tokens (the widest a
        pass may verify) as with the model's: specloop.drafter.decode.engine then runs the step as a lookup (no model
        pass, the suffix drafts not capped at k)."""
        suffix = self._suffix()
        if suffix is None:
            return False
        bar = self.expected(self.pick_model(k), k)
        drafts = suffix.drafts(width, live)
        return all(w >= bar for w in self.worths(live, drafts, sampled))

    def worths(self, rows: list[int], drafts: list[Draft], sampled: list[bool]) -> list[float]:
        """1 + c_b · Σ_i p_{b,i}: the tokens each row's suffix draft is expected to gain (`sampled`: whether each row
        samples); 0 where a row has none (never taken). One call a step: its speculator's estimates are read once."""
        have = [i for i, d in enumerate(drafts) if d.tokens]
        scores = [drafts[i].score for i in have]
        if self.controller is None:
            scales = [1.0] * len(have)
        else:
            keys = [calibrated_as("suffix", sampled[i]) for i in have]
            scales = self.controller.free_scales([rows[i] for i in have], keys, scores)
        out = [0.0] * len(drafts)
        for i, c, score in zip(have, scales, scores):
            out[i] = 1 + c * score
        return out

    def lookup(self, k: int, params: SamplingParams) -> Proposal | None:
        """The suffix member's drafts alone, no model member run: what specloop.drafter.decode.engine verifies on a step
        the controller left plain, each row cut to what its confidence pays for. None without a suffix
        member, or where no row has a draft."""
        suffix = self._suffix()
        mine = suffix.lookup(k, params) if suffix is not None else None
        if mine is not None:
            mine.sources = self._last = ["suffix"] * len(mine.tokens)  # the model members sat out no drafting step
        return mine

    def free_confidence(self, k: int, m: int) -> tuple[list[list[float]], list[str] | None]:
        """`SuffixDrafter.free_confidence` of the suffix member (no row has a draft without one), each row's
        calibrated as "suffix" drafts, as `lookup` marks them."""
        suffix = self._suffix()
        return (suffix.free_confidence(k, m)[0] if suffix is not None else [[] for _ in range(m)]), ["suffix"] * m

    def _suffix(self) -> SuffixDrafter | None:
        """The "suffix" member (specloop.drafter.kinds.table builds it as a SuffixDrafter), or None."""
        return cast("SuffixDrafter | None", self.members.get("suffix"))

    def _model_proposal(self, model: str, k: int, params: SamplingParams | RowParams, uniforms) -> Proposal:
        proposal = self.members[model].propose(k, params, uniforms)
        proposal.sources = [model] * len(proposal.tokens)
        self._remember(proposal.sources, model)
        return proposal

    def _remember(self, sources: list[str], model: str | None) -> None:
        self._last = sources
        for name in self.idle:
            self.idle[name] = 0 if name == model else self.idle[name] + 1

    # -- the verdict

    def observe(self, outcome: BlockOutcome, active: torch.Tensor, view: VerifierView) -> None:
        for member in self.members.values():
            member.observe(outcome, active, view)
        if self._last is None:  # a plain step
            return
        sources, self._last = self._last, None
        k = outcome.tokens.shape[1] - 1
        rows = None if outcome.drafted is None else outcome.drafted.tolist()  # one read, not one a row
        for b in torch.nonzero(active).flatten().tolist():
            drafted = k if rows is None else rows[b]
            n = outcome.accepted(b)
            if not drafted or (outcome.sources is not None and outcome.sources[b] not in self.members):
                continue  # a row whose grammar drafted for it (`speculative.with_forced`): no member's draft
            self.served[sources[b]] += 1
            if sources[b] != "suffix":  # (the controller learns what suffix drafts earn, from the step's rows)
                self.acceptance[sources[b]].observe(drafted, n)

    # -- rows and swaps

    def start(self, prompts: list[list[int]], capacity: int, view: VerifierView) -> None:
        for member in self.members.values():
            member.start(prompts, capacity, view)

    def join(self, slots: list[int], prompts: list[list[int]], view: VerifierView) -> None:
        for member in self.members.values():
            member.join(slots, prompts, view)

    def narrow(self, m: int) -> "SpeculatorMix":
        view = copy.copy(self)  # acceptance and counts are shared with the pool
        view.members = {name: d.narrow(m) for name, d in self.members.items()}
        view._lazy = None
        return view

    def widen(self, view: "SpeculatorMix", m: int) -> None:
        for name, d in self.members.items():
            d.widen(view.members[name], m)
        self._last = None

    def adopt(self, old: "SpeculatorMix") -> None:
        """A new adaptive version: every member continues `old`'s rows; the other members' estimates
        carry over, the adaptive one's keeps a quarter of its weight (a new version is a new drafter)."""
        self._take(old, lambda d, o: d.adopt(o))

    def refill(self, old: "SpeculatorMix", histories: list[list[int]]) -> None:
        self._take(old, lambda d, o: d.refill(o, histories))

    def _take(self, old: "SpeculatorMix", carry) -> None:
        for name, d in self.members.items():
            if name in old.members:
                carry(d, old.members[name])
        for name, acc in old.acceptance.items():
            if name in self.acceptance:
                self.acceptance[name] = copy.deepcopy(acc)
        if "adaptive" in self.acceptance:
            self.acceptance["adaptive"].fade(0.25)
        self.served, self.idle = dict(old.served), dict(old.idle)
        self._lazy = None  # it shared the replaced ones


def sampled_rows(params: SamplingParams | RowParams, rows: int) -> list[bool]:
    """Whether each of a step's rows samples."""
    if isinstance(params, RowParams):
        return [not p.greedy for p in params.rows]
    return [not params.greedy] * rows


def merge(model: Proposal, suffix: Proposal, rows: torch.Tensor) -> Proposal:
    """Row b from `suffix` where rows[b], else from `model` (both [B, k]); a model row drafts all k."""
    dev = model.tokens.device
    pick = rows.to(dev)
    tokens = torch.where(pick[:, None], suffix.tokens.to(dev), model.tokens)
    probs = None
    if model.probs is not None:
        one_hot = torch.nn.functional.one_hot(suffix.tokens, model.probs.shape[-1]).to(model.probs)
        probs = torch.where(pick[:, None, None], one_hot.to(dev), model.probs)
    k = tokens.shape[1]
    assert suffix.lengths is not None and suffix.confidence is not None  # proposal_of sets both
    lengths = torch.where(rows, suffix.lengths, torch.full_like(suffix.lengths, k))
    theirs = model.confidence.float().cpu() if model.confidence is not None else torch.ones(len(rows), k)
    confidence = torch.where(rows[:, None], suffix.confidence, theirs)
    return Proposal(tokens=tokens, probs=probs, logits=model.logits, logit_rows=model.logit_rows, steer=model.steer,
                    lengths=lengths, confidence=confidence)
