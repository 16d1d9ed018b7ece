"""`marlaas simulate CONFIG [--workload W.yaml] [--mode M] [--seed N] [--out DIR] [--tasks N] ...`

Runs the job config's tasks (or N copies of them) through the real scheduler on simulated time and prints
e2e time, busy fraction per role, mean TTFS and TPTS; --out writes summary.json and audit.jsonl.
"""
from __future__ import annotations

import sys
from pathlib import Path

from marlaas_hpc.scheduler import MODES
from marlaas_hpc.tasks.spec import SpecError

DEFAULT_WORKLOAD = Path(__file__).resolve().parents[2] / "configs" / "workloads" / "tiny-cpu.yaml"


def add_parser(sub) -> None:
    p = sub.add_parser("simulate", help="simulate a job on the discrete-event simulator (real scheduler)")
    p.add_argument("config", help="job config YAML (layout, tasks, mode, slots)")
    p.add_argument("--workload", default=str(DEFAULT_WORKLOAD), help="workload YAML (configs/workloads/)")
    p.add_argument("--mode", choices=MODES, help="override the config's mode")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write summary.json and audit.jsonl here")
    p.add_argument("--tasks", type=int, help="simulate this many tasks (copies of the config's)")
    p.add_argument("--rollout-ranks", type=int)
    p.add_argument("--env-ranks", type=int)
    p.add_argument("--trainer-tp", type=int)
    p.add_argument("--trainer-dp", type=int, help="data-parallel replicas per trainer group")
    p.add_argument("--trainer-groups", "--trainer-replicas", dest="trainer_groups", type=int,
                   help="independent trainer groups (the scheduler places each task on one)")
    p.add_argument("--staleness", type=int, help="set every task's max_staleness k")
    p.add_argument("--lose", action="append", default=[], metavar="ROLE:INDEX@SECONDS",
                   help="inject a rank's loss, e.g. rollout:1@30 (the second rollout rank at 30 s); repeatable")
    p.set_defaults(func=run_command)


def build(config: str, workload: str, mode=None, tasks=None, staleness=None, lose=(), **layout):
    """(setup, workload) of a config; raises SpecError naming the bad field."""
    import dataclasses

    from marlaas_hpc.config import JobConfig
    from marlaas_hpc.sim.setup import RankLoss, copies_to, setup_from_job
    from marlaas_hpc.sim.workload import load_workload

    job = JobConfig.load(config)
    specs = copies_to(job.tasks, tasks) if tasks else list(job.tasks)
    if staleness is not None:
        specs = [dataclasses.replace(s, max_staleness=staleness) for s in specs]
    active = max(job.max_adapters, len(specs)) if tasks else job.max_adapters
    setup = setup_from_job(job, mode=mode, tasks=specs, max_adapters=active,
                           losses=[RankLoss.parse(text) for text in lose] or None, **layout)
    return setup, load_workload(workload)


def run_command(args) -> int:
    from marlaas_hpc.sim.engine import Simulation
    from marlaas_hpc.sim.report import headline, summarize, write_outputs

    try:
        setup, workload = build(args.config, args.workload, args.mode, args.tasks, args.staleness, args.lose,
                                rollout_ranks=args.rollout_ranks, env_ranks=args.env_ranks,
                                trainer_tp=args.trainer_tp, trainer_dp=args.trainer_dp,
                                trainer_groups=args.trainer_groups)
    except (SpecError, OSError) as exc:
        print(f"marlaas simulate: {exc}", file=sys.stderr)
        return 2
    sim = Simulation(setup, workload, seed=args.seed)
    summary = summarize(sim, sim.run(), args.seed)
    print(headline(summary))
    print(f"{'task':<16} {'status':<8} {'steps':>5} {'TTFS_s':>9} {'TPTS_s':>9} {'max_stale':>9}")
    for task_id, t in list(summary["tasks"].items())[:32]:
        ttfs = "-" if t["ttfs_s"] is None else f"{t['ttfs_s']:.2f}"
        tpts = "-" if t["tpts_s"] is None else f"{t['tpts_s']:.2f}"
        print(f"{task_id:<16} {t['status']:<8} {t['steps_done']:>5} {ttfs:>9} {tpts:>9} "
              f"{t['max_staleness_trained']:>9}")
    if len(summary["tasks"]) > 32:
        print(f"... {len(summary['tasks']) - 32} more tasks")
    for loss in summary["ranks_lost"]:
        print(f"{loss['role']} rank {loss['rank']} lost at {loss['at']:.2f} s: {len(loss['groups_reissued'])} "
              "groups issued again")
    print(f"trace sha256 {summary['trace_sha256'][:16]}  ({summary['scheduler_events']} scheduler events)")
    if args.out:
        print(f"outputs: {write_outputs(args.out, summary, sim)}")
    return 0
