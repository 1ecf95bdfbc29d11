"""How the one `specloop` Typer app is assembled and run.

- `expand`: a command parameter typed as an option group (specloop.services.cli.options) becomes the group's
  fields as Typer options; the call gets the dataclass back, with where each value came from.
- `build`: every command gets the global options (Globals) and the SPECLOOP_ environment prefix,
  so `specloop --threads 2 serve` and `specloop serve --threads 2` mean the same.
- `run`: precedence command line > SPECLOOP_<OPTION> > --config FILE (YAML) > default (the config
  becomes click's default_map); errors become one `specloop: error: ...` line and an exit code
  (2: bad input; 1: refused or unreachable, raised as CommandError by the commands).
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import sys
import typing
from dataclasses import dataclass
from pathlib import Path

import typer

from specloop.services.cli.options import Globals, UsageError

EXIT_REFUSED, EXIT_USAGE = 1, 2
ENV_PREFIX = "SPECLOOP"

try:  # typer >= 0.2x vendors click
    from typer._click import exceptions as click_errors
except ImportError:  # older typer runs on click
    # the same module, unvendored: mypy only allows one import per name (python/mypy#1153)
    from click import exceptions as click_errors  # type: ignore[no-redef]


def is_group(cmd) -> typing.TypeGuard[typer.core.TyperGroup]:
    """A command with subcommands (typer's group class is no click.Group since typer vendors click)."""
    return isinstance(getattr(cmd, "commands", None), dict)


class CommandError(Exception):
    """A command that cannot be done (refused, unreachable, failed): one line on stderr and its exit code."""

    def __init__(self, message: str, exit_code: int = EXIT_REFUSED):
        super().__init__(message)
        self.exit_code = exit_code


# ---------------------------------------------------------------- option groups → options


def _is_group(annotation) -> bool:
    return dataclasses.is_dataclass(annotation) and isinstance(annotation, type)


def _fields(cls) -> list[inspect.Parameter]:
    hints = typing.get_type_hints(cls, include_extras=True)
    return [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=hints[f.name],
                              default=inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default)
            for f in dataclasses.fields(cls) if f.init]  # a field without a default: a required option


def group_from_params(cls, params: dict, ctx=None):
    """The option group `cls` from parsed values (popped from `params`), with each value's source."""
    names = [p.name for p in _fields(cls)]
    group = cls(**{name: params.pop(name) for name in names})
    if ctx is not None and hasattr(group, "sources"):
        group.sources.update({name: ctx.get_parameter_source(name).name for name in names})
    return group


def expand(func):
    """`func` with each option-group parameter replaced by the group's fields, plus the global options
    (resolved against the ones given before the command: see `settle_globals`)."""
    signature = inspect.signature(func)
    hints = typing.get_type_hints(func, include_extras=True)
    groups = {name: hints[name] for name in signature.parameters if _is_group(hints.get(name))}
    if Globals not in groups.values():
        groups["_globals"] = Globals
    params = []  # in the signature's order, a group's fields in its place; the global options last
    for p in signature.parameters.values():
        if p.name not in groups:
            params.append(p.replace(kind=inspect.Parameter.KEYWORD_ONLY, annotation=hints.get(p.name, p.annotation)))
        elif groups[p.name] is not Globals:
            params += _fields(groups[p.name])
    ctx_name = next((p.name for p in params if p.annotation is typer.Context), None)
    if ctx_name is None:
        params.append(inspect.Parameter("_ctx", inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context))
    params += _fields(Globals)
    names = [p.name for p in params]
    assert len(names) == len(set(names)), f"{func.__name__}: an option is declared twice: {names}"

    globals_name = next(name for name, cls in groups.items() if cls is Globals)

    @functools.wraps(func)
    def wrapper(**kwargs):
        ctx = kwargs[ctx_name] if ctx_name else kwargs.pop("_ctx")
        for name, cls in groups.items():
            kwargs[name] = group_from_params(cls, kwargs, ctx)
        settled = settle_globals(ctx, kwargs.pop(globals_name))
        if globals_name != "_globals":
            kwargs[globals_name] = settled
        return func(**kwargs)

    wrapper.__signature__ = inspect.Signature(params)
    wrapper.__annotations__ = {p.name: p.annotation for p in params}
    return wrapper


