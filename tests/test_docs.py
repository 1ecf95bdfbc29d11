"""The docs say what the code does: every `specloop ...` command line in README.md, docs/*.md and
deploy/README.md names a command that exists, with options that command takes, and every HTTP
endpoint the docs name (`GET /path`, `POST /path`) is a route of the API."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "deploy" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SEPARATORS = re.compile(r"\s*(?:\|\||&&|[|;#`)]|\$\(|\n)\s*")


def code_text(markdown: str) -> list[str]:
    """Fenced blocks (backslash-continued lines joined) and inline code spans."""
    blocks = re.findall(r"```[a-z]*\n(.*?)```", markdown, re.S)
    rest = re.sub(r"```[a-z]*\n.*?```", "", markdown, flags=re.S)
    return [b.replace("\\\n", " ") for b in blocks] + re.findall(r"`([^`\n]+)`", rest)


def command_lines(text: str) -> list[list[str]]:
    """The words after each `specloop` (up to a shell separator), as shlex splits them."""
    out = []
    for match in re.finditer(r"(?:^|[\s(=])specloop((?:\s+[^\s|;&#`)]+)*)", text):
        words = SEPARATORS.split(match.group(1).strip())[0]
        try:
            out.append(shlex.split(words))
        except ValueError:  # an unbalanced quote in prose: not a command line
            continue
    return [w for w in out if w]


def documented_commands() -> list[tuple[str, list[str]]]:
    found = []
    for doc in DOCS:
        for text in code_text(doc.read_text()):
            found += [(doc.relative_to(ROOT).as_posix(), words) for words in command_lines(text)]
    return found


def is_group(cmd) -> bool:
    return hasattr(cmd, "commands")


def resolve(root, words: list[str]) -> tuple[object, list[str], list[str]]:
    """The (sub)command the words name, the path to it, and the options given along the way (an
    option that takes a value skips its value)."""
    cmd, path, options, skip = root, [], [], False
    for word in words:
        if skip:
            skip = False
        elif word.startswith("-"):
            name = word.split("=", 1)[0]
            options.append(name)
            param = takes(cmd, name) or takes(root, name)
            skip = "=" not in word and param is not None and not getattr(param, "is_flag", False)
        elif is_group(cmd) and word in cmd.commands:
            cmd = cmd.commands[word]
            path.append(word)
        elif is_group(cmd) and not path:
            raise AssertionError(f"`specloop {word}` is not a command")
    return cmd, path, options


def takes(cmd, name: str):
    """The parameter of `cmd` that `name` spells, or None."""
    return next((p for p in cmd.params if name in (*p.opts, *p.secondary_opts)), None)


def option_names(cmd) -> set[str]:
    return {name for p in cmd.params for name in (*p.opts, *p.secondary_opts) if name.startswith("-")}


@pytest.fixture(scope="module")
def cli():
    from specloop.services.cli.main import app
    from specloop.services.cli.runtime import command

    return command(app)


def test_the_docs_name_commands(cli):
    assert len(documented_commands()) > 30


@pytest.mark.parametrize("doc, words", documented_commands(), ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_each_documented_command_line_exists(cli, doc, words):
    cmd, path, options = resolve(cli, words)
    known = option_names(cmd) | option_names(cli) | {"--help"}
    unknown = [o for o in options if o not in known]
    assert not unknown, f"{doc}: `specloop {' '.join(path)}` has no option {unknown}"


def documented_endpoints() -> set[tuple[str, str]]:
    out = set()
    for doc in DOCS:
        for method, path in re.findall(r"\b(GET|POST|PUT|DELETE) (/[A-Za-z0-9_/{}.:-]*[A-Za-z0-9_}])", doc.read_text()):
            out.add((method, re.sub(r"\{[^}]+\}", "{}", path)))
    return out


def test_each_documented_endpoint_is_a_route(tiny_pair):
    from specloop.drafter.model.loading import load_tokenizer
    from specloop.services.api.admin import make_admin_router
    from specloop.services.api.app import create_app
    from specloop.services.metrics.api import ApiMetrics

    app = create_app(None, load_tokenizer(tiny_pair[0]), "m", 64, make_admin_router(None, "t"), ApiMetrics(model_name="m"))
    routes = {(method, re.sub(r"\{[^}]+\}", "{}", route.path)) for route in app.routes
              for method in getattr(route, "methods", ()) or ()}
    documented = documented_endpoints()
    assert len(documented) > 10
    missing = sorted(e for e in documented if e not in routes and not e[1].startswith("/admin/...")
                     and not e[1].endswith("/..."))
    assert not missing, f"documented but not served: {missing}"


LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("doc", [*DOCS, ROOT / "bench" / "README.md"], ids=lambda p: str(p.relative_to(ROOT)))
def test_each_relative_link_points_at_a_file_that_exists(doc):
    """A link in the docs to a file of the repository ([engine](../drafter/decode/engine.py)) finds it."""
    targets = [t for t in LINK.findall(doc.read_text()) if "://" not in t and not t.startswith("mailto:")]
    missing = [t for t in targets if not (doc.parent / t).exists()]
    assert not missing, missing
