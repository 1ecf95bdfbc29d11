"""A mix of speculators (specloop.drafter.kinds.mix): lossless whichever member drafts, the choice per step and row
follows live acceptance, unused members cost nothing, and a hot swap keeps what the others learned."""
import pytest
import torch

from specloop.drafter.decode.engine import generate
from specloop.drafter.decode.requests import StopRule
from specloop.drafter.decode.sampling import SamplingParams
from specloop.drafter.kinds.eagle import EagleDrafter
from specloop.drafter.kinds.mix import SpeculatorMix
from specloop.drafter.kinds.ngram import NgramDrafter
from specloop.drafter.kinds.suffix import SuffixDrafter
from specloop.drafter.kinds.table import build_drafter, check_speculators
from specloop.drafter.model.decoder import LeanDecoder
from tests.drafter_helpers import Scripted
from tests.drafter_helpers import trained_eagle as trained_like
from tests.tiny import build_model, llama_config

PROMPTS = [[1, 2, 3, 4, 1, 2, 3], [7, 8], [9, 10, 11, 12, 9, 10], [5, 5, 5, 5]]


@pytest.fixture(scope="module")
def lean():
    return LeanDecoder(build_model(llama_config(60, 3, 64), seed=0, init_std=0.2))


def mix_of(lean, *names, seed=1):
    members = {"adaptive": EagleDrafter(lean, trained_like(lean, seed=seed))}
    if "static" in names:
        members["static"] = EagleDrafter(lean, trained_like(lean, seed=seed + 1))
    if "suffix" in names:
        members["suffix"] = SuffixDrafter(lean.vocab_size)
    return SpeculatorMix(members, explore=3)


@pytest.mark.parametrize("names,k", [(("static", "suffix"), 3), (("static",), None), (("suffix",), None)])
def test_greedy_output_with_a_mix_equals_the_verifier_alone(lean, names, k):
    params = SamplingParams(max_tokens=30)
    ref = [g.token_ids for g in generate(lean, None, PROMPTS, params, 0, StopRule())]
    mix = mix_of(lean, *names)
    controller = None if k else Scripted([2, 0, 3, 1], k_max=3)  # auto: steps that draft, cut by confidence
    for _ in range(2):  # the second pass drafts from the first one's outputs too
        out = generate(lean, mix, PROMPTS, params, k, StopRule(), controller=controller)
        assert [g.token_ids for g in out] == ref
    assert sum(mix.served.values()) > 0
    assert all(mix.served[n] > 0 for n in names), mix.served  # every member drafted some blocks


def test_the_mix_follows_lazily_through_its_suffix_member_alone_sharing_its_lookups_calibration(lean):
    """A mix of eagle heads (`follows_lazily`) leaves them behind on the steps the engine runs lazily: its lazy part
    is the mix with the suffix member alone, capturing nothing, whose lookups are the whole mix's (sources, the
    counts they teach); a mix whose model member must follow every step, or with no suffix member, has none."""
    mix = mix_of(lean, "static", "suffix")
    assert mix.follows_lazily
    part = mix.lazy_part()
    assert part is mix.lazy_part() and list(part.members) == ["suffix"] and part.members["suffix"] is mix._suffix()
    assert part.verifier_layers == part.record_layers == () and mix.verifier_layers
    mix.members["suffix"].start([[1, 2, 1], [3]], 16)
    assert part.served is mix.served and part.free_confidence(3, 2) == ([[1.0], []], ["suffix", "suffix"])
    assert mix_of(lean, "static").lazy_part() is None
    mix.members["static"].follows_lazily = False
    assert not mix.follows_lazily


def test_the_member_with_the_better_live_acceptance_drafts_and_a_starved_one_gets_a_turn(lean):
    mix = mix_of(lean, "static")
    for _ in range(20):
        mix.acceptance["static"].observe(3, 3)
        mix.acceptance["adaptive"].observe(3, 0)
    assert mix.pick_model(3) == "static"
    mix.idle["adaptive"] = mix.explore
    assert mix.pick_model(3) == "adaptive"