def settle_globals(ctx: typer.Context, own: Globals) -> Globals:
    """The global options in effect: those given on this command's command line, else those of the
    command line before it (each of which already went through environment, config and default).
    Stored as ctx.obj for the commands below; applies --log-level."""
    before = ctx.obj if isinstance(ctx.obj, Globals) else None
    if before is not None:
        own = dataclasses.replace(before, **{f: getattr(own, f) for f in own.sources
                                             if own.sources[f] == "COMMANDLINE"})
    ctx.obj = own
    if own.log_level is not None:  # only when asked: tests and embedders keep their logging set-up
        logging.getLogger("specloop").setLevel(own.log_level.upper())
        if not logging.getLogger().handlers:
            logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return own


def prepare(app: typer.Typer, root: bool = True) -> None:
    """Every command of `app` and its sub-apps: option groups expanded, the global options added and
    options read from SPECLOOP_<NAME> (a flat prefix: SPECLOOP_PORT, not SPECLOOP_SERVE_PORT)."""
    infos = list(app.registered_commands) + ([app.registered_callback] if root and app.registered_callback else [])
    for info in infos:
        info.callback = expand(info.callback)
        info.context_settings = {**(info.context_settings or {}), "auto_envvar_prefix": ENV_PREFIX}
    for group in app.registered_groups:
        assert group.typer_instance is not None  # add_typer always gives one
        prepare(group.typer_instance, root=False)


@functools.cache
def command(app: typer.Typer):
    """The click command of `app` (prepared once), its help ending with every command in full."""
    prepare(app)
    app.info.context_settings = {**(app.info.context_settings or {}), "auto_envvar_prefix": ENV_PREFIX}
    root = typer.main.get_command(app)
    assert is_group(root)  # an app with a callback and subcommands is a group
    groups = [f"specloop {name} {'|'.join(sub.commands)}" for name, sub in root.commands.items() if is_group(sub)]
    root.epilog = f"Commands with subcommands (each with --help): {', '.join(groups)}."
    return root


def use_threads(threads: int) -> None:
    """torch's intra-op threads (commands that run models call this; the operator commands do not import torch)."""
    import torch

    torch.set_num_threads(threads)


def version() -> str:
    """specloop's version: the installed distribution's, else pyproject.toml's."""
    from importlib import metadata

    try:
        return metadata.version("specloop")
    except metadata.PackageNotFoundError:
        import re

        text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
        found = re.search(r'^version\s*=\s*"([^"]+)"', text, re.M)
        assert found is not None  # pyproject.toml names the version
        return found.group(1)


def show_version(value: bool) -> None:
    """--version (eager): print `specloop VERSION` and stop."""
    if value:
        print(f"specloop {version()}")
        raise typer.Exit(0)


# ---------------------------------------------------------------- argv, --config


def _option(cmd, token: str):
    return next((p for p in cmd.params if token in getattr(p, "opts", ()) + getattr(p, "secondary_opts", ())), None)


def command_path(root, argv: list[str]) -> tuple[list[str], object]:
    """The command names in `argv` and the command they lead to (without parsing the options)."""
    names, cmd, tokens = [], root, iter(argv)
    for token in tokens:
        if token == "--" or not is_group(cmd):
            break
        if token.startswith("-"):
            param = _option(cmd, token)
            if param is not None and "=" not in token and not getattr(param, "is_flag", False):
                next(tokens, None)  # the option's value
            continue
        if token not in cmd.commands:
            break
        names.append(token)
        cmd = cmd.commands[token]
    return names, cmd


