"""What the tests share, by purpose; test modules import from here, never from each other.

    jobs.py      launching `marlaas` and its jobs, run-dir records (ranks/, timeline/, status.json)
    configs.py   job configs and the scheduler tests' task specs
    checks.py    checks many tests make the same way (staleness bound, every version trained once, ...)
    workloads.py inputs of the simulated scheduler
    slurm.py     jobs on the local Slurm cluster
    rollout.py   the rollout engine tests' requests, what a vLLM worker holds
    episodes.py  scripted policies the env tests play
    unix_users.py throw-away Unix users (root only)
    trainer_scenarios.py, dp_scenarios.py   trainer runs in spawned gloo processes (one or every checkpoint)
    delta_scenarios.py, relay_scenarios.py, fault_ranks.py, peer_weights_ranks.py   rank programs run under mpirun
"""
