"""House budgets, read from the source with `ast` (no import, no job): test modules import only tests/support/,
product files and functions stay short, rank 0's main class stays small, and every path the docs cite exists.

Today's offenders are listed by name with the value measured when they were listed. The tests fail when a new
offender appears, when a listed one grows, and when a listed one is back within budget (then strike it off)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "marlaas_hpc"
TESTS = ROOT / "tests"
FILE_LINES = 800
FUNCTION_LINES = 80
RANK0_CLASS = ("runtime/scheduler_rank.py", "SchedulerRank")
RANK0_CLASS_LINES = 300
RANK0_CLASS_ATTRIBUTES = 15

LONG_FILES: dict[str, int] = {}
"""Product files over FILE_LINES today: lines as measured (none since the runtime split, 2026-11-28)."""
LONG_FUNCTIONS: dict[str, int] = {}
"""Product functions over FUNCTION_LINES today (def line to last line): none since the runtime split."""
RANK0_CLASS_TODAY: dict[str, int] = {}
"""SchedulerRank over its budget (none since rank 0 became a loop over runtime/rank0/)."""
NOT_REPO_PATHS = {
    "ranks/rank0.json": "a run dir's record (RUN_DIR/ranks/), not a file of the repository",
    "status/summary.json": "'status.json or summary.json' of a run dir",
}
"""Path-like words in the docs that name no file of the repository, and why."""


def _product_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _name(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def _over_budget(measured: dict[str, int], budget: int, allowed: dict[str, int]) -> list[str]:
    """What breaks the budget beyond the allow-list, what grew on it, and what left it (to strike off)."""
    problems = [f"{name}: {value} > {budget} (new)" for name, value in measured.items()
                if value > budget and name not in allowed]
    problems += [f"{name}: {measured[name]} > {allowed[name]} listed (grew)" for name in allowed
                 if measured.get(name, 0) > allowed[name]]
    problems += [f"{name}: {measured.get(name, 'gone')} is within {budget}: strike it off the allow-list"
                 for name in allowed if measured.get(name, 0) <= budget]
    return problems


def _functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, lines) of every function and method, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{prefix}{node.name}"
            if not isinstance(node, ast.ClassDef):
                yield name, node.end_lineno - node.lineno + 1
            yield from _functions(node, f"{name}.")
        else:
            yield from _functions(node, prefix)


def _imported_modules(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add("." * node.level + (node.module or ""))
    return names


def _is_test_module(module: str) -> bool:
    """`test_x`, `tests.test_x`, `conftest`, a relative import of either: a module pytest collects."""
    last = module.lstrip(".").split(".")
    return any(part.startswith("test_") or part == "conftest" for part in last)


def test_no_test_module_imports_another_test_module():
    """Helpers live in tests/support/; a test module (or a support module) importing a test module runs that
    module's import-time code twice and ties two test files together."""
    sources = sorted(TESTS.rglob("*.py"))
    assert len(sources) > 50, "the scan found the test files"
    offenders = [f"{path.relative_to(ROOT)} imports {module}" for path in sources
                 for module in sorted(_imported_modules(ast.parse(path.read_text())))
                 if _is_test_module(module)]
    assert not offenders, "\n".join(offenders)


def test_tests_folder_holds_only_test_modules_and_conftest():
    """Anything else a test needs (helpers, rank programs run under mpirun) belongs in tests/support/."""
    loose = [path.name for path in TESTS.glob("*.py") if not path.name.startswith("test_")
             and path.name != "conftest.py"]
    assert not loose, f"move these into tests/support/: {loose}"


def test_product_files_stay_within_the_line_budget():
    measured = {_name(path): len(path.read_text().splitlines()) for path in _product_files()}
    assert len(measured) > 50, "the scan found the package"
    problems = _over_budget(measured, FILE_LINES, LONG_FILES)
    assert not problems, "\n".join(problems)


def test_product_functions_stay_within_the_line_budget():
    measured = {f"{_name(path)}::{name}": lines for path in _product_files()
                for name, lines in _functions(ast.parse(path.read_text()))}
    assert len(measured) > 500, "the scan found the functions"
    problems = _over_budget(measured, FUNCTION_LINES, LONG_FUNCTIONS)
    assert not problems, "\n".join(problems)


def _instance_attributes(cls: ast.ClassDef) -> set[str]:
    """Names assigned as `self.NAME` anywhere in the class, and its annotated class-level fields."""
    names = {node.target.id for node in cls.body
             if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        names |= {part.attr for target in targets for part in ast.walk(target)
                  if isinstance(part, ast.Attribute) and isinstance(part.value, ast.Name) and part.value.id == "self"}
    return names


def test_rank_0s_main_class_stays_small():
    """SchedulerRank (rank 0's loop) within RANK0_CLASS_LINES lines and RANK0_CLASS_ATTRIBUTES attributes; until
    then, no larger than measured when the budget was set."""
    path, name = RANK0_CLASS
    tree = ast.parse((PACKAGE / path).read_text())
    (cls,) = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == name]
    measured = {"lines": cls.end_lineno - cls.lineno + 1, "attributes": len(_instance_attributes(cls))}
    budget = {"lines": RANK0_CLASS_LINES, "attributes": RANK0_CLASS_ATTRIBUTES}
    for what in measured:
        allowed = {what: RANK0_CLASS_TODAY[what]} if RANK0_CLASS_TODAY.get(what, 0) > budget[what] else {}
        problems = _over_budget({what: measured[what]}, budget[what], allowed)
        assert not problems, f"{name}: " + "; ".join(problems)


CITED_PATH = re.compile(r"(?<![\w/.:<$*{-])((?:[\w.-]+/)+[\w.-]+\.(?:py|sh|ya?ml|md|toml|txt|sbatch|cfg|j2|json|csv|png"
                        r"|cpp|c|h))(?![\w/*<>{}-])")
"""A path with a folder and a file extension; not part of a URL, a glob or a placeholder (RUN_DIR/..., <N>)."""


def _cited_paths(doc: Path):
    for number, line in enumerate(doc.read_text().splitlines(), 1):
        for match in CITED_PATH.finditer(line):
            path = match.group(1)
            if not path.split("/")[0].isupper():  # RUN_DIR/..., a placeholder
                yield number, path


def test_every_file_path_the_docs_cite_exists():
    """README.md and docs/**.md: a cited path resolves from the repository root, from marlaas_hpc/ (the docs'
    short form, `runtime/main.py`) or from the citing document's folder (its links)."""
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    cited = [(doc, number, path) for doc in docs for number, path in _cited_paths(doc)]
    assert len(cited) > 100, "the scan found the docs' paths"
    bases = (ROOT, PACKAGE)
    missing = [f"{doc.relative_to(ROOT)}:{number}: {path}" for doc, number, path in cited
               if path not in NOT_REPO_PATHS and not any((base / path).exists() for base in (*bases, doc.parent))]
    assert not missing, "cited but not in the repository:\n" + "\n".join(missing)
    found = {path for _, _, path in cited}
    assert set(NOT_REPO_PATHS) <= found, f"no longer cited, strike off: {set(NOT_REPO_PATHS) - found}"
