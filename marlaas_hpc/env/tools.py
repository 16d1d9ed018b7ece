"""Tool calls: the text protocol, its robust parser, and the built-in tools.

Protocol (``syntax="xml"``): a model turn may contain tool calls

    <tool name="search">capital of France</tool>

Every well-formed call in the turn (at most `max_calls` per turn) runs, in order, and the observation
appended to the transcript is one ``<result>…</result>`` per call, then a newline:

    <result>[1] Paris: Paris is the capital of France.</result>

A malformed call (no closing ``</tool>``, no ``name="…"``, unknown tool, nested tags, argument too long)
gets ``<result>error: …</result>`` instead, so the model sees what went wrong; parsing never raises.
A turn without any ``<tool`` tag is the episode's final answer.

Compact protocol (``syntax="compact"``, for the tiny character model): a turn that starts with ``?`` calls
the task's one tool with the rest of the turn as argument (empty: the task's default argument); the task
formats the observation (short, no tags).
"""
from __future__ import annotations

import ast
import math
import operator
import re
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable

from marlaas_hpc.env.protocol import Environment, Final, Observation, StepResult
from marlaas_hpc.env.sandbox import SandboxLimits, run_python
from marlaas_hpc.tasks.base import Sample, TaskData

SYNTAXES = ("xml", "compact")
_OPEN = re.compile(r"<tool(?=[\s>/]|$)")
_CALL = re.compile(r"""<tool\s+name\s*=\s*(["'])(.*?)\1\s*>(.*?)</tool\s*>""", re.S)
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,31}$")


@dataclass(frozen=True)
class ToolCall:
    name: str
    argument: str
    error: str | None = None
    """Why the call is malformed (it is then not run); None for a well-formed call."""


def parse_tool_calls(text: str, max_calls: int = 4, max_argument_chars: int = 4000) -> list[ToolCall]:
    """All tool calls in a model turn, well-formed or not, in order. Never raises."""
    calls: list[ToolCall] = []
    pos = 0
    while len(calls) <= max_calls:
        opening = _OPEN.search(text, pos)
        if opening is None:
            break
        match = _CALL.match(text, opening.start())
        if match is None:
            calls.append(ToolCall("", "", _malformed_reason(text, opening.start())))
            pos = opening.end()
            continue
        name, argument = match.group(2).strip(), match.group(3).strip()
        pos = match.end()
        if _OPEN.search(argument):
            calls.append(ToolCall(name, "", "nested <tool> tags"))
        elif not _NAME.match(name):
            calls.append(ToolCall(name, "", f"invalid tool name {name[:40]!r}"))
        elif len(argument) > max_argument_chars:
            calls.append(ToolCall(name, "", f"argument longer than {max_argument_chars} characters"))
        else:
            calls.append(ToolCall(name, argument))
    if len(calls) > max_calls:
        calls[max_calls:] = [ToolCall("", "", f"more than {max_calls} tool calls in one turn")]
    return calls


def _malformed_reason(text: str, start: int) -> str:
    head_end = text.find(">", start)
    if head_end < 0:
        return "unterminated <tool tag (expected <tool name=\"...\">argument</tool>)"
    head = text[start:head_end]
    if not re.search(r"""name\s*=\s*(["']).*?\1""", head):
        return "tool tag without name=\"...\" (expected <tool name=\"...\">argument</tool>)"
    return "missing </tool> closing tag"


def parse_compact_call(text: str, tool_name: str) -> ToolCall | None:
    """Compact syntax: '?arg' calls `tool_name` with 'arg'; anything else is not a call."""
    stripped = text.strip()
    if not stripped.startswith("?"):
        return None
    return ToolCall(tool_name, stripped[1:].strip())


class ToolError(Exception):
    """A tool refused its argument; the message goes back to the model as an error observation."""


class Tool(ABC):
    name: str = ""
    waits_on_service: bool = False
    """True for a tool whose call mostly waits on a service (network, a remote index) rather than computing:
    the env pool runs steps that call it as I/O, many at once, not on its CPU workers (env/pool.py)."""

    @abstractmethod
    def run(self, argument: str, sample: Sample) -> str:
        """The tool's answer to one call; raise ToolError for a bad argument."""


@dataclass(frozen=True)
class ToolOutcome:
    name: str
    argument: str
    text: str
    ok: bool
    seconds: float


class ToolBox:
    """The tools one task offers, by name. `call` never raises: failures become error outcomes."""

    def __init__(self, tools: list[Tool]):
        self.tools = {tool.name: tool for tool in tools}

    def call(self, call: ToolCall, sample: Sample) -> ToolOutcome:
        start = time.perf_counter()
        if call.error is not None:
            return ToolOutcome(call.name, call.argument, f"error: {call.error}", False, 0.0)
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolOutcome(call.name, call.argument,
                               f"error: unknown tool {call.name!r}; available: {sorted(self.tools)}", False, 0.0)
        try:
            text, ok = tool.run(call.argument, sample), True
        except ToolError as exc:
            text, ok = f"error: {exc}", False
        except Exception as exc:  # a tool bug must not end the episode or the env rank
            text, ok = f"error: {call.name} failed ({type(exc).__name__})", False
        return ToolOutcome(call.name, call.argument, text, ok, time.perf_counter() - start)


