"""The MPI runtime: one loop per role, the messages between them, and the run's outputs and checkpoints
(docs/architecture.md). Nothing is imported here: each rank imports only what its role needs.

    main.py            entry point of every rank: load the job, bind the device, run the role's loop
    scheduler_rank.py  world rank 0: SchedulerRank (the Scheduler behind MPI, intake, prompts, evals, records)
    rollout_rank.py    RolloutRank: one engine for every task's adapters; installs delta broadcasts
    env_rank.py        EnvRank: episodes, env steps in an EnvPool, rewards and advantages
    trainer_rank.py    TrainerRank: a trainer group's leader and followers; check_bound; task moves
    messages.py        what travels between ranks (tags, GenerateWork, GroupTurn, ScoredGroup, ...)
    comm.py            poll, Outbox (non-blocking sends), BusyClock and the per-rank timeline
    delta.py           DeltaChannel: a trainer leader's broadcast group to the rollout ranks (NCCL or gloo)
    delta_fanin.py     DeltaFanIn: a rollout rank's view of every leader's broadcasts
    checkpoint.py      periodic and preemption checkpoints, CheckpointPolicy, shards, PreemptFlag
    records.py         rank 0's records: an append-only journal of keyed records (JobRecords, read_records)
    recovery.py        resume points (shard digests checked on every trainer rank), output rollback
    faults.py          a task's fault or the job's (peer lost, storage)
    outputs.py         RunBooks (rank 0's writes per event: records, audit.jsonl, status.json), summary.json
"""
