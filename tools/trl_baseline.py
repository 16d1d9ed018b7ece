"""One task trained by TRL's GRPOTrainer + PEFT in one process: the single-process baseline of
tools/bench_vs_trl.py. It runs in the baseline's own venv (tools/setup_trl_venv.sh), so it imports nothing
of marlaas_hpc: the task comes as a JSON payload written by bench_vs_trl.py (prompts, answers, eval split,
LoRA and GRPO hyper-parameters taken from the task's spec and data).

    TRL_VENV/bin/python tools/trl_baseline.py PAYLOAD.json RESULT.json

RESULT.json: greedy eval accuracy before and after training (same exact-match reward as the task's), and the
seconds spent importing, setting up, training and evaluating.
"""
from __future__ import annotations

import json
import sys
import time

START = time.perf_counter()


def exact_match(completion: str, answer: str) -> float:
    """The synthetic tasks' verifier (marlaas_hpc/tasks/synthetic.py SyntheticTask.score)."""
    return 1.0 if completion.strip() == answer else 0.0


def reward_fn(prompts, completions, answer, **_) -> list[float]:
    """TRL reward function: dataset column `answer` arrives as a keyword list, one entry per completion."""
    return [exact_match(c if isinstance(c, str) else c[0]["content"], a) for c, a in zip(completions, answer)]


def prompt_text(tokenizer, prompt: str) -> str:
    """The prompt as TRL tokenizes it (the tokenizer's defaults: the tiny tokenizer adds no special tokens): the
    raw format's bos, then the text, which gives the ids marlaas's TextCodec.encode_prompt gives
    (tests/test_bench_vs_trl.py checks)."""
    return (tokenizer.bos_token or "") + prompt


def greedy_accuracy(model, tokenizer, prompts: list[str], answers: list[str], max_new_tokens: int) -> float:
    """Greedy exact-match accuracy on the eval split, one left-padded batch."""
    import torch

    tokenizer.padding_side = "left"
    batch = tokenizer([prompt_text(tokenizer, p) for p in prompts], return_tensors="pt", padding=True,
                      add_special_tokens=False)
    model.eval()
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    completions = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    return sum(exact_match(c, a) for c, a in zip(completions, answers)) / len(answers)


def main(payload_path: str, result_path: str) -> None:
    payload = json.loads(open(payload_path).read())
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    imported = time.perf_counter()
    torch.set_num_threads(1)
    torch.manual_seed(payload["seed"])
    algo, lora = payload["algo"], payload["lora"]
    tokenizer = AutoTokenizer.from_pretrained(payload["model_path"])
    model = AutoModelForCausalLM.from_pretrained(payload["model_path"], dtype=torch.float32)
    eval_prompts, eval_answers = payload["eval_prompts"], payload["eval_answers"]
    before = greedy_accuracy(model, tokenizer, eval_prompts, eval_answers, algo["max_new_tokens"])
    dataset = Dataset.from_list([{"prompt": prompt_text(tokenizer, p), "answer": a}
                                 for p, a in zip(payload["train_prompts"], payload["train_answers"])])
    config = GRPOConfig(
        output_dir=payload["output_dir"], max_steps=payload["steps"], learning_rate=algo["lr"],
        weight_decay=algo["weight_decay"], lr_scheduler_type="constant", warmup_steps=0,
        max_grad_norm=algo["grad_clip"], num_generations=algo["group_size"],
        per_device_train_batch_size=algo["group_size"] * algo["batch_prompts"], gradient_accumulation_steps=1,
        num_iterations=1, epsilon=algo["clip_eps"], epsilon_high=algo["clip_eps_high"], beta=algo["kl_beta"],
        temperature=algo["temperature"],
        max_completion_length=algo["max_new_tokens"], loss_type="dapo",
        scale_rewards="group" if algo["normalize_adv_std"] else "none", shuffle_dataset=False,
        use_cpu=True, bf16=False, seed=payload["seed"], logging_steps=10, save_strategy="no", report_to="none",
        gradient_checkpointing=False, dataloader_num_workers=0, disable_tqdm=True)
    trainer = GRPOTrainer(model=model, reward_funcs=[reward_fn], args=config, train_dataset=dataset,
                          processing_class=tokenizer,
                          peft_config=LoraConfig(r=lora["rank"], lora_alpha=lora["alpha"], lora_dropout=0.0,
                                                 target_modules=list(lora["target_modules"]), task_type="CAUSAL_LM"))
    set_up = time.perf_counter()
    trainer.train()
    trained = time.perf_counter()
    after = greedy_accuracy(trainer.model, tokenizer, eval_prompts, eval_answers, algo["max_new_tokens"])
    done = time.perf_counter()
    result = {"task_id": payload["task_id"], "eval_before": before, "eval_after": after,
              "steps": trainer.state.global_step, "import_s": imported - START, "setup_s": set_up - imported,
              "train_s": trained - set_up, "eval_s": done - trained, "process_s": done - START}
    with open(result_path, "w") as sink:
        json.dump(result, sink)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