# ---------------------------------------------------------------- calculator: arithmetic over an AST, no eval
_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS: dict[str, Callable[..., Any]] = {"abs": abs, "round": round, "min": min, "max": max,
                                             "sqrt": math.sqrt, "floor": math.floor, "ceil": math.ceil}
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}\b)")


@dataclass(kw_only=True, frozen=True)
class CalculatorLimits:
    max_chars: int = 200
    """Longest expression accepted."""
    max_nodes: int = 64
    """Most AST nodes (numbers, operators, calls)."""
    max_bits: int = 256
    """Largest integer magnitude (in bits) of any intermediate result."""
    max_exponent: int = 64
    """Largest absolute exponent of '**'."""


class Calculator(Tool):
    """+ - * / // % ** (also '^'), parentheses, abs/round/min/max/sqrt/floor/ceil; numbers like 1,000 and $5."""

    name = "calculator"

    def __init__(self, limits: CalculatorLimits = CalculatorLimits()):
        self.limits = limits

    def run(self, argument: str, sample: Sample | None = None) -> str:
        return format_number(self.evaluate(argument))

    def evaluate(self, expression: str) -> int | float:
        text = _THOUSANDS.sub("", expression.strip().replace("$", "").replace("^", "**"))
        text = text.replace("×", "*").replace("÷", "/")
        if not text:
            raise ToolError("empty expression")
        if len(text) > self.limits.max_chars:
            raise ToolError(f"expression longer than {self.limits.max_chars} characters")
        try:
            tree = ast.parse(text, mode="eval")
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            raise ToolError(f"cannot parse {expression.strip()[:60]!r}") from None
        if sum(1 for _ in ast.walk(tree)) > self.limits.max_nodes:
            raise ToolError(f"expression has more than {self.limits.max_nodes} parts")
        try:
            return self._check(self._eval(tree.body))
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except (OverflowError, ValueError, TypeError) as exc:
            raise ToolError(f"invalid arithmetic ({exc})") from None

    def _eval(self, node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return self._check(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = self._eval(node.left), self._eval(node.right)
            if isinstance(node.op, ast.Pow):
                self._check_power(left, right)
            return self._check(_BINARY[type(node.op)](left, right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](self._eval(node.operand))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS \
                and not node.keywords and 0 < len(node.args) <= 8:
            return self._check(_FUNCTIONS[node.func.id](*(self._eval(arg) for arg in node.args)))
        raise ToolError(f"unsupported syntax: {type(node).__name__}")

    def _check_power(self, base: int | float, exponent: int | float) -> None:
        if abs(exponent) > self.limits.max_exponent:
            raise ToolError(f"exponent larger than {self.limits.max_exponent}")
        if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 \
                and abs(base).bit_length() * exponent > self.limits.max_bits:
            raise ToolError(f"result larger than 2**{self.limits.max_bits}")

    def _check(self, value: Any) -> int | float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ToolError(f"not a real number: {type(value).__name__}")
        if isinstance(value, int) and value.bit_length() > self.limits.max_bits:
            raise ToolError(f"result larger than 2**{self.limits.max_bits}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ToolError("result is not finite")
        return value


def format_number(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return str(value) if isinstance(value, int) else f"{value:.12g}"


# ---------------------------------------------------------------- lookup: a per-sample key -> value table
class Lookup(Tool):
    """Looks a key up in the sample's own table (sample.meta['table']); keys are case-sensitive. It stands for
    a lookup service: every call waits `latency_s` for its answer, and the tool counts the calls waiting at
    once (`waiting`, `most_waiting`), as a service would see them."""

    name = "lookup"
    waits_on_service = True

    def __init__(self, latency_s: float = 0.0):
        self.latency_s = latency_s
        """Simulated service latency of every call."""
        self.waiting = 0
        """Calls waiting on the service now."""
        self.most_waiting = 0
        """The most calls that waited at once."""
        self._lock = threading.Lock()

    def run(self, argument: str, sample: Sample) -> str:
        with self._lock:
            self.waiting += 1
            self.most_waiting = max(self.most_waiting, self.waiting)
        try:
            if self.latency_s > 0:
                time.sleep(self.latency_s)
        finally:
            with self._lock:
                self.waiting -= 1
        table = sample.meta.get("table", {})
        key = argument.strip()
        if key not in table:
            raise ToolError(f"unknown key {key[:20]!r}")
        return str(table[key])

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        del state["_lock"]  # a process pool pickles the task with its tools
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _lock=threading.Lock())


# ---------------------------------------------------------------- search: BM25 over a local corpus
@dataclass(frozen=True)
class Document:
    title: str
    text: str


class Bm25Index:
    """bm25s index over documents (title + text); built once per task, read-only afterwards."""

    def __init__(self, documents: list[Document]):
        import bm25s

        if not documents:
            raise ValueError("cannot index an empty corpus")
        self.documents = documents
        tokens = bm25s.tokenize([f"{d.title}\n{d.text}" for d in documents], stopwords="en", show_progress=False)
        self._retriever = bm25s.BM25()
        self._retriever.index(tokens, show_progress=False)

    def search(self, query: str, k: int) -> list[tuple[Document, float]]:
        import bm25s

        tokens = bm25s.tokenize([query], stopwords="en", show_progress=False)
        if not tokens.ids or not tokens.ids[0]:
            return []
        k = min(k, len(self.documents))
        ids, scores = self._retriever.retrieve(tokens, k=k, show_progress=False, n_threads=1)
        return [(self.documents[int(i)], float(s)) for i, s in zip(ids[0], scores[0]) if s > 0]


class Search(Tool):
    """Top-k BM25 documents for a query, each cut to `max_chars`."""

    name = "search"

    def __init__(self, index: Bm25Index, k: int = 3, max_chars: int = 300):
        self.index, self.k, self.max_chars = index, k, max_chars

    def run(self, argument: str, sample: Sample | None = None) -> str:
        if not argument.strip():
            raise ToolError("empty search query")
        hits = self.index.search(argument, self.k)
        if not hits:
            return "no results"
        return "\n".join(f"[{rank}] {doc.title}: {_clip(doc.text, self.max_chars)}"
                         for rank, (doc, _) in enumerate(hits, start=1))


def _clip(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------- python: sandboxed subprocess
class Python(Tool):
    """Runs the argument as a Python script in the sandbox; the observation is its (truncated) stdout."""

    name = "python"

    def __init__(self, limits: SandboxLimits = SandboxLimits()):
        self.limits = limits.validate()

    def run(self, argument: str, sample: Sample | None = None) -> str:
        result = run_python(argument, self.limits)
        if result.ok:
            return result.stdout.rstrip("\n") or "(no output)"
        detail = _last_line(result.stderr_tail)
        messages = {"timeout": f"timed out after {self.limits.wall_seconds:g} s",
                    "cpu_limit": f"CPU time limit of {self.limits.cpu_seconds} s exceeded",
                    "memory_limit": f"memory limit of {self.limits.memory_bytes // 2**20} MiB exceeded",
                    "output_limit": f"output limit of {self.limits.file_bytes} bytes exceeded"}
        message = messages.get(result.status, detail or f"exit status {result.returncode}")
        partial_output = f"\n{result.stdout.rstrip()}" if result.stdout.strip() else ""
        raise ToolError(f"{result.status}: {message}{partial_output}")


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip()[:300] if lines else ""


# ---------------------------------------------------------------- a task whose episodes call tools
class ToolTask(TaskData):
    """A TaskData whose episodes are multi-turn: turns with tool calls get observations, a turn without one
    is the final answer, scored by `score` (through `reward`, which checks the range).

    Subclasses set `tools`, `syntax` and, for the compact syntax, `compact_tool`; they may override how an
    observation is written (`observation`) and the default argument of a bare '?' (`default_argument`)."""

    tools: ToolBox
    syntax: str = "xml"
    compact_tool: str = ""
    max_calls_per_turn: int = 4

    def new_env(self) -> "ToolEnv":
        return ToolEnv(self)

    def default_argument(self, sample: Sample) -> str:
        return ""

    def observation(self, sample: Sample, outcomes: list[ToolOutcome]) -> str:
        if self.syntax == "compact":
            return "".join(f"{o.text}\n" for o in outcomes)
        return "".join(f"<result>{o.text}</result>" for o in outcomes) + "\n"


class ToolEnv(Environment):
    """One episode of a ToolTask."""

    task: ToolTask

    def reset(self, sample: Sample) -> str:
        self.sample = sample
        return sample.prompt

    def step(self, model_turn: str) -> StepResult:
        calls = self._calls(model_turn)
        if not calls:
            start = time.perf_counter()
            reward = self.task.reward(self.sample, model_turn)
            return Final(reward, "answer", {"reward": time.perf_counter() - start})
        outcomes = [self.task.tools.call(call, self.sample) for call in calls]
        timings: dict[str, float] = {}
        for outcome in outcomes:
            stage = f"tool:{outcome.name or 'malformed'}"
            timings[stage] = timings.get(stage, 0.0) + outcome.seconds
        return Observation(self.task.observation(self.sample, outcomes), len(outcomes),
                           sum(not o.ok for o in outcomes), timings)

    def service_waits(self, model_turn: str) -> frozenset[str]:
        tools = self.task.tools.tools
        return frozenset(call.name for call in self._calls(model_turn)
                         if call.error is None and getattr(tools.get(call.name), "waits_on_service", False))

    def _calls(self, model_turn: str) -> list[ToolCall]:
        if self.task.syntax == "compact":
            call = parse_compact_call(model_turn, self.task.compact_tool)
            if call is None:
                return []
            return [call if call.argument else ToolCall(call.name, self.task.default_argument(self.sample))]
        return parse_tool_calls(model_turn, self.task.max_calls_per_turn)
