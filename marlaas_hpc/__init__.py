"""marlaas_hpc: many RL fine-tuning tasks (one LoRA adapter and optimizer each) on one frozen base model, with
rollout, env/reward and training as asynchronous stages on the ranks of one MPI world. A rank-0 scheduler keeps
every task within its staleness bound k: at most (k+1)*B prompt groups issued and not yet trained.

    marlaas tasks add / config tasks:
          │ Submit
          ▼
    rank 0: SchedulerRank + Scheduler ───GenerateWork───► rollout ranks: RolloutRank (vLLM multi-LoRA)
      ▲ events: Generated, Scored,  │ Admit, Train,             GroupTurn │  ▲ ContinueGroup, GroupEnded
      │ StepDone, TaskFailed, ...   │ Discard, Move, ...                  ▼  │ (multi-turn)
      ├─────────────────────────────┼───────────────── env ranks: EnvRank (tools, rewards, advantages)
      │                             ▼                                     │ ScoredGroup
      └──────────── trainer groups: TrainerRank + MultiLoraTrainer (megatron-core, TP x DP) ◄┘
                                    │ DeltaAnnounce + broadcast on each group leader's DeltaChannel
                                    └──► every rollout rank installs the task's new adapter version

docs/architecture.md has the full picture: roles and communicators, messages, the staleness rule, modes, trainer
groups, checkpoint and resume, one prompt group followed end to end, a module map and a glossary.
"""
