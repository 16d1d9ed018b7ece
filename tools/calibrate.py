"""Fits the simulator's workload model to measured runs and checks the fit by simulating them.

    python tools/calibrate.py RUN_DIR [RUN_DIR ...] [--config CONFIG] [-o configs/workloads/my.yaml]

A run dir is what `marlaas run` writes (summary.json, timeline/rank<N>.jsonl, tasks/.../metrics.jsonl); its job
config is RUN_DIR/config.yaml unless --config is given. Several run dirs (e.g. the three modes) are pooled.
Prints, per mode, the simulated vs measured e2e time, busy fraction per role, mean TTFS and TPTS (several runs
of one mode: their mean, and each run's value, since a shared machine makes repeats differ).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from studies.calibrate import calibrate, dump_workload, predict_vs_measured  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+")
    parser.add_argument("--config", help="the runs' job config (default: RUN_DIR/config.yaml)")
    parser.add_argument("-o", "--output", help="write the fitted workload YAML here (default: stdout)")
    args = parser.parse_args()
    workload = calibrate(args.run_dirs, args.config)
    text = dump_workload(workload)
    if args.output:
        Path(args.output).write_text(text)
        print(f"workload written to {args.output}")
    else:
        print(text)
    by_mode: dict[str, list[str]] = {}
    for run_dir in args.run_dirs:  # repeats of one mode are compared as one (their mean, and the spread)
        by_mode.setdefault(json.loads((Path(run_dir) / "summary.json").read_text())["mode"], []).append(run_dir)
    for dirs in by_mode.values():
        for row in predict_vs_measured(dirs, workload, args.config):
            print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
