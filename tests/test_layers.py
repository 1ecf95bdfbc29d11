"""The layers: specloop.drafter.model ← .drafter.decode ← .drafter.kinds ← .trainer ← .services (← bench,
tests). Nothing lower imports higher, at module level or inside a function; no module imports itself round
a circle; every name has one import path (no module re-exports what it imported); nothing imports the
folders by their bare names (`drafter.x` would load a second copy of `specloop.drafter.x`)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# (module prefix, folder), lowest first; the package drafter/__init__.py belongs to the lowest layer
LAYERS = (("specloop.drafter.model", "drafter/model"), ("specloop.drafter.decode", "drafter/decode"),
          ("specloop.drafter.kinds", "drafter/kinds"), ("specloop.trainer", "trainer"),
          ("specloop.services", "services"))
FOLDERS = ("drafter", "trainer", "services")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["specloop", *parts]) if parts[0] in FOLDERS else ".".join(parts)


def rank(module: str) -> int | None:
    """The layer of a specloop module (None outside them)."""
    if module == "specloop.drafter":
        return 0
    for i, (prefix, _) in enumerate(LAYERS):
        if module == prefix or module.startswith(prefix + "."):
            return i
    return None


def imports(path: Path) -> set[str]:
    """Every module `path` imports (absolute names; relative imports resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path).rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def package_files() -> dict[str, Path]:
    return {module_name(p): p for folder in FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))}


def test_every_module_sits_in_a_layer():
    assert [name for name in package_files() if rank(name) is None] == []


def test_no_layer_imports_a_higher_one():
    wrong = []
    for name, path in package_files().items():
        mine = rank(name)
        wrong += [f"{name} imports {m}" for m in sorted(imports(path)) if (rank(m) or 0) > mine]
    assert not wrong, "\n".join(wrong)


def test_nothing_imports_the_folders_by_their_bare_names():
    files = [p for folder in (*FOLDERS, "bench", "tests", "specloop") for p in sorted((ROOT / folder).rglob("*.py"))]
    bare = [f"{p.relative_to(ROOT)} imports {m}" for p in files for m in sorted(imports(p))
            if m.split(".")[0] in FOLDERS]
    assert not bare, "\n".join(bare)


def _top_level(tree: ast.Module) -> tuple[set[str], dict[str, str]]:
    """(names a module defines, names it imports from a specloop module → that module)."""
    defined, imported = set(), {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("specloop."):
            imported.update({a.asname or a.name: node.module for a in node.names})
    return defined, imported


def test_every_name_has_one_import_path():
    """`from specloop.X import n` finds n defined in X (or n is a submodule of X), never a name X imported."""
    files = package_files()
    tables = {name: _top_level(ast.parse(path.read_text())) for name, path in files.items()}
    users = [p for folder in (*FOLDERS, "bench", "tests") for p in sorted((ROOT / folder).rglob("*.py"))]
    wrong = []
    for path in users:
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.module in tables):
                continue
            defined, imported = tables[node.module]
            wrong += [f"{path.relative_to(ROOT)}: {n.name} from {node.module} (defined in {imported[n.name]})"
                      for n in node.names if n.name in imported and n.name not in defined
                      and f"{node.module}.{n.name}" not in tables]
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle_at_module_level():
    """Module-level imports only (a function's import runs later, after every module loaded)."""
    graph = {}
    files = package_files()
    for name, path in files.items():
        tree = ast.parse(path.read_text())
        deps = set()
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                deps.add(node.module)
                deps.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
        graph[name] = {d for d in deps if d in files and d != name}
    seen, stack, cycles = set(), [], []

    def visit(node: str) -> None:
        if node in stack:
            cycles.append(stack[stack.index(node):] + [node])
            return
        if node in seen or node not in graph:
            return
        seen.add(node)
        stack.append(node)
        for dep in sorted(graph[node]):
            visit(dep)
        stack.pop()

    for node in sorted(graph):
        visit(node)
    assert not cycles, cycles[:3]
