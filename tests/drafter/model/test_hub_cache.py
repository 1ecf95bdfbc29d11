"""MODEL as a Hugging Face model id: found in the local hub cache only (specloop.drafter.model.loading.resolve_model_dir)."""
from __future__ import annotations

import pytest

from specloop.drafter.model.loading import (
    ModelError,
    context_facts,
    hf_cache_dir,
    looks_like_repo_id,
    resolve_model_dir,
)
from tests.hub_helpers import fake_hub_cache

REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_a_cached_model_id_resolves_to_its_snapshot(reference_pair, tmp_path, monkeypatch):
    snapshot = fake_hub_cache(tmp_path / "hub", REPO, reference_pair[0])
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert hf_cache_dir() == tmp_path / "hub"  # read now, not when huggingface_hub was imported
    found = resolve_model_dir(REPO)
    assert found == snapshot and (found / "config.json").is_file()
    facts = context_facts(found)  # the snapshot reads as the model directory it links to
    assert facts == context_facts(reference_pair[0]) and facts.max_positions == 2048


def test_an_id_that_is_not_cached_is_a_model_error_saying_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(ModelError) as info:
        resolve_model_dir("owner/missing-model")
    message = str(info.value)
    assert "owner/missing-model" in message and "`hf download owner/missing-model`" in message
    assert str(tmp_path / "empty") in message and "local model directory" in message


def test_local_directories_and_other_paths_are_taken_as_given(tmp_path, monkeypatch):
    local = tmp_path / "owner" / "name"
    local.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    assert resolve_model_dir("owner/name") == local.relative_to(tmp_path)  # a directory wins over an id
    for path in ("v", "./a/b", "../a/b", "/abs/dir", "a/b/c"):
        assert resolve_model_dir(path).as_posix() == path.removeprefix("./")  # left for the loaders to refuse


def test_what_looks_like_a_model_id():
    assert looks_like_repo_id(REPO) and looks_like_repo_id("Qwen/Qwen2.5-0.5B-Instruct")
    for text in ("v", "a/b/c", "/a/b", "./a", "../a", "a/..b", "a/", "/b", "owner/-name"):
        assert not looks_like_repo_id(text), text


def test_hf_home_gives_the_cache_when_hf_hub_cache_is_unset(tmp_path, monkeypatch):
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hf_cache_dir() == tmp_path / "home" / "hub"
