"""Trainer ranks: many LoRA adapters, each on its own RL objective, over one frozen megatron-core base
(docs/architecture.md §10).

    objectives.py  each task's objective (grpo, dr_grpo, dapo, gspo) as a pure function, in a registry
    cpu_shims.py   the CUDA-only megatron-core call sites redirected on CPU (no-op with CUDA)
    model.py       process groups + GPTModel (local spec) loaded from an HF Qwen3 checkpoint via mbridge, its
                   forward to the final hidden states, train mode for a step
    lm_head.py     the LM head in float32 over the trained tokens' hidden states (vocab-parallel)
    attention.py   packed rows' attention: the visibility rule over segment ids, dense or FlexAttention kernel
    packing.py     a micro-batch's sequences in rows of one task, each prompt once for its samples
    lora.py        TP-aware multi-LoRA sites on Column/RowParallelLinear, per-row adapters (LoraContext)
    peft_io.py     PEFT adapter directories in and out (atomic)
    experts_parallel.py  expert parallelism: the all-to-all dispatcher carrying adapter codes, export gather
    lockstep.py    a step's forwards/backwards in step over an EP group; expert gradients over expert-DP
    trainer.py     TrainerConfig + MultiLoraTrainer (tasks, logprobs, train_step, export/import, resume)

Nothing here imports megatron-core at module import time; it is loaded when a trainer is built.
"""
