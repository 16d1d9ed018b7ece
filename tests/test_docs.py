"""The examples in README.md and docs/ are true as written (issue #37; docs/testing.md lists the rules).

- every fenced `yaml` example parses and validates: a TaskSpec (it has `task_id`), or a job config or a fragment of
  one laid over configs/local-demo.yaml (a task's fragment over its first task), loaded by JobConfig;
- every command in a fenced `bash` example names a `marlaas` subcommand and flags its --help lists, a tool or module
  that exists and parses those flags, paths that exist, pytest markers pyproject.toml declares; commands written
  inline (`marlaas ...`, `python tools/...`) are held to the same;
- the cheap commands (`marlaas plan`, `sbatch`, `simulate`, `--help`) run here, their comments' figures checked
  against what they print; every other command names the tests that run it ("tested by tests/x.py::test_y");
- every path and link the pages cite exists, and so does every `docs/architecture.md §N` they refer to;
- the README is a page that opens with the two commands, and its first run prints what it shows (slow).

test_each_check_fails_on_a_broken_example shows that each rule catches what it is for."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
TOP_LEVEL = (".ci", "marlaas_hpc", "configs", "tools", "tests", "slurm", "docs")
TWO_COMMANDS = """# 1. set up and run the default job (local mode, the project's tiny model, several tasks)
bash tools/setup_env.sh && .venv/bin/marlaas run configs/local-demo.yaml

# 2. set up and pass the tests
bash tools/test.sh
"""
RUN_HERE = ("plan", "sbatch", "simulate")  # marlaas subcommands cheap enough to run for every example
MARKER = re.compile(r"tested by\s+(.*)", re.IGNORECASE)
REF = re.compile(r"[\w.-]*/[\w./-]+(?:::\w+)?")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*(\|[A-Z][A-Z0-9_]*)*$|<|\.\.\.")


# ------------------------------------------------------------------------------------------- reading pages
@dataclasses.dataclass
class Block:
    lang: str
    body: str
    line: int  # of the opening fence, 1-based
    after: str  # the paragraph right after the closing fence


def fenced_blocks(text: str) -> list[Block]:
    lines, blocks, i = text.splitlines(), [], 0
    while i < len(lines):
        opening = re.match(r"^\s*```(\w*)", lines[i])
        if not opening:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```"))
        rest = [line.strip() for line in lines[end + 1:]]
        start = next((j for j, line in enumerate(rest) if line), len(rest))
        stop = next((j for j in range(start, len(rest)) if not rest[j] or rest[j].startswith("```")), len(rest))
        after = " ".join(rest[start:stop])
        blocks.append(Block(opening.group(1).lower(), "\n".join(lines[i + 1:end]) + "\n", i + 1, after))
        i = end + 1
    return blocks


def prose(text: str) -> str:
    """The page without its fenced blocks (each replaced by an empty line)."""
    return re.sub(r"^\s*```.*?^\s*```[^\n]*$", "", text, flags=re.S | re.M)


# ------------------------------------------------------------------------------------------- shell commands
@dataclasses.dataclass
class Command:
    words: list[str]
    comment: str  # the trailing comment of its line ('' if none)
    tested_by: list[str]  # refs of the marker that covers it


def _split_comment(line: str) -> tuple[str, str]:
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i], line[i + 1:].strip()
    return line, ""


def _refs(comment: str) -> list[str] | None:
    found = MARKER.search(comment)
    return REF.findall(found.group(1)) if found else None


def shell_commands(block: Block) -> list[Command]:
    """Each simple command of a bash block (split at &&, ||, ;, |), with the marker that covers it: its line's
    comment, a comment line above it in the same paragraph, or a 'Tested by' line right after the block."""
    after = _refs(block.after) if block.after.lower().startswith("tested by") else None
    commands, above = [], None
    for line in block.body.replace("\\\n", " ").splitlines():
        code, comment = _split_comment(line)
        if not line.strip():
            above = None
        if not code.strip():
            above = _refs(comment) or above
            continue
        lexer = shlex.shlex(code, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        segment, skip_next = [], False
        for token in [*lexer, ";"]:
            if skip_next:
                skip_next = False
            elif token in ("&&", "||", ";", "|", "&", ";;"):
                if segment:
                    commands.append(Command(_without_assignments(segment), comment,
                                            _refs(comment) or above or after or []))
                segment = []
            elif re.fullmatch(r"\d*[<>]+&?", token):
                skip_next = not token.endswith("&")
            else:
                segment.append(token)
    return commands


def _without_assignments(words: list[str]) -> list[str]:
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        words = words[1:]
    return words


def kind_of(words: list[str]) -> tuple[str, list[str]]:
    """('marlaas' | 'script' | 'module' | 'pytest' | 'external', the arguments after the program)."""
    program, args = (words[0], words[1:]) if words else ("", [])
    if Path(program).name == "marlaas":
        return "marlaas", args
    if re.fullmatch(r"python3?", Path(program).name):
        if args[:2] == ["-m", "pytest"]:
            return "pytest", args[2:]
        if args[:2] == ["-m", "marlaas_hpc.cli"]:
            return "marlaas", args[2:]
        if args[:1] == ["-m"]:
            return "module", args[1:]
        if args and args[0].endswith(".py"):
            return "script", args
    if program == "pytest":
        return "pytest", args
    if program in ("bash", "sh") and args and "/" in args[0]:
        return "script", args
    return "external", args


# ------------------------------------------------------------------------------------------- marlaas --help
def _run_cli(argv: list[str]) -> tuple[int, str]:
    from marlaas_hpc.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    return code, out.getvalue()


@functools.cache
def cli_help(*subcommand: str) -> str:
    code, text = _run_cli([*subcommand, "--help"])
    return text if code == 0 else ""


def _choices(help_text: str) -> set[str]:
    found = re.search(r"\{([\w,-]+)\}", help_text)
    return set(found.group(1).split(",")) if found else set()


def _flags(words: list[str]) -> list[str]:
    return [w.split("=")[0] for w in words if re.match(r"^--?[A-Za-z]", w)]


def _clean(words: list[str]) -> list[str]:
    """An inline synopsis's words without its brackets: `[--run-dir DIR]` -> `--run-dir DIR`."""
    return [w.strip("[]") for w in words if w.strip("[]")]


