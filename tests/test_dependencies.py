"""Dependencies between the package's parts run one way (docs/architecture.md, "Layers"): no subpackage (or
top-level module) imports another that imports it back, directly or through others. Imports inside functions
count: a lazy import is still a dependency. Read from the source with ast; nothing is imported.

And the package holds only the product: every module is reached from an entry point (`ENTRY_POINTS`) through the
package's own imports. A module imported only by tests or tools/ is lab code: test support goes to tests/support/,
benchmark harnesses and studies to tools/ (docs/architecture.md §12)."""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "marlaas_hpc"


def part_of(module: str) -> str | None:
    """'marlaas_hpc.env.pool' -> 'env'; 'marlaas_hpc.config' -> 'config'; None outside the package."""
    parts = module.split(".")
    return parts[1] if parts[0] == "marlaas_hpc" and len(parts) > 1 else None


def imported_modules(path: Path, module: str, package: str = "marlaas_hpc") -> set[str]:
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
    return {name for name in found if name.startswith(package + ".")}


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


ENTRY_POINTS = {
    "marlaas_hpc.cli": "the `marlaas` command (pyproject.toml [project.scripts])",
    "marlaas_hpc.runtime.main": "every rank of a job: python -m marlaas_hpc.runtime.main (cli.py, runtime/scaling.py)",
    "marlaas_hpc.submit": "every rank of a submitit het job: python -m marlaas_hpc.submit",
    "marlaas_hpc.launch.hetjob_task": "a HetJobExecutor job's rank: python -m marlaas_hpc.launch.hetjob_task",
    "marlaas_hpc.launch.ulfm_slurm": "ULFM's mpiexec in an allocation: python -m marlaas_hpc.launch.ulfm_slurm",
    "marlaas_hpc.launch.step_guard": "the batch script's srun guard: python -m marlaas_hpc.launch.step_guard",
    "marlaas_hpc.launch.probe": "the layout check on the nodes: srun ... python -m marlaas_hpc.launch.probe",
    "marlaas_hpc.plan.dry_run": "the GPU dry run in a process of its own: python -m marlaas_hpc.plan.dry_run",
    "marlaas_hpc.rollout.vllm_plugin": "vLLM's general plugin (pyproject.toml [project.entry-points])",
}
"""Modules a process starts from (python -m, a console script, a plugin entry point): the roots of the product."""


def package_modules(root: Path, package: str) -> dict[str, tuple[Path, str]]:
    """'pkg.a.b' -> (its file, the name its relative imports resolve from: 'pkg.a.__init__' for a package)."""
    modules = {}
    for path in (root / package).rglob("*.py"):
        relative = path.relative_to(root).with_suffix("")
        is_package = relative.name == "__init__"
        name = ".".join(relative.parts[:-1] if is_package else relative.parts)
        modules[name] = (path, name + ".__init__" if is_package else name)
    return modules


def unreached_modules(root: Path, package: str, entry_points) -> list[str]:
    """The package's modules that no entry point imports, directly or through other modules of the package (lazy
    imports included; importing 'pkg.a.b' imports the packages 'pkg' and 'pkg.a' too)."""
    modules = package_modules(root, package)
    reached, todo = set(), list(entry_points)
    while todo:
        module = todo.pop()
        if module in reached or module not in modules:
            continue
        reached.add(module)
        path, anchor = modules[module]
        for name in imported_modules(path, anchor, package):
            parts = name.split(".")
            todo += [".".join(parts[:k]) for k in range(1, len(parts) + 1)]
    return sorted(set(modules) - reached - {package})


def test_the_check_sees_a_module_no_entry_point_reaches(tmp_path):
    files = {"cli.py": "from pkg.core import run\n", "core/__init__.py": "", "core/run.py": "import os\n",
             "core/lazy.py": "", "study.py": "from pkg import helper\n", "helper.py": "",
             "core/uses_lazy.py": "def f():\n    from .lazy import x\n"}
    for name, text in files.items():
        (tmp_path / "pkg" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "pkg" / name).write_text(text)
    assert unreached_modules(tmp_path, "pkg", ["pkg.cli"]) == ["pkg.core.lazy", "pkg.core.uses_lazy", "pkg.helper",
                                                                "pkg.study"]
    (tmp_path / "pkg" / "core" / "run.py").write_text("from . import uses_lazy\n")  # reached now, lazily too
    assert unreached_modules(tmp_path, "pkg", ["pkg.cli"]) == ["pkg.helper", "pkg.study"]


def test_every_module_of_the_package_is_product_reached_from_an_entry_point():
    """Lab code (imported only by tests/ or tools/) lives there, not in the package."""
    modules = package_modules(PACKAGE.parent, "marlaas_hpc")
    assert not [m for m in ENTRY_POINTS if m not in modules], "an entry point listed is gone: strike it off"
    assert len(modules) > 100 and "marlaas_hpc.sim.engine" in modules, "the scan reads the package"
    unreached = unreached_modules(PACKAGE.parent, "marlaas_hpc", ENTRY_POINTS)
    assert not unreached, ("imported only by tests/ or tools/ (or by nothing): move to tests/support/ or tools/, "
                           f"or list a new entry point: {unreached}")