def test_rows_take_the_suffix_draft_where_it_is_expected_to_beat_the_model_and_the_model_is_skipped(lean):
    mix = mix_of(lean, "suffix")
    for _ in range(30):
        mix.acceptance["adaptive"].observe(3, 0)  # the model accepts nothing
    calls = []
    model = mix.members["adaptive"]
    original = model.propose
    model.propose = lambda *a: calls.append(1) or original(*a)
    mix.start([[1, 2, 3, 1, 2], [4, 5, 6, 4, 5]], 32, _view(lean, 2))
    proposal = mix.propose(3, SamplingParams(), None)
    assert proposal.sources == ["suffix", "suffix"] and not calls  # no model pass at all
    assert proposal.tokens[:, :2].tolist() == [[3, 1], [6, 4]] and proposal.lengths.tolist() == [2, 2]
    mix.start([[1, 2, 3, 1, 2], [40, 41]], 32, _view(lean, 2))  # row 1 has no suffix match
    proposal = mix.propose(3, SamplingParams(), None)
    assert proposal.sources == ["suffix", "adaptive"] and calls
    assert proposal.lengths.tolist() == [2, 3]


def test_a_hot_swap_keeps_the_other_members_estimates_and_fades_the_adaptive_one(lean):
    old = mix_of(lean, "static", "suffix")
    for _ in range(10):
        old.acceptance["static"].observe(2, 2)
        old.acceptance["adaptive"].observe(2, 2)
    old.start([[1, 2, 3]], 16, _view(lean, 1))
    new = mix_of(lean, "static", "suffix", seed=5)
    new.adopt(old)
    assert new.acceptance["static"].trials == old.acceptance["static"].trials
    assert new.acceptance["adaptive"].trials[0] == pytest.approx(0.25 * old.acceptance["adaptive"].trials[0])
    assert new.members["suffix"].rows is old.members["suffix"].rows


def test_members_that_miss_plain_steps_and_unknown_speculators_are_refused(lean, tiny_pair):
    with pytest.raises(ValueError, match="follow plain steps"):
        SpeculatorMix({"adaptive": NgramDrafter(60), "suffix": SuffixDrafter(60)})
    with pytest.raises(ValueError, match="unknown speculator"):
        check_speculators("eagle", ("turbo",))
    with pytest.raises(ValueError, match="model-free"):
        check_speculators("suffix", ("static",))
    from specloop.drafter.model.loading import load_model
    drafter = build_drafter("eagle", load_model(tiny_pair[0]), None, speculators=("static", "suffix"))
    assert isinstance(drafter, SpeculatorMix) and set(drafter.members) == {"adaptive", "static", "suffix"}
    assert drafter.members["static"] is not drafter.members["adaptive"]


def _view(lean, rows):
    from specloop.drafter.decode.proposer import VerifierView

    cache = lean.new_cache(rows, 32)
    return VerifierView(cache, {lean.num_layers - 1: torch.zeros(rows, lean.hidden_size)})