def spread(argv: list[str], option: str) -> list[str]:
    """`--prompts A B` as `--prompts A --prompts B`: an option that takes every value up to the next
    option (argparse's nargs="+", which click does not have)."""
    out, i = [], 0
    while i < len(argv):
        token, i = argv[i], i + 1
        out.append(token)
        if token == "--":
            return out + argv[i:]
        if token == option:
            start = i
            while i < len(argv) and not argv[i].startswith("-"):
                out += [option, argv[i]] if i > start else [argv[i]]
                i += 1
    return out


def config_path(argv: list[str]) -> Path | None:
    """--config FILE anywhere on the command line (before `--`), else $SPECLOOP_CONFIG."""
    import os

    for i, token in enumerate(argv):
        if token == "--":
            break
        if token == "--config" and i + 1 < len(argv):
            return Path(argv[i + 1])
        if token.startswith("--config="):
            return Path(token.split("=", 1)[1])
    return Path(os.environ[f"{ENV_PREFIX}_CONFIG"]) if os.environ.get(f"{ENV_PREFIX}_CONFIG") else None


def option_keys(cmd) -> dict[str, str]:
    """Config keys a command accepts (option long names without dashes; argument names) → parameter names."""
    keys: dict[str, str] = {}
    for param in cmd.params:
        opts = [o[2:] for o in getattr(param, "opts", []) if o.startswith("--")] if param.param_type_name == "option" \
            else [param.name]
        keys |= {opt: param.name for opt in opts if opt not in ("help", "version", "config")}
    return keys


def read_config(path: Path) -> dict:
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise UsageError(f"--config {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise UsageError(f"--config {path}: not YAML: {str(exc).splitlines()[0]}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(f"--config {path}: expected a mapping of option names to values")
    return data


def default_map(root, argv: list[str]) -> dict | None:
    """The config file's values as click's default_map: global options at the top, the others under the
    command's path; a key the command does not know is a UsageError."""
    path = config_path(argv)
    if path is None:
        return None
    names, leaf = command_path(root, argv)
    top, own = {}, {}
    global_keys, leaf_keys = option_keys(root), option_keys(leaf)
    for key, value in read_config(path).items():
        name = str(key).replace("_", "-")
        if name in global_keys:
            top[global_keys[name]] = value
        elif name in leaf_keys and not is_group(leaf):
            own[leaf_keys[name]] = value
        elif not is_group(leaf):
            known = ", ".join(sorted(leaf_keys))
            raise UsageError(f"--config {path}: unknown key {key!r} for `specloop {' '.join(names)}` (known: {known})")
    for name in reversed(names):
        own = {name: own}
    return own | top


# ---------------------------------------------------------------- running


@dataclass(frozen=True)
class Greedy:
    """An option of one command that takes several values at once (`specloop replay --prompts A B`)."""

    path: tuple[str, ...]
    option: str


def fail(message: str, code: int = EXIT_USAGE) -> int:
    print(f"specloop: error: {message}", file=sys.stderr)
    return code


def run(app: typer.Typer, argv: list[str], greedy: tuple[Greedy, ...] = ()) -> int:
    """Run one `specloop` command line; its exit code."""
    root = command(app)
    try:
        names = tuple(command_path(root, argv)[0])
        for g in greedy:
            argv = spread(argv, g.option) if names == g.path else argv
        result = root.main(args=argv, prog_name="specloop", standalone_mode=False, default_map=default_map(root, argv))
    except CommandError as exc:
        return fail(str(exc), exc.exit_code)
    except click_errors.UsageError as exc:  # unknown command or option, missing argument, bad value
        if type(exc).__name__ == "NoArgsIsHelpError":
            exc.show()
            return EXIT_USAGE
        ctx = getattr(exc, "ctx", None)
        hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
        return fail(exc.format_message() + hint)
    except typer.Abort:
        return fail("interrupted", 130)
    except typer.Exit as exc:
        return exc.exit_code
    except ValueError as exc:  # UsageError, drafter.model.loading.ModelError, services.prompts.PromptError, a bad value
        return fail(str(exc))
    return result if isinstance(result, int) else 0
