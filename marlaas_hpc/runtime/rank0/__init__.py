"""World rank 0's components, each owning one concern of the job's control; runtime/scheduler_rank.py's loop drives
them around the pure Scheduler (scheduler/core.py):

    inputs.py       what rank 0 knows of each task's inputs (data, prompt codec); a Generate made into GenerateWork
    intake.py       tasks coming in: the config's and a resume's start specs, the queue dir, refusals, serving
    evals.py        greedy evals before and after each task: sent, answered, sent again after a rank's loss
    elastic.py      ranks that go and come: losses (one line each, with the cause), joins, drains, delta epochs
    preemption.py   USR2: drain, then every trainer group checkpoints its tasks
"""
