"""Env-rank throughput: episodes/s per workload with an oracle replay engine (no model), tool latencies.

    python tools/bench_env.py [--episodes 200] [--mode thread|process] [--workers 2] [--fixtures DIR]

The replay engine answers instantly, so the figures are the env side alone (tool calls, verifier, runner
book-keeping and tokenisation): the most episodes/s one env rank can feed back to the trainer.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # this checkout's marlaas_hpc, tests/support/

from marlaas_hpc.env.episode import EpisodeRequest, EpisodeRunner, summarize_episodes  # noqa: E402
from marlaas_hpc.env.pool import EnvPool, EnvPoolConfig  # noqa: E402
from marlaas_hpc.env.protocol import EpisodeLimits, environment_for  # noqa: E402
from marlaas_hpc.env.sandbox import SandboxLimits  # noqa: E402
from marlaas_hpc.env.tools import Python, ToolBox, ToolTask  # noqa: E402
from marlaas_hpc.env.workloads import build_env_task  # noqa: E402
from marlaas_hpc.tasks.base import Sample  # noqa: E402
from marlaas_hpc.tasks.spec import DatasetSpec  # noqa: E402
from support.scripted_engine import ScriptedEngine  # noqa: E402


class _PythonTask(ToolTask):
    """Each episode runs one small script in the sandbox, then answers."""

    kind = "python_bench"

    def __init__(self):
        self.tools = ToolBox([Python(SandboxLimits())])

    def train_sample(self, cursor: int) -> Sample:
        return Sample(cursor, f"{cursor}*3=", str(cursor * 3))

    def eval_samples(self) -> list[Sample]:
        return []

    def score(self, sample: Sample, completion: str) -> float:
        return float(completion.strip() == sample.answer)


def _oracle(kind: str, answers: dict[str, str]):
    """A replay policy that uses the workload's tool, then gives the gold answer (to exercise the verifier's
    success path too)."""

    def gold(context: str) -> str:
        return next(answer for prompt, answer in answers.items() if prompt in context)

    def lookup(request, context):
        if "<eos>" not in context:
            return "?"
        a, b = re.search(r"(\d+)\+(\d+)=$", context).groups()
        return str(int(a) + int(b))

    def gsm8k_tool(request, context):
        if "<result>" not in context:
            return 'step: <tool name="calculator">(48 + 24) * 2 / 3</tool>'
        return f"so #### {gold(context)}"

    def hotpotqa(request, context):
        if context.count("<result>") < 2:
            return f'<tool name="search">{"capital city" if "<result>" not in context else "river"}</tool>'
        return f"<answer>{gold(context)}</answer>"

    def python(request, context):
        if "<result>" not in context:
            n = int(re.search(r"(\d+)\*3=", context).group(1))
            return f'<tool name="python">print({n} * 3)</tool>'
        match = re.search(r"<result>(\d+)</result>", context)
        return match.group(1) if match else "?"

    return {"lookup": lookup, "gsm8k_tool": gsm8k_tool, "gsm8k_plain": lambda r, c: f"#### {gold(c)}",
            "hotpotqa": hotpotqa, "python": python}[kind]


def bench(kind: str, task, episodes: int, mode: str, workers: int) -> dict:
    from marlaas_hpc.model.codec import TextCodec
    from marlaas_hpc.model.tokenizer import build_char_tokenizer

    codec = TextCodec(build_char_tokenizer())
    samples = [task.train_sample(i) for i in range(episodes)]
    with EnvPool(EnvPoolConfig(mode=mode, workers=workers)) as pool:
        answers = {s.prompt: s.answer for s in samples}
        runner = EpisodeRunner(ScriptedEngine(codec, _oracle(kind, answers)), codec, pool,
                               EpisodeLimits(max_turns=4, max_total_tokens=4096))
        runner.run([EpisodeRequest(kind, "warm", samples[0], environment_for(task), max_new_tokens=256)])
        pool.reset_stats()
        start = time.perf_counter()
        results = runner.run([EpisodeRequest(kind, f"g{i}", s, environment_for(task), max_new_tokens=256)
                              for i, s in enumerate(samples)])
        wall = time.perf_counter() - start
        stats = pool.stats()
    summary = summarize_episodes(results)
    tools = {stage: {k: round(v * 1e3, 3) for k, v in s.items() if k in ("p50", "p90", "p99", "max")}
             for stage, s in stats["stages"].items() if stage.startswith("tool:") or stage == "reward"}
    return {"kind": kind, "mode": mode, "workers": workers, "episodes": episodes,
            "episodes_per_s": round(episodes / wall, 1), "mean_reward": round(summary["mean_reward"], 3),
            "mean_turns": summary["mean_turns"], "tool_errors": sum(r.tool_errors for r in results),
            "errors": sum(r.error is not None for r in results), "busy_fraction": round(stats["busy_fraction"], 2),
            "latency_ms": tools}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=200)
    parser.add_argument("--mode", default="thread", choices=("thread", "process", "inline"))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--fixtures", default=str(ROOT / "tests" / "fixtures" / "env"))
    parser.add_argument("--kinds", default="lookup,gsm8k_plain,gsm8k_tool,hotpotqa,python")
    args = parser.parse_args(argv)
    fixtures = Path(args.fixtures)
    for kind in args.kinds.split(","):
        if kind == "python":
            task = _PythonTask()
        else:
            path = {"gsm8k_tool": "gsm8k_mini.jsonl", "gsm8k_plain": "gsm8k_mini.jsonl",
                    "hotpotqa": "hotpotqa_mini.jsonl"}.get(kind)
            task = build_env_task(DatasetSpec(kind=kind, path=str(fixtures / path) if path else None, eval_size=1))
        episodes = min(args.episodes, 40) if kind == "python" else args.episodes
        print(json.dumps(bench(kind, task, episodes, args.mode, args.workers)), flush=True)


if __name__ == "__main__":
    main()
