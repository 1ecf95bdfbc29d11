"""Helpers several test modules share (moved from test_deploy.py)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


DEPLOY = ROOT / "deploy"


def _load_render():
    spec = importlib.util.spec_from_file_location("deploy_render", DEPLOY / "render.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render = _load_render()
