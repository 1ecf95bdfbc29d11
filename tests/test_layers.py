"""The layers: drafter ← trainer ← services (← bench, tests). Nothing lower imports higher, at module
level or inside a function, and no module imports itself round a circle within its layer."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("drafter", "trainer", "services")


def imports(path: Path) -> set[str]:
    """Every module `path` imports (absolute names; relative imports resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
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


def modules(layer: str) -> dict[str, Path]:
    return {".".join(p.relative_to(ROOT).with_suffix("").parts): p for p in sorted((ROOT / layer).rglob("*.py"))}


def test_no_layer_imports_a_higher_one():
    wrong = []
    for rank, layer in enumerate(LAYERS):
        higher = LAYERS[rank + 1:]
        for name, path in modules(layer).items():
            wrong += [f"{name} imports {m}" for m in sorted(imports(path)) if m.split(".")[0] in higher]
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle_at_module_level():
    """Module-level imports only (a function's import runs later, after every module loaded)."""
    graph = {}
    for layer in LAYERS:
        for name, path in modules(layer).items():
            tree = ast.parse(path.read_text())
            deps = set()
            for node in tree.body:
                if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    deps.add(node.module)
                elif isinstance(node, ast.Import):
                    deps.update(a.name for a in node.names)
            graph[name] = {d for d in deps if d in graph or d.split(".")[0] in LAYERS}
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
