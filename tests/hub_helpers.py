"""A Hugging Face hub cache laid out on disk as huggingface_hub leaves it, without downloading anything."""
from __future__ import annotations

from pathlib import Path


def fake_hub_cache(cache: Path, repo_id: str, model_dir: Path, revision: str = "0123456789abcdef") -> Path:
    """`cache`/models--OWNER--NAME/{refs/main, snapshots/REVISION/*} with the snapshot's files symlinked to
    `model_dir`'s (as the hub links them to its blobs); returns the snapshot folder."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for f in Path(model_dir).iterdir():
        if f.is_file():
            (snapshot / f.name).symlink_to(f.resolve())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return snapshot
