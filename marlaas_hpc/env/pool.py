"""Env worker pool: runs many episodes' env steps at once, with per-call timeouts and per-stage timings.

Modes (`EnvPoolConfig.mode`):
- ``thread``: worker threads in this process. Right for tools that wait on subprocesses (python) or I/O and
  for light verifiers. A call past its timeout is reported as failed and its thread is replaced; the stuck
  thread cannot be interrupted and is abandoned (its late result is dropped).
- ``process``: one subprocess per worker (spawn start method: entry scripts need a ``__main__`` guard).
  Each task is pickled once and shipped to a worker on first use (then its optional ``warm_up()`` runs, outside
  any step's timeout); an env step ships the small per-episode
  env (without its task) and gets it back. A call past its timeout, or a worker that dies, kills and
  replaces that worker only. Right for CPU-heavy or untrusted reward functions.
- ``inline``: run in the caller's thread (debugging; no timeout).

Two lanes. A step that waits on a service (its env names, through `Environment.service_waits(turn)`, tools
whose `Tool.waits_on_service` is set: the lookup service, a remote search...) is I/O, not CPU work: in thread and
process mode it runs on a thread of its own in this process, outside the workers, so a rank keeps hundreds of
such waits in flight while the workers stay free for rewards and CPU tools (calculator, BM25, the python
sandbox). Without the split a 1 s service call held a worker for its whole wait: 4 workers capped a rank at 4
calls/s for every tenant, and a cheap reward of another task queued behind them. The I/O lane is bounded per
tool name (`EnvPoolConfig.tool_concurrency` steps in flight per tool; a step past it waits, FIFO, for a slot);
the same watchdog enforces `step_timeout_s` on it (a late call is reported failed at once; its thread is
abandoned and keeps its tool slot until the service answers, so a hung service cannot grow the thread count
past the bound). Threads, not asyncio: a tool's client is ordinary blocking code (a socket, an HTTP library),
a waiting thread holds no GIL and little memory, and a thread per call needs no async rewrite of the tools.
I/O steps only parse the turn, wait and format the observation; rewards (tenant code included) never run on
this lane, so process mode's isolation of reward functions is unchanged.

A call never raises into the caller: `StepOutcome.error` carries an `EnvError` (a RewardError) naming the task
when its verifier raised / returned NaN or out-of-range, when its env raised, timed out or killed the worker.
The caller marks that task failed; other tasks are unaffected.
"""
from __future__ import annotations

import itertools
import multiprocessing
import pickle
import queue
import statistics
import threading
import time
import traceback
from collections import Counter, defaultdict, deque
from concurrent.futures import Future
from dataclasses import dataclass

from marlaas_hpc.config_loader import bounded, check_bounds
from marlaas_hpc.env.protocol import Environment, StepResult
from marlaas_hpc.tasks.base import RewardError, TaskData

MODES = ("thread", "process", "inline")
_STARTUP_TIMEOUT_S = 120.0  # spawn + imports + unpickling a task (a BM25 index) on a busy node
MAX_TOOL_CONCURRENCY = 4096  # one thread per call in flight: beyond this, raise the number of env ranks


@dataclass(kw_only=True, frozen=True)
class EnvPoolConfig:
    mode: str = bounded("thread", choices=MODES)
    """'thread', 'process' or 'inline' (see module docstring)."""
    workers: int = bounded(4, ge=1)
    """Concurrent env steps."""
    step_timeout_s: float = bounded(30.0, gt=0, unit="seconds")
    """Per env.step wall-clock limit (a tool's own limits, e.g. the python sandbox's, are shorter)."""
    max_samples_per_stage: int = bounded(100_000, ge=1)
    """Timing samples kept per stage for the stats (oldest dropped)."""
    tool_concurrency: int = bounded(256, ge=1, le=MAX_TOOL_CONCURRENCY)
    """Most env steps waiting on one service tool (by tool name, e.g. 'lookup') in flight at once on this rank;
    they run on threads of their own, not on the workers, and a step past the bound waits for a slot."""

    def validate(self, prefix: str = "env_pool") -> "EnvPoolConfig":
        check_bounds(self, prefix)
        return self