def check_marlaas(args: list[str]) -> list[str]:
    args = _clean(args)
    if not args:  # the command's name alone
        return []
    top = _choices(cli_help())
    if args[0].startswith("-"):  # marlaas --help
        options = set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", cli_help()))
        return [f"`marlaas` has no flag {flag}" for flag in _flags(args) if flag not in options]
    if PLACEHOLDER.search(args[0]):  # marlaas SUBCOMMAND --help
        return []
    if args[0] not in top:
        return [f"`marlaas {args[0]}`: no such subcommand (marlaas has {sorted(top)})"]
    subcommand = [args[0]]
    if args[0] == "tasks" and len(args) > 1 and not PLACEHOLDER.search(args[1]):
        known = _choices(cli_help("tasks"))
        wrong = [part for part in args[1].split("/") if part not in known]
        if wrong:
            return [f"`marlaas tasks {args[1]}`: no such subcommand (tasks has {sorted(known)})"]
        if "/" not in args[1]:
            subcommand.append(args[1])
    options = set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", cli_help(*subcommand)))
    problems = [f"`marlaas {' '.join(subcommand)}` has no flag {flag}" for flag in _flags(args)
                if flag not in options]
    return problems + check_paths_in(args)


# ------------------------------------------------------------------------------------------- tools, modules
def _module_file(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__main__.py"):
        if path.is_file():
            return path
    return None


@functools.cache
def _script_help(path: Path, module: str | None) -> str:
    command = [sys.executable, "-m", module] if module else [sys.executable, str(path)]
    if path.suffix != ".py":
        return ""
    proc = subprocess.run([*command, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    return proc.stdout + proc.stderr


def _check_flags_of(path: Path, flags: list[str], module: str | None = None) -> list[str]:
    source = path.read_text()
    missing = [f for f in flags if f'"{f}"' not in source and f"'{f}'" not in source]
    if missing and path.suffix == ".py":  # a flag defined elsewhere (a shared parser): ask the tool itself
        options = set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", _script_help(path, module)))
        missing = [f for f in missing if f not in options]
    target = _exec_target(path) if missing and path.suffix == ".sh" else None
    if target is not None:  # a shell wrapper that ends in `exec "$PY" tool.py "$@"` takes the tool's flags
        return _check_flags_of(target, missing)
    return [f"{path.relative_to(ROOT)} has no flag {f}" for f in missing]


def _exec_target(path: Path) -> Path | None:
    match = re.search(r'^exec \S+ (\S+\.py) "\$@"', path.read_text(), re.M)
    return ROOT / match.group(1) if match and (ROOT / match.group(1)).is_file() else None


def check_script(args: list[str]) -> list[str]:
    args = _clean(args)
    path = ROOT / args[0]
    if not path.is_file():
        return [f"{args[0]} does not exist"]
    return _check_flags_of(path, _flags(args[1:])) + check_paths_in(args[1:])


def check_module(args: list[str]) -> list[str]:
    args = _clean(args)
    path = _module_file(args[0])
    if path is None:
        return [f"python -m {args[0]}: no such module"]
    return _check_flags_of(path, _flags(args[1:]), args[0]) + check_paths_in(args[1:])


@functools.cache
def pytest_markers() -> set[str]:
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {m.split(":")[0].strip() for m in config["tool"]["pytest"]["ini_options"]["markers"]}


def check_pytest(args: list[str]) -> list[str]:
    problems = []
    for i, word in enumerate(args):
        if word == "-m" and i + 1 < len(args):
            names = set(re.findall(r"\w+", args[i + 1])) - {"and", "or", "not"}
            problems += [f"pytest marker {name!r} is not declared in pyproject.toml"
                         for name in sorted(names - pytest_markers())]
    return problems + check_paths_in(args)


def check_command(kind: str, args: list[str]) -> list[str]:
    checks = {"marlaas": check_marlaas, "script": check_script, "module": check_module, "pytest": check_pytest}
    return checks[kind](args) if kind in checks else check_paths_in(args)


# ------------------------------------------------------------------------------------------- running the cheap ones
def runs_here(kind: str, args: list[str]) -> bool:
    if kind != "marlaas" or not args:
        return False
    if "--help" in args or "-h" in args:
        return True
    concrete = not any(PLACEHOLDER.search(w) or w.startswith("/") for w in args)
    return args[0] in RUN_HERE and "--dry-run" not in args and concrete


def check_run(args: list[str], comment: str) -> list[str]:
    """Runs a cheap `marlaas` example; every figure with a decimal point in its comment must be printed (rounded
    to the comment's precision)."""
    code, out = _run_cli(args)
    if code != 0:
        return [f"`marlaas {' '.join(args)}` exited {code}: {out[-500:]}"]
    printed = [float(x) for x in re.findall(r"\d+\.\d+", out)]
    problems = []
    for figure in re.findall(r"\d+\.\d+", comment):
        digits = len(figure.split(".")[1])
        if not any(round(value, digits) == float(figure) for value in printed):
            problems.append(f"`marlaas {' '.join(args)}`: the comment's figure {figure} is not in its output")
    return problems


def check_coverage(command: Command, kind: str, args: list[str]) -> list[str]:
    if kind == "external":
        return []
    if runs_here(kind, args):
        return check_run(args, command.comment)
    text = " ".join(command.words)
    if not command.tested_by:
        return [f"`{text}` launches something this test does not run: name its tests ('# tested by tests/...')"]
    return [problem for ref in command.tested_by for problem in check_test_ref(ref, text)]


def check_test_ref(ref: str, where: str) -> list[str]:
    path, _, name = ref.partition("::")
    if not (ROOT / path).is_file():
        return [f"`{where}`: tested by {ref}, but {path} does not exist"]
    if name and not re.search(rf"^(async )?def {re.escape(name)}\(", (ROOT / path).read_text(), re.M):
        return [f"`{where}`: tested by {ref}, but {path} has no test {name}"]
    return []


# ------------------------------------------------------------------------------------------- yaml
@functools.cache
def _demo() -> dict:
    return yaml.safe_load((ROOT / "configs" / "local-demo.yaml").read_text())


def _laid_over(base: dict, fragment: dict) -> dict:
    merged = dict(base)
    for key, value in fragment.items():
        merged[key] = _laid_over(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) \
            else value
    return merged


def check_yaml(body: str) -> list[str]:
    from marlaas_hpc.config import JobConfig
    from marlaas_hpc.config_loader import SpecError
    from marlaas_hpc.tasks import TaskSpec

    try:
        data = yaml.safe_load(body)
    except yaml.YAMLError as exc:
        return [f"does not parse: {exc}"]
    if not isinstance(data, dict):
        return [f"is not a mapping: {body.strip()[:80]}"]
    job_fields = {f.name for f in dataclasses.fields(JobConfig)}
    task_fields = {f.name for f in dataclasses.fields(TaskSpec)}
    try:
        if "task_id" in data:
            TaskSpec.from_dict(data)
        elif set(data) <= job_fields:
            JobConfig.from_dict(_laid_over(_demo(), data))
        elif set(data) <= task_fields:
            JobConfig.from_dict({**_demo(), "tasks": [_laid_over(_demo()["tasks"][0], data)]})
        else:
            unknown = sorted(set(data) - job_fields - task_fields) or sorted(set(data) & task_fields)
            return [f"neither a job config nor a task spec (keys {unknown})"]
    except SpecError as exc:
        return [f"is refused: {exc}"]
    return []


# ------------------------------------------------------------------------------------------- paths
SUBPACKAGES = tuple(p.name for p in (ROOT / "marlaas_hpc").iterdir() if p.is_dir() and not p.name.startswith("_"))
REPO_PATH = re.compile(r"(?<![\w./$-])((?:%s)(?:/[\w.*<>-]+)+/?)(?:::(\w+))?" % "|".join(map(re.escape, TOP_LEVEL)))
PACKAGE_PATH = re.compile(r"(?<![\w./$-])((?:%s)(?:/\w+)*/\w+\.py)\b" % "|".join(SUBPACKAGES))
LINK = re.compile(r"\]\(([^)\s]+)\)")
SECTION = re.compile(r"architecture\.md,? (?:§|section )(\d+)")


def _exists(root: Path, path: str) -> bool:
    pattern = re.sub(r"<[^>]*>", "*", path.rstrip("."))
    if "*" not in pattern:
        return (root / pattern).exists()
    return any(root.glob(pattern.rstrip("/")))


def _slug(heading: str) -> str:
    return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", heading.strip().lower()))


def check_paths_in(words: list[str]) -> list[str]:
    return [f"{w} does not exist" for w in words if REPO_PATH.fullmatch(w.rstrip(".")) and not _exists(ROOT, w)]


def check_paths(text: str, page: Path) -> list[str]:
    problems = []
    cited = prose(text) + "".join(b.body for b in fenced_blocks(text) if b.lang not in ("", "text"))
    for path, name in REPO_PATH.findall(cited):
        if not _exists(ROOT, path):
            problems.append(f"cites {path}, which does not exist")
        elif name:
            problems += check_test_ref(f"{path.rstrip('.')}::{name}", page.name)
    for path in PACKAGE_PATH.findall(cited):
        if not (ROOT / "marlaas_hpc" / path).exists():
            problems.append(f"cites {path} (under marlaas_hpc/), which does not exist")
    for target in LINK.findall(prose(text)):
        if re.match(r"^[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        linked = (page.parent / file).resolve() if file else page
        if not linked.exists():
            problems.append(f"links to {target}, which does not exist")
        elif anchor and linked.suffix == ".md" and anchor not in {
                _slug(h) for h in re.findall(r"^#+ (.*)$", linked.read_text(), re.M)}:
            problems.append(f"links to {target}: {linked.name} has no such heading")
    sections = set(re.findall(r"^## (\d+)\.", (ROOT / "docs" / "architecture.md").read_text(), re.M))
    problems += [f"refers to docs/architecture.md §{n}, which has no such section"
                 for n in SECTION.findall(text) if n not in sections]
    return problems


# ------------------------------------------------------------------------------------------- a page
INLINE = re.compile(r"`((?:\.venv/bin/)?"
                    r"(?:marlaas(?![\w.-])|python3? (?:-m marlaas_hpc|tools/)|bash (?:tools|slurm)/)[^`]*)`")


def check_page(text: str, page: Path) -> list[str]:
    problems = check_paths(text, page)
    for block in fenced_blocks(text):
        where = f"line {block.line} ({block.lang})"
        if block.lang == "yaml":
            problems += [f"{where}: {p}" for p in check_yaml(block.body)]
        elif block.lang in ("bash", "sh", "shell"):
            for command in shell_commands(block):
                kind, args = kind_of(command.words)
                found = check_command(kind, args)
                found = found or check_coverage(command, kind, args)
                problems += [f"{where}: {p}" for p in found]
        elif block.lang == "python":
            try:
                compile(block.body, str(page), "exec")
            except SyntaxError as exc:
                problems.append(f"{where}: {exc}")
    for span in INLINE.findall(prose(text)):
        words = span.replace("...", " ... ").split()
        kind, args = kind_of(words)
        problems += [f"inline `{span}`: {p}" for p in check_command(kind, args)]
    return problems


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_example_path_and_command_of_the_page_holds(page):
    problems = check_page(page.read_text(), page)
    assert not problems, f"{page.relative_to(ROOT)}:\n" + "\n".join(problems)


BROKEN = {
    "yaml that does not parse": ("```yaml\nlayout: {env_ranks: 1\n```\n", "does not parse"),
    "yaml with an unknown field": ("```yaml\nlayout: {env_rankz: 1}\n```\n", "env_rankz"),
    "yaml with a bad value": ("```yaml\nalgo: {lr: .nan}\n```\n", "algo.lr"),
    "yaml of no known kind": ("```yaml\nfrobnicate: 1\n```\n", "neither a job config"),
    "unknown subcommand": ("```bash\nmarlaas frobnicate configs/local-demo.yaml  # tested by .ci/run\n```\n",
                           "no such subcommand"),
    "unknown flag": ("```bash\nmarlaas run configs/local-demo.yaml --fast  # tested by .ci/run\n```\n",
                     "has no flag --fast"),
    "unknown tasks subcommand": ("`marlaas tasks remove`\n", "no such subcommand"),
    "missing tool": ("```bash\npython tools/no_such_bench.py  # tested by .ci/run\n```\n", "does not exist"),
    "unknown tool flag": ("`python tools/bench_sim.py --warp 9`\n", "has no flag --warp"),
    "missing module": ("`python -m marlaas_hpc.no_such`\n", "no such module"),
    "undeclared marker": ("```bash\npython -m pytest -m fast  # tested by .ci/run\n```\n", "not declared"),
    "a job without its tests": ("```bash\nmarlaas run configs/local-demo.yaml\n```\n", "name its tests"),
    "tested by a missing test": ("```bash\nmarlaas run configs/test-small.yaml  # tested by tests/test_cli.py::"
                                 "test_nothing\n```\n", "has no test test_nothing"),
    "missing config in a command": ("```bash\nmarlaas plan configs/no-such.yaml\n```\n", "does not exist"),
    "a figure the command does not print": ("```bash\nmarlaas plan configs/qwen3-0.6b-gsm8k.yaml --model "
                                            "random:qwen3-0.6b   # trainer 21.5 GiB\n```\n", "21.5"),
    "a command that fails": ("```bash\nmarlaas simulate configs/local-demo.yaml --workload configs/local-demo.yaml\n"
                             "```\n", "exited"),
    "missing path": ("see marlaas_hpc/runtime/no_such.py\n", "does not exist"),
    "missing path under the package": ("see (runtime/no_such.py)\n", "under marlaas_hpc/"),
    "missing link": ("[x](no-such.md)\n", "links to no-such.md"),
    "missing anchor": ("[x](configuration.md#no-such-heading)\n", "no such heading"),
    "missing section": ("docs/architecture.md §99\n", "§99"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_each_check_fails_on_a_broken_example(case):
    text, expected = BROKEN[case]
    problems = check_page(text, ROOT / "docs" / "example.md")
    assert any(expected in p for p in problems), problems


def test_the_readme_is_a_page_that_opens_with_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    first = fenced_blocks(text)[0]
    assert (first.lang, first.body) == ("bash", TWO_COMMANDS)
    assert not prose(text)[:prose(text).index("On a fresh machine")].count("\n## "), "nothing comes before them"


def test_the_architecture_map_names_every_folder_of_the_package():
    text = (ROOT / "docs" / "architecture.md").read_text()
    first = text.split("\n## ")[1]
    assert first.startswith("Map: the folders in data-flow order")
    missing = [name for name in SUBPACKAGES if f"`{name}/`" not in first]
    assert not missing, f"the map of docs/architecture.md does not name {missing}"


# ------------------------------------------------------------------------------------------- the first run
def _pattern(line: str, run_dir: str) -> re.Pattern:
    """A shown output line as a pattern: any number where it shows one, any rank as the slowest, any spacing."""
    parts = []
    for piece in re.split(r"([-+]?\d+(?:\.\d+)?)", line.replace("/tmp/docs-demo", "\0")):
        if re.fullmatch(r"[-+]?\d+(?:\.\d+)?", piece):
            parts.append(r"[-+]?\d+(?:\.\d+)?")
        else:
            words = [re.escape(w).replace("\0", re.escape(run_dir)) for w in piece.split()]
            text = r"\s+".join(words)
            text = re.sub(r"(?:env|rollout|trainer|scheduler)\\ rank|(?:env|rollout|trainer|scheduler)(?=\\s\+rank)",
                          r"\\w+", text)
            parts.append((r"\s*" if piece[:1].isspace() else "") + text + (r"\s*" if piece[-1:].isspace() else ""))
    return re.compile("".join(parts))


def _shown(block: Block) -> tuple[list[str], list[str]]:
    lines = block.body.splitlines()
    return shlex.split(lines[0][2:]), [line for line in lines[1:] if line.strip() and line.strip() != "..."]


def test_the_first_run_check_tells_a_shown_line_from_one_not_printed():
    shown = _pattern("[job] all 4 ranks ready after 26.7 s (slowest: trainer rank 3 26.9 s, CPU s per rank: env 0.7)",
                     "/r")
    assert shown.fullmatch("[job] all 4 ranks ready after 9.1 s (slowest: rollout rank 2 9.0 s, CPU s per rank: "
                           "env 1.2)")
    assert not shown.fullmatch("[job] all 4 ranks ready after 9.1 s")
    assert not _pattern("[add] eval after: greedy accuracy 0.667", "/r").fullmatch(
        "[add] eval before: greedy accuracy 0.7")
    assert _pattern("[job] async finished in 25.5 s; summary: /tmp/docs-demo/summary.json", "/x/run").fullmatch(
        "[job] async finished in 12.0 s; summary: /x/run/summary.json")
    assert _pattern("add    alice   done   30/30    1   0.250", "/r").fullmatch("add alice done 30/30 1 0.875")


@pytest.mark.vllm
@pytest.mark.mpi
@pytest.mark.slow
def test_the_first_run_prints_what_the_readme_shows(tmp_path):
    """Command 1's job (`marlaas run configs/local-demo.yaml`, here with its own run dir), then `marlaas status`:
    every line the README shows is printed, numbers and the slowest rank aside."""
    from marlaas_hpc.launch.devices import count_driver_gpus
    from support.jobs import job_env as _env

    if count_driver_gpus():
        pytest.skip("the README shows the CPU run")
    run, status = [b for b in fenced_blocks((ROOT / "README.md").read_text()) if b.body.startswith("$ ")][:2]
    run_dir = str(tmp_path / "run")
    for block in (run, status):
        argv, shown = _shown(block)
        assert Path(argv[0]).name == "marlaas"
        argv = [run_dir if word == "/tmp/docs-demo" else word for word in argv[1:]]
        proc = subprocess.run([sys.executable, "-m", "marlaas_hpc.cli", *argv], cwd=ROOT, env=_env(),
                              capture_output=True, text=True, timeout=1200)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        printed = proc.stdout.splitlines()
        missing = [line for line in shown if not any(_pattern(line, run_dir).fullmatch(p) for p in printed)]
        assert not missing, f"the README shows lines `{' '.join(argv)}` did not print:\n" + "\n".join(missing)
