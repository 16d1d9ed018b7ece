"""The MPI runtime: one loop per role, the messages between them, and the run's outputs and checkpoints
(docs/architecture.md). Nothing is imported here: each rank imports only what its role needs.

    main.py            entry point of every rank: arguments, then process.py's steps and roles.py's role
    process.py         a rank's life apart from its role: job, device bound before MPI_Init, start checks, end
    roles.py           the wiring of each role (RankSetup, run_scheduler / run_env / run_rollout / run_trainer)
    engines.py         a rollout rank's engine (restarting, one per base model, its part in repack)
    join.py            a rollout rank started into the live job (marlaas scale, layout.rollout_replace)
    scheduler_rank.py  world rank 0: SchedulerRank, a thin loop over rank0/ (intake, evals, elastic ranks,
                       preemption) around the Scheduler
    rollout_rank.py    RolloutRank: one engine for every task's adapters; installs new versions
    env_rank.py        EnvRank: episodes, env steps in an EnvPool, rewards and advantages
    trainer_rank.py    TrainerRank: a trainer group's leader and followers; check_bound; task moves
    messages.py        what travels between ranks (tags, GenerateWork, GroupTurn, ScoredGroup, ...)
    comm.py            poll, Outbox (non-blocking sends), BusyClock and the per-rank timeline
    delta/             the delta plane behind one interface (broadcast or relay; abort and set-up deadline)
    checkpoint.py      periodic and preemption checkpoints, CheckpointPolicy, shards, PreemptFlag
    records.py         rank 0's records: an append-only journal of keyed records (JobRecords, read_records)
    recovery.py        resume points (shard digests checked on every trainer rank), output rollback
    faults.py          a task's fault or the job's (peer lost, storage)
    outputs.py         RunBooks (rank 0's writes per event: records, audit.jsonl, status.json), summary.json
"""
