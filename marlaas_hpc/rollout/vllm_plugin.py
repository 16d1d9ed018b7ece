"""This package's vLLM general plugin (pyproject.toml, entry point group `vllm.general_plugins`).

vLLM runs its general plugins in every process of an engine, the engine core and worker processes it spawns
included. A rollout engine whose core runs in a process of its own (rollout/vllm_engine.py `start_llm`) needs two
things there that the rank's own process cannot do for it:
- the CPU LoRA wrapper (rollout/vllm_cpu_lora.py), on the CPU platform only;
- to die with its parent. A rank that crashes is killed by mpirun (SIGTERM, then SIGKILL): vLLM's processes would
  outlive it, orphaned, holding the job's output pipes open (the job then never ends). `start_llm` names the rank
  in MARLAAS_ENGINE_PARENT while vLLM spawns; each process spawned under it asks the kernel for SIGKILL when its
  parent dies (prctl PR_SET_PDEATHSIG): the core when the rank dies, the core's workers when the core does;
- to ignore SIGUSR2, the preemption signal (runtime/checkpoint.py). It is meant for the ranks, but Slurm's
  `--signal=USR2@lead` signals every process of the step, and a local launcher (PRRTE's prterun) forwards it to each
  rank's process group, where an engine core in a process of its own sits: vLLM's processes handle only TERM and
  INT, so USR2's default action ended them and left the rank waiting on a dead core. `start_llm` keeps USR2
  blocked while vLLM spawns (the mask is inherited: a signal before this plugin runs stays pending), and the plugin
  then ignores it for good (a pending one is discarded).
Light on purpose: elsewhere (no such variable, a GPU platform) it imports nothing more and changes nothing.
"""
from __future__ import annotations

import os
import signal
import sys

PARENT_ENV = "MARLAAS_ENGINE_PARENT"
"""Set by `start_llm` while vLLM spawns an engine's processes: the pid of the rank that owns them."""
PR_SET_PDEATHSIG = 1


def setup_engine_process() -> None:
    """The plugin: in a spawned engine process, ignore USR2 and die with the parent; the CPU LoRA wrapper on the
    CPU platform."""
    if spawned_engine_process():
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    die_with_parent()
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from marlaas_hpc.rollout import vllm_cpu_lora

        vllm_cpu_lora.install()


def spawned_engine_process() -> bool:
    """This process was spawned under a rank's engine (MARLAAS_ENGINE_PARENT set, and not the rank itself: vLLM
    loads its plugins in the rank too, which must keep its USR2 handler)."""
    owner = os.environ.get(PARENT_ENV)
    return owner is not None and int(owner) != os.getpid()


def die_with_parent() -> bool:
    """In a process spawned under a rank's engine (`spawned_engine_process`), on Linux: SIGKILL when the parent
    dies. Returns whether it was set."""
    if not spawned_engine_process() or not sys.platform.startswith("linux"):
        return False
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        return False
    if os.getppid() == 1:  # the parent died before the request: nobody would send the signal
        os._exit(1)
    return True