def test_a_rows_suffix_draft_is_weighed_as_the_engines_controller_judges_that_rows_drafts(lean):
    """One estimate of what suffix drafts earn, the controller's: its calibration apart for rows that sample (chat at
    T = 1 taught it low), a request's first draft at its word, then the request's own outcomes; an engine hands its
    controller to the mix (a swapped-in version too), and without one a draft is taken at its word."""
    from specloop.drafter.decode.controller import Controller, ControllerConfig
    from specloop.drafter.decode.engine import Engine
    from specloop.drafter.decode.sampling import RowParams

    mix = mix_of(lean, "suffix")
    for _ in range(30):
        mix.acceptance["adaptive"].observe(3, 1)  # the model's E(3) ~1.9; the suffix drafts promise 2 tokens
    mix.start([[1, 2, 3, 1, 2], [4, 5, 6, 4, 5]], 32, _view(lean, 2))
    u = torch.full((2, 3), 0.5)
    mixed = RowParams((SamplingParams(), SamplingParams(temperature=1.0)))  # row 0 greedy, row 1 sampled
    assert mix.propose(3, mixed, u).sources == ["suffix", "suffix"]  # no controller: at the drafts' word
    controller = Controller(ControllerConfig(calibration_decay=1.0))
    for _ in range(20):
        controller.calibration("suffix@sampled").observe(2.0, 0)  # sampled rows' suffix drafts earned nothing
    engine = Engine(lean, mix, slots=2, capacity=32, stop_rule=StopRule(), controller=controller)
    assert mix.controller is engine.controller
    mix.start([[1, 2, 3, 1, 2], [4, 5, 6, 4, 5]], 32, _view(lean, 2))  # (the engine started it with empty rows)
    assert mix.propose(3, mixed, u).sources == ["suffix", "suffix"]  # row 1: its request's first draft, a try
    own = controller.row_evidence(1, "suffix@sampled")
    own.calibration.observe(2.0, 0)  # ...which earned nothing
    own.retry = controller.cfg.row_retry
    assert mix.propose(3, mixed, u).sources == ["suffix", "adaptive"]  # the greedy row's copy is still drafted
    assert not mix.prefers_free(1, 8, [0, 1], [False, True]) and mix.prefers_free(1, 8, [0], [False])
    swapped = mix_of(lean, "suffix", seed=4)
    engine.hooks = type("Swap", (), {"swap": lambda self, old, histories: swapped})()
    engine.offer_swap()
    assert swapped.controller is controller


def test_rows_the_suffix_member_drafts_teach_the_calibration_not_the_acceptance_k_is_chosen_by(lean):
    """The controller prices asking the model for k drafts: a mix's suffix rows (free drafts) must not
    inflate that acceptance; they go to suffix decoding's own calibration."""
    from specloop.drafter.decode.engine import Engine
    from specloop.drafter.decode.requests import EngineRequest

    mix = mix_of(lean, "suffix")
    for _ in range(30):
        mix.acceptance["adaptive"].observe(3, 0)  # the model accepts nothing: rows with a match take suffix
    controller = Scripted([3], k_max=3)
    controller.cut = lambda confidence, rows, sources=None: [len(c) for c in confidence]
    engine = Engine(lean, mix, slots=1, capacity=96, stop_rule=StopRule(), controller=controller, lookups=False)
    engine.admit([EngineRequest("r", [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3], SamplingParams(max_tokens=20), None, 0)])
    sources = []
    while engine.running:
        sources += [u.speculator for u in engine.step() if u.k]
    assert "suffix" in sources
    model_blocks = sources.count("adaptive")
    assert sum(controller.acceptance.trials[:1]) == pytest.approx(
        sum(0.99 ** i for i in range(model_blocks)), rel=1e-6)  # position 1 tried by the model's blocks alone
    assert controller.calibration("suffix").predicted > 1.0  # the suffix rows were seen, by the calibration


def test_a_step_the_model_would_draft_k_for_runs_as_a_lookup_where_every_row_copies_better(lean):
    """The controller gave the model k = 1, but every live row's suffix draft promises more: the step
    verifies the suffix drafts at full width (not cut to 1), and output stays the verifier's."""
    from specloop.drafter.decode.engine import Engine
    from specloop.drafter.decode.requests import EngineRequest

    prompt = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2, 3]
    params = SamplingParams(max_tokens=12)
    ref = generate(lean, None, [prompt], params, 0, StopRule())[0].token_ids
    mix = mix_of(lean, "suffix")
    for _ in range(30):
        mix.acceptance["adaptive"].observe(1, 0)
    controller = Scripted([1], k_max=4)
    controller.cut = lambda confidence, rows, sources=None: [len(c) for c in confidence]
    engine = Engine(lean, mix, slots=3, capacity=96, stop_rule=StopRule(), controller=controller)
    engine.admit([EngineRequest("r", prompt, params, None, 0)])  # two empty slots ride along
    got, ks = [], []
    while engine.running:
        for u in engine.step():
            got += u.new_tokens
            ks.append(u.k)
    assert got == ref
    assert max(ks) > 1  # a copy verified past the model's k
