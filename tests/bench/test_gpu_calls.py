"""bench/gpu_calls.py: every stage's call is one bench/gpu.py knows, and fits what a device call carries."""
from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from bench.gpu import PATHS, SECTIONS, parser
from bench.gpu_calls import CALL_BYTES, KEEP, KEEPS, ROOT, SLACK, STAGES, commands, parts, tree_bytes, write_parts

GZ_BYTES = 92_600_000  # the fetched Q4_1 GGUF (98.4 MB) through gzip -1 (bench/README.md section 34)
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
    assert "gunzip > /tmp/smol.gguf" in cmds[0] and f"cat {KEEP}/gguf.gz.part* |" in cmds[0]
    assert "convert_gguf" in cmds[1] and "/tmp/fetched/verifier" in cmds[1]
    assert "bench/gpu.py" in cmds[-2] and "--eagle-head /tmp/fetched/drafter" in cmds[-2] and "--smoke" in cmds[-2]
    assert not any("pip install" in c for c in cmds)  # here: this venv's packages


def test_gzip_parts_are_as_few_as_fit_and_rebuild_the_file_byte_for_byte():
    data = bytes(range(256)) * 4000 + b"tail"  # ~1 MB that gzip leaves at ~1 MB
    packed = len(gzip.compress(data, compresslevel=1))
    for room, n in ((packed, 1), (packed - 1, 2), ((packed + 1) // 2, 2), (packed // 2 - 1, 3)):
        cut = parts(data, room)
        assert len(cut) == n and all(len(c) <= room for c in cut) and gzip.decompress(b"".join(cut)) == data
    with pytest.raises(SystemExit, match="keep stages"):
        parts(data, packed // (len(KEEPS) + 1))


def test_written_parts_are_kept_while_they_fit_and_cut_again_when_the_tree_grows(tmp_path: Path):
    gguf, fetch = tmp_path / "m.gguf", tmp_path / "fetch"
    gguf.write_bytes(bytes(range(256)) * 4000)
    packed = len(gzip.compress(gguf.read_bytes(), compresslevel=1))
    assert write_parts(gguf, fetch, packed // 2 + 1) == 2
    before = (fetch / "a" / "gguf.gz.part00").stat().st_mtime_ns
    assert write_parts(gguf, fetch, packed // 2 + 100) == 2  # still fits: kept as it was
    assert (fetch / "a" / "gguf.gz.part00").stat().st_mtime_ns == before
    assert write_parts(gguf, fetch, packed // 3 + 1) == 3  # the tree grew: three parts, in order
    joined = b"".join((fetch / k / f"gguf.gz.part{i:02d}").read_bytes() for i, k in enumerate("abc"))
    assert gzip.decompress(joined) == gguf.read_bytes()
    assert write_parts(gguf, fetch, packed) == 3  # room again for fewer: three that fit are kept


def test_the_fetched_gguf_goes_in_parts_that_fit_beside_the_tree():
    # every call carries the tracked tree; the GGUF's gzip goes in as many keep calls as fit beside it (each ~15 s
    # of the session's 900 s of device time): two while the tree is under ~19.8 MiB, three up to ~32 MiB
    room = CALL_BYTES - tree_bytes() - SLACK
    assert -(-GZ_BYTES // room) <= len(KEEPS), f"tree {tree_bytes() / 2**20:.1f} MiB"
    assert {f"keep-{k}" for k in KEEPS} <= set(STAGES)


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
