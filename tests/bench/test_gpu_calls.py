"""bench/gpu_calls.py: every stage's call is one bench/gpu.py knows, and fits what a device call carries."""
from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from bench.gpu import PATHS, SECTIONS, parser
from bench.gpu_calls import CALL_BYTES, KEEP, ROOT, STAGES, commands, halves, tree_bytes

HALF_BYTES = 46_300_000  # the fetched Q4_1 GGUF (98.4 MB) through gzip -1, in halves (bench/README.md section 34)
SHARED = ROOT.parent / "shared"


@pytest.mark.parametrize("name", [n for n, s in STAGES.items() if s.gpu_args])
def test_each_stage_runs_sections_and_paths_gpu_py_knows(name):
    args = parser().parse_args([a.format(out="/out") for a in STAGES[name].gpu_args])
    assert set(args.sections.split(",")) <= set(SECTIONS)
    assert args.paths is None or set(args.paths.split(",")) <= set(PATHS)
    assert args.budget_s < STAGES[name].timeout_s - 20  # the budget leaves the call time to write its results
    assert str(args.out).startswith("/out/")


def test_the_fetched_stage_joins_converts_then_runs_the_pair_with_its_head():
    cmds = [" ".join(c) for c in commands(STAGES["fetched"], "/out", here=True)]
    assert "gunzip > /tmp/smol.gguf" in cmds[0] and f"{KEEP}/gguf.gz.part00 {KEEP}/gguf.gz.part01" in cmds[0]
    assert "convert_gguf" in cmds[1] and "/tmp/fetched/verifier" in cmds[1]
    assert "bench/gpu.py" in cmds[-2] and "--eagle-head /tmp/fetched/drafter" in cmds[-2] and "--smoke" in cmds[-2]
    assert not any("pip install" in c for c in cmds)  # here: this venv's packages


def test_gzip_halves_rebuild_the_file_byte_for_byte():
    data = bytes(range(256)) * 4000 + b"tail"
    a, b = halves(data)
    assert abs(len(a) - len(b)) <= 1 and gzip.decompress(a + b) == data


def test_a_keep_stage_fits_one_call_beside_the_tree():
    # every call carries the tracked tree: grown past ~19.8 MiB (19.0 now, bench/results' JSON stored compact), a GGUF half
    # no longer fits and the fetched pair needs a third call of the session's 900 s of device time
    assert tree_bytes() + HALF_BYTES <= CALL_BYTES, f"tree {tree_bytes() / 2**20:.1f} MiB"


@pytest.mark.skipif(not (SHARED / "models").is_dir(), reason="no ../shared/models here")
def test_the_main_stage_fits_one_call_with_the_reference_pair():
    # the pair travels in bf16 (copy_in_bf16): its safetensors at half their bytes
    shared = sum(p.stat().st_size // (2 if p.suffix == ".safetensors" else 1)
                 for d in ("models", "prompts") for p in (SHARED / d).rglob("*") if p.is_file())
    wheel = 12_500_000  # transformers 5.23.0's wheel
    assert tree_bytes() + shared + wheel <= CALL_BYTES


def test_tree_bytes_counts_what_git_would_carry(tmp_path: Path):
    import subprocess

    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "kept.txt").write_bytes(b"x" * 100)
    (tmp_path / ".gitignore").write_text("/big/\n")
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "blob").write_bytes(b"y" * 10_000)
    assert tree_bytes(tmp_path) == 100 + len("/big/\n")


def test_the_reference_pair_travels_in_bf16_and_serves_the_same_bf16_model(tmp_path: Path):
    import torch

    from bench.gpu_calls import carried_in_bf16, copy_in_bf16
    from specloop.drafter.decode.engine import generate
    from specloop.drafter.decode.requests import StopRule
    from specloop.drafter.decode.sampling import SamplingParams
    from specloop.drafter.model.loading import load_model
    from tests.tiny import make_pair

    verifier, _ = make_pair(tmp_path / "pair")
    assert not carried_in_bf16(tmp_path / "pair")
    copy_in_bf16(tmp_path / "pair", tmp_path / "carried")
    assert carried_in_bf16(tmp_path / "carried")
    assert folder_size(tmp_path / "carried" / "verifier") < 0.6 * folder_size(verifier)
    a = load_model(verifier, weights="bf16")
    b = load_model(tmp_path / "carried" / "verifier", weights="bf16")
    assert a.lean.dtype == b.lean.dtype == torch.bfloat16
    assert torch.equal(a.lean.embed, b.lean.embed) and torch.equal(a.lean.layers[0].gate_up.weight, b.lean.layers[0].gate_up.weight)
    prompt = [[5, 9, 2, 7, 11, 3], [4, 4, 8]]
    outputs = [[g.token_ids for g in generate(m.lean, None, prompt, SamplingParams(max_tokens=16), 0, StopRule(()))]
               for m in (a, b)]
    assert outputs[0] == outputs[1] and len(outputs[0][0]) == 16


def folder_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