class EnvError(RewardError):
    """An env step of task `task_key` failed: cause is 'reward' (verifier raised / NaN / out of range),
    'env' (the env raised), 'timeout', 'crash' (the worker process died) or 'cancelled' (its task ended before the
    step ran: EnvPool.cancel_task)."""

    def __init__(self, task_key: str, cause: str, message: str):
        self.task_key, self.cause = task_key, cause
        super().__init__(f"task {task_key!r}: {message}")

    def __reduce__(self):
        return EnvError, (self.task_key, self.cause, str(self).split(": ", 1)[-1])


@dataclass
class StepOutcome:
    task_key: str
    env: Environment
    """The env after the step (in process mode a new object with the task re-attached)."""
    result: StepResult | None
    error: EnvError | None
    queued_s: float
    run_s: float
    io: bool = False
    """The step waited on a service on the I/O lane (it held no worker)."""


@dataclass
class _Call:
    task_key: str
    env: Environment
    text: str
    future: Future
    submitted: float
    started: float = 0.0
    abandoned: bool = False
    finished: bool = False
    service_tools: frozenset[str] = frozenset()
    """The service tools this step waits on (empty: a CPU step, run by a worker)."""


class EnvPool:
    def __init__(self, config: EnvPoolConfig = EnvPoolConfig()):
        self.config = config.validate()
        self._tasks: dict[str, TaskData] = {}
        self._blobs: dict[str, bytes] = {}
        self._queue: queue.Queue[_Call | None] = queue.Queue()
        self._lock = threading.Lock()
        self._stages: dict[str, deque[float]] = defaultdict(lambda: deque(maxlen=config.max_samples_per_stage))
        self._counts: dict[str, int] = defaultdict(int)
        self._errors: dict[str, list[str]] = defaultdict(list)
        self._busy_s = 0.0
        self._opened = time.monotonic()
        self._closed = False
        self._running: dict[int, _Call] = {}
        """Thread ident -> the call it runs (workers in thread mode, and every I/O-lane thread)."""
        self._io_waiting: deque[_Call] = deque()
        self._io_in_flight: Counter[str] = Counter()
        self._io_most: Counter[str] = Counter()
        self._abandoned: set[int] = set()
        self._cancelled: set[str] = set()
        """Tasks whose steps not started yet are never run (`cancel_task`)."""
        self._thread_ids = itertools.count()
        self._threads: list[threading.Thread] = []
        if config.mode != "inline":
            for _ in range(config.workers):
                self._start_thread()
            # times out thread-mode workers and the I/O lane (a process-mode worker times its own step out)
            threading.Thread(target=self._watchdog, name="env-pool-watchdog", daemon=True).start()

    # ------------------------------------------------------------ public API
    def add_task(self, task_key: str, task: TaskData) -> None:
        """Makes a task's steps runnable (process mode: the task must pickle; checked here)."""
        self._tasks[task_key] = task
        if self.config.mode == "process":
            try:
                self._blobs[task_key] = pickle.dumps(task)
            except Exception as exc:
                raise ValueError(f"task {task_key!r} cannot be sent to env worker processes: {exc}") from exc

    def add_task_once(self, task_key: str, task: TaskData) -> None:
        """add_task unless the key is known."""
        if task_key not in self._tasks:
            self.add_task(task_key, task)

    def submit(self, task_key: str, env: Environment, text: str) -> Future:
        """Queues env.step(text); the Future's result is a StepOutcome (never an exception)."""
        if task_key not in self._tasks:
            raise KeyError(f"task {task_key!r} was not added to the env pool")
        if self._closed:
            raise RuntimeError("env pool is closed")
        call = _Call(task_key, env, text, Future(), time.monotonic())
        if self.config.mode != "inline":
            call.service_tools = _service_waits(env, text)
        if self.config.mode == "inline":
            self._run_here(call)
        elif call.service_tools:
            self._io_submit(call)
        else:
            self._queue.put(call)
        return call.future

    def cancel_task(self, task_key: str) -> None:
        """The task ended (it failed): its steps still queued are not run, each Future gets an outcome with a
        'cancelled' error at once. A failing reward's queued calls each started a fresh sandbox worker (8-13 s on
        2 cores) that the other tasks' steps waited behind. Steps already running finish."""
        with self._lock:
            self._cancelled.add(task_key)

    def _skipped(self, call: _Call) -> bool:
        """Finishes `call` without running it if its task was cancelled (not counted: nothing ran)."""
        if call.task_key not in self._cancelled:
            return False
        with self._lock:
            call.finished = True
        call.future.set_result(StepOutcome(call.task_key, call.env, None,
                                           EnvError(call.task_key, "cancelled", "its task has ended"), 0.0, 0.0,
                                           bool(call.service_tools)))
        return True

    def step(self, task_key: str, env: Environment, text: str) -> StepOutcome:
        return self.submit(task_key, env, text).result()

    def stats(self) -> dict:
        """Calls, errors and per-stage time summaries ('queue' / 'step': waiting for / running on a worker,
        'queue:io' / 'step:io': the same on the I/O lane, 'reward', 'tool:<name>', per task 'task:<key>'), the
        workers' busy fraction since the pool opened (I/O-lane steps hold no worker and do not count), and per
        service tool the most steps in flight at once ('io_in_flight_max', bounded by 'tool_concurrency')."""
        with self._lock:
            wall = max(time.monotonic() - self._opened, 1e-9)
            return {"mode": self.config.mode, "workers": self.config.workers, "calls": dict(self._counts),
                    "errors": {k: list(v) for k, v in self._errors.items()},
                    "busy_fraction": self._busy_s / (wall * self.config.workers),
                    "tool_concurrency": self.config.tool_concurrency, "io_in_flight_max": dict(self._io_most),
                    "stages": {stage: summarize(list(v)) for stage, v in self._stages.items()}}

    def reset_stats(self) -> None:
        with self._lock:
            self._stages.clear()
            self._counts.clear()
            self._errors.clear()
            self._io_most = Counter(self._io_in_flight)
            self._busy_s, self._opened = 0.0, time.monotonic()

    def close(self) -> None:
        self._closed = True
        for _ in self._threads:
            self._queue.put(None)
        deadline = time.monotonic() + 5.0
        for thread in self._threads:  # abandoned (stuck) threads are daemons and are not waited for
            if thread.ident not in self._abandoned:
                thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> "EnvPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ workers
    def _start_thread(self) -> None:
        target = self._process_loop if self.config.mode == "process" else self._thread_loop
        thread = threading.Thread(target=target, name=f"env-worker-{next(self._thread_ids)}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def _thread_loop(self) -> None:
        ident = threading.get_ident()
        while (call := self._queue.get()) is not None:
            if self._skipped(call):
                continue
            with self._lock:
                call.started = time.monotonic()
                self._running[ident] = call
            self._run_here(call)
            with self._lock:
                self._running.pop(ident, None)
                if call.abandoned:  # the watchdog replaced this thread while it was stuck
                    return

    def _run_here(self, call: _Call) -> None:
        call.started = call.started or time.monotonic()
        try:
            result, error = call.env.step(call.text), None
        except RewardError as exc:
            result, error = None, EnvError(call.task_key, "reward", str(exc))
        except BaseException as exc:  # SystemExit from user code must not kill the worker thread silently
            result, error = None, EnvError(call.task_key, "env", _describe(exc))
        self._finish(call, call.env, result, error, time.monotonic() - call.started)

    # ------------------------------------------------------------ I/O lane: steps that wait on a service
    def _io_submit(self, call: _Call) -> None:
        with self._lock:
            self._io_waiting.append(call)
            admitted = self._io_admit()
        for ready in admitted:
            self._io_start(ready)

    def _io_admit(self) -> list[_Call]:
        """Waiting steps (oldest first) whose every service tool has a free slot; takes the slots. Lock held."""
        admitted, still = [], deque()
        for call in self._io_waiting:
            if all(self._io_in_flight[tool] < self.config.tool_concurrency for tool in call.service_tools):
                self._io_in_flight.update(call.service_tools)
                for tool in call.service_tools:
                    self._io_most[tool] = max(self._io_most[tool], self._io_in_flight[tool])
                admitted.append(call)
            else:
                still.append(call)
        self._io_waiting = still
        return admitted

    def _io_start(self, call: _Call) -> None:
        call.started = time.monotonic()  # its run time (and its timeout) starts when it has its tool slots
        name = f"env-io-{'+'.join(sorted(call.service_tools))}"
        threading.Thread(target=self._io_run, args=(call,), name=name, daemon=True).start()

    def _io_run(self, call: _Call) -> None:
        ident = threading.get_ident()
        with self._lock:
            self._running[ident] = call
        try:
            if not self._skipped(call):
                self._run_here(call)
        finally:  # an abandoned (late) call frees its slots only now: the service still had it in flight
            with self._lock:
                self._running.pop(ident, None)
                self._io_in_flight.subtract(call.service_tools)
                admitted = self._io_admit()
            for ready in admitted:
                self._io_start(ready)

    def _watchdog(self) -> None:
        while not self._closed:
            time.sleep(0.05)
            now, late = time.monotonic(), []
            with self._lock:
                for ident, call in list(self._running.items()):
                    if now - call.started > self.config.step_timeout_s and not call.abandoned:
                        call.abandoned = True
                        if not call.service_tools:
                            self._abandoned.add(ident)  # a worker thread close() must not wait for
                        late.append(call)
            for call in late:
                self._finish(call, call.env, None, EnvError(call.task_key, "timeout",
                             f"env step exceeded {self.config.step_timeout_s:g} s"), now - call.started)
                if not call.service_tools:  # a stuck worker is replaced; an I/O step had a thread of its own
                    self._start_thread()

    def _process_loop(self) -> None:
        worker = _ProcessWorker()
        try:
            while (call := self._queue.get()) is not None:
                if self._skipped(call):
                    continue
                call.started = time.monotonic()
                env, result, error = worker.step(call, self._blobs[call.task_key], self.config.step_timeout_s)
                if env is not call.env:
                    env.task = self._tasks[call.task_key]
                self._finish(call, env, result, error, time.monotonic() - call.started)
        finally:
            worker.stop(graceful=True)

    def _finish(self, call: _Call, env: Environment, result: StepResult | None, error: EnvError | None,
                run_s: float) -> None:
        queued_s = max(0.0, call.started - call.submitted)
        io = bool(call.service_tools)
        with self._lock:
            if call.finished:  # a late result of an abandoned call (the watchdog reported it)
                return
            call.finished = True
            if not io:
                self._busy_s += run_s
            self._counts[call.task_key] += 1
            self._stages["queue:io" if io else "queue"].append(queued_s)
            self._stages["step:io" if io else "step"].append(run_s)
            self._stages[f"task:{call.task_key}"].append(run_s)
            for stage, seconds in (result.timings.items() if result is not None else ()):
                self._stages[stage].append(seconds)
            if error is not None:
                self._errors[call.task_key].append(str(error))
        call.future.set_result(StepOutcome(call.task_key, env, result, error, queued_s, run_s, io))


def _service_waits(env: Environment, text: str) -> frozenset[str]:
    """The service tools env.step(text) will wait on; a hook that raises makes it a CPU step (the step itself
    then reports what is wrong)."""
    try:
        return frozenset(env.service_waits(text))
    except Exception:
        return frozenset()


def _describe(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)[-1:]
    where = f" at {frames[0].filename}:{frames[0].lineno}" if frames else ""
    return f"env raised {type(exc).__name__}: {exc}{where}"


def summarize(values: list[float]) -> dict[str, float]:
    if not values:
        return {"count": 0}
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"count": len(values), "total": sum(values), "mean": statistics.fmean(values), "p50": pick(0.5),
            "p90": pick(0.9), "p99": pick(0.99), "max": ordered[-1]}


