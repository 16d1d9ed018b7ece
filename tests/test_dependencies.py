"""Dependencies between the package's parts run one way (docs/architecture.md, "Layers"): no subpackage (or
top-level module) imports another that imports it back, directly or through others. Imports inside functions
count: a lazy import is still a dependency. Read from the source with ast; nothing is imported."""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "marlaas_hpc"


def part_of(module: str) -> str | None:
    """'marlaas_hpc.env.pool' -> 'env'; 'marlaas_hpc.config' -> 'config'; None outside the package."""
    parts = module.split(".")
    return parts[1] if parts[0] == "marlaas_hpc" and len(parts) > 1 else None


def imported_modules(path: Path, module: str) -> set[str]:
    """Absolute names of the package modules `path` imports, anywhere in it (relative imports resolved)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: -node.level]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return {name for name in found if name.startswith("marlaas_hpc.")}


def part_edges() -> dict[str, dict[str, set[str]]]:
    """part -> imported part -> the 'module -> module' imports behind that edge."""
    edges: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = relative.parts[:-1] if relative.name == "__init__" else relative.parts
        module = ".".join(parts)
        mine = part_of(module)
        if mine is None:
            continue
        for other_module in imported_modules(path, module + (".__init__" if relative.name == "__init__" else "")):
            other = part_of(other_module)
            if other is not None and other != mine:
                edges[mine][other].add(f"{module} -> {other_module}")
    return edges


def find_cycle(edges: dict[str, dict[str, set[str]]]) -> list[str] | None:
    """One cycle of parts (first part repeated at the end), or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges.get(node, {})):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_check_sees_a_cycle():
    edges = {"a": {"b": {"a.x -> b.y"}}, "b": {"c": {"b.y -> c.z"}}, "c": {"a": {"c.z -> a.x"}}}
    assert find_cycle(edges) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": {"a.x -> b.y"}}}) is None


def test_no_part_of_the_package_imports_one_that_imports_it_back():
    edges = part_edges()
    assert "runtime" in edges and "config" in edges["runtime"], "the scan reads the package"
    cycle = find_cycle(edges)
    if cycle:
        why = "\n".join(f"  {a} -> {b}: " + "; ".join(sorted(edges[a][b])[:3]) for a, b in zip(cycle, cycle[1:]))
        raise AssertionError(f"import cycle {' -> '.join(cycle)}:\n{why}")
