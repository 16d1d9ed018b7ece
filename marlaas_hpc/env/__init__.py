"""Env ranks (docs/architecture.md §9): multi-turn environments, tools, workloads, the env worker pool and the episode
runner that ping-pongs between a RolloutEngine and the envs; `build_task_data`, the data of every task kind."""
from marlaas_hpc.env.custom import CustomTask
from marlaas_hpc.env.episode import EpisodeRequest, EpisodeResult, EpisodeRunner, summarize_episodes
from marlaas_hpc.env.kinds import build_task_data
from marlaas_hpc.env.pool import EnvError, EnvPool, EnvPoolConfig, StepOutcome
from marlaas_hpc.env.protocol import (Environment, EpisodeLimits, Final, Observation, SingleTurnEnv,
                                      environment_for)
from marlaas_hpc.env.sandbox import SandboxLimits, SandboxResult, run_python
from marlaas_hpc.env.tools import (Bm25Index, Calculator, Document, Lookup, Python, Search, Tool, ToolBox, ToolCall,
                                   ToolEnv, ToolError, ToolTask, parse_compact_call, parse_tool_calls)
from marlaas_hpc.env.workloads import (Gsm8kEnvTask, HotpotQATask, LookupTask, build_env_task,
                                       read_jsonl_rows)

__all__ = ["Bm25Index", "Calculator", "CustomTask", "Document", "EnvError", "EnvPool", "EnvPoolConfig",
           "Environment", "EpisodeLimits", "EpisodeRequest", "EpisodeResult", "EpisodeRunner", "Final",
           "Gsm8kEnvTask", "HotpotQATask", "Lookup", "LookupTask", "Observation", "Python", "SandboxLimits",
           "SandboxResult", "Search", "SingleTurnEnv", "StepOutcome", "Tool", "ToolBox", "ToolCall", "ToolEnv",
           "ToolError", "ToolTask", "build_env_task", "build_task_data", "environment_for", "parse_compact_call",
           "parse_tool_calls", "read_jsonl_rows", "run_python", "summarize_episodes"]
