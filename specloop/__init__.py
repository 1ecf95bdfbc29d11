"""specloop: lossless speculative decoding whose drafter keeps learning from the verifier while it serves.

One top-level name, three rooms that live in the repository's top-level folders:
- `specloop.drafter` (drafter/): the verifier's runtime (`model`), the decode step (`decode`), the drafter
  kinds (`kinds`);
- `specloop.trainer` (trainer/): offline and online training of drafters, the model fetch;
- `specloop.services` (services/): the API, the workers, the learner, the registry, the replay buffer,
  metrics and the CLI.

An installed specloop (`pip install .`) holds them inside this package. In a checkout that is run without
installing it (`PYTHONPATH=. python bench/...`), the finder below maps `specloop.drafter` (and the other
two) to the folder of that name beside this one; nothing else in the checkout becomes importable
through `specloop`.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

ROOMS = ("drafter", "trainer", "services")


class _CheckoutFinder(importlib.abc.MetaPathFinder):
    """Finds specloop.drafter / .trainer / .services in the checkout's top-level folders; their own
    submodules are then found through each package's __path__."""

    def __init__(self, root: Path):
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        top, _, room = fullname.partition(".")
        if top != __name__ or room not in ROOMS:
            return None
        init = self.root / room / "__init__.py"
        return importlib.util.spec_from_file_location(fullname, init, submodule_search_locations=[str(init.parent)])


def _in_checkout() -> Path | None:
    here = Path(__file__).resolve().parent
    if (here / "drafter").is_dir():  # installed: the rooms are inside the package
        return None
    root = here.parent
    return root if all((root / room / "__init__.py").is_file() for room in ROOMS) else None


_root = _in_checkout()
if _root is not None and not any(isinstance(f, _CheckoutFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _CheckoutFinder(_root))
