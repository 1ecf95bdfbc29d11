"""What `pip install .` installs: one top-level package, `specloop`, whose rooms are the top-level folders,
with every file those folders track (sources, C++ and prompt examples alike)."""
from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROOMS = ("drafter", "trainer", "services")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """The wheel of a copy of the checkout's tracked files (a build in the checkout would write build/ and
    the egg-info beside the tests that run from it)."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.split()
    for name in listed:
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(src)], check=True, capture_output=True, text=True, timeout=300)
    (path,) = out.glob("specloop-*.whl")
    return zipfile.ZipFile(path)


def tracked(folder: str) -> set[str]:
    """Files git tracks under `folder`, as the wheel names them (specloop/<folder>/...)."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", folder], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout
    return {f"specloop/{name}" for name in listed.split()}


def test_the_wheel_installs_one_top_level_package(wheel):
    tops = {name.split("/")[0] for name in wheel.namelist() if not name.split("/")[0].endswith(".dist-info")}
    assert tops == {"specloop"}


def test_every_file_of_the_rooms_is_in_the_wheel(wheel):
    names = set(wheel.namelist())
    missing = sorted(f for room in ROOMS for f in tracked(room) - names)
    assert not missing, missing


def test_the_console_script_is_the_cli(wheel):
    dist = next(n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt"))
    assert "specloop = specloop.services.cli.main:main" in wheel.read(dist).decode()