# ---------------------------------------------------------------- process mode
class _ProcessWorker:
    """One worker subprocess, owned by one pool thread; replaced after a timeout or a crash."""

    def __init__(self):
        self._ctx = multiprocessing.get_context("spawn")
        self._process = None
        self._conn = None
        self._loaded: set[str] = set()

    def _ensure(self) -> None:
        if self._process is None or not self._process.is_alive():
            self.stop()
            parent, child = self._ctx.Pipe()
            self._process = self._ctx.Process(target=_worker_main, args=(child,), daemon=True, name="env-worker")
            self._process.start()
            child.close()
            self._conn, self._loaded = parent, set()
            self._expect("ready", _STARTUP_TIMEOUT_S, "start")

    def _expect(self, what: str, timeout_s: float, doing: str) -> None:
        """Waits for a handshake message; worker start-up and task loading do not count as step time."""
        if not self._conn.poll(timeout_s):
            self.stop()
            raise TimeoutError(f"env worker did not {doing} within {timeout_s:g} s")
        reply = self._conn.recv()
        if reply[0] != what:
            self.stop()
            raise RuntimeError(f"env worker could not {doing}: {reply[-1]}")

    def step(self, call: _Call, blob: bytes, timeout_s: float):
        try:
            self._ensure()
            if call.task_key not in self._loaded:
                self._conn.send(("task", call.task_key, blob))
                self._expect("loaded", _STARTUP_TIMEOUT_S, f"load task {call.task_key!r}")
                self._loaded.add(call.task_key)
            self._conn.send(("step", call.task_key, call.env, call.text))
            if not self._conn.poll(timeout_s):
                self.stop()
                return call.env, None, EnvError(call.task_key, "timeout", f"env step exceeded {timeout_s:g} s")
            status, *payload = self._conn.recv()
        except (TimeoutError, RuntimeError) as exc:
            return call.env, None, EnvError(call.task_key, "crash", str(exc))
        except (EOFError, OSError, pickle.PicklingError) as exc:
            if self._process is not None:
                self._process.join(timeout=2)  # reap it, so its exit code is known
            code = self._process.exitcode if self._process is not None else None
            self.stop()
            return call.env, None, EnvError(call.task_key, "crash",
                                            f"env worker died ({type(exc).__name__}, exit code {code})")
        if status == "ok":
            env, result = payload
            return env, result, None
        return call.env, None, EnvError(call.task_key, status, payload[0])

    def stop(self, graceful: bool = False) -> None:
        """Kills the worker (graceful: closes its pipe first so it can exit and release its resources)."""
        if self._conn is not None:
            self._conn.close()
        if self._process is not None:
            if graceful:
                self._process.join(timeout=2)
            if self._process.is_alive():
                self._process.kill()
            self._process.join(timeout=5)
        self._process, self._conn = None, None


def _worker_main(conn) -> None:
    tasks: dict[str, TaskData] = {}
    conn.send(("ready",))
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message[0] == "task":
            try:
                task = tasks[message[1]] = pickle.loads(message[2])
                if callable(getattr(task, "warm_up", None)):
                    task.warm_up()  # heavy imports now, not inside the first (timed) step
                conn.send(("loaded",))
            except Exception as exc:
                conn.send(("failed", f"{type(exc).__name__}: {exc}"))
            continue
        _, task_key, env, text = message
        env.task = tasks[task_key]
        try:
            reply = ("ok", env, env.step(text))
        except RewardError as exc:
            reply = ("reward", str(exc))
        except BaseException as exc:
            reply = ("env", _describe(exc))
        conn.send(reply)
