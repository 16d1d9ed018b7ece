"""Time of one adapter-version install on a rollout rank's vLLM engine: from memory (what a rollout rank does with a
delta now: `add_adapter(AdapterRef(..., tensors=..., lora=...))`) against through a directory (what it did before:
write the PEFT dir, then `add_adapter(AdapterRef(..., path))`, vLLM reading the files). Prints figures; asserts
nothing about speed.

    python tools/bench_adapter_install.py [--model tiny|random:qwen3-0.6b|random:qwen3-0.6b-mini]
                                          [--lora-rank 8] [--versions 20]

Each version is a fresh set of random LoRA tensors on all seven projections of every layer (the shapes of the
model's config), installed as the task's next version (the previous one retires: no request uses it), the two
ways alternating on one engine. The directory way's files are deleted after each install, outside the timing.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path


def lora_tensors(config: dict, rank: int, seed: int) -> dict:
    """PEFT-named random LoRA tensors (A and B non-zero) for every layer's seven projections."""
    import torch

    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_out, kv_out = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes = {"self_attn.q_proj": (hidden, q_out), "self_attn.k_proj": (hidden, kv_out),
              "self_attn.v_proj": (hidden, kv_out), "self_attn.o_proj": (q_out, hidden),
              "mlp.gate_proj": (hidden, inter), "mlp.up_proj": (hidden, inter), "mlp.down_proj": (inter, hidden)}
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (d_in, d_out) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            out[f"{prefix}.lora_A.weight"] = torch.randn(rank, d_in, generator=gen) * 0.01
            out[f"{prefix}.lora_B.weight"] = torch.randn(d_out, rank, generator=gen) * 0.01
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--versions", type=int, default=20, help="installs timed per way")
    args = parser.parse_args()

    import json

    from marlaas_hpc.config import JobConfig
    from marlaas_hpc.model.cache import default_cache_dir
    from marlaas_hpc.rollout import AdapterRef, make_engine
    from marlaas_hpc.tasks.spec import LoraSpec
    from marlaas_hpc.trainer.peft_io import write_peft_adapter

    model_path = JobConfig.from_dict({"model": args.model}).model_path()
    config = json.loads((Path(model_path) / "config.json").read_text())
    lora = LoraSpec(rank=args.lora_rank, alpha=2.0 * args.lora_rank)
    pool = [lora_tensors(config, args.lora_rank, seed) for seed in range(4)]
    size_mb = sum(t.numel() * 4 for t in pool[0].values()) / 1e6
    engine = make_engine("vllm", model_path, work_dir=default_cache_dir() / "vllm-bench-install",
                         cache_dir=default_cache_dir() / "vllm", max_loras=2, max_lora_rank=args.lora_rank,
                         seed=0, max_model_len=512)  # a 1 GiB CPU KV cache does not fit Qwen3's 40k context
    timings = {"memory": [], "disk: write": [], "disk: load": []}
    scratch = Path(tempfile.mkdtemp(prefix="marlaas-bench-install-"))
    try:
        for version in range(args.versions + 1):  # version 0 of each way is a warm-up, not counted
            tensors = pool[version % len(pool)]
            start = time.perf_counter()
            engine.add_adapter(AdapterRef("memory", version, tensors=tensors, lora=lora))
            in_memory = time.perf_counter() - start

            start = time.perf_counter()
            path = write_peft_adapter(scratch / f"v{version:04d}", tensors, lora)
            written = time.perf_counter() - start
            engine.add_adapter(AdapterRef("disk", version, str(path)))
            loaded = time.perf_counter() - start - written
            for ref in engine.pop_retired():
                if ref.path is not None:
                    shutil.rmtree(ref.path, ignore_errors=True)
            if version:
                timings["memory"].append(in_memory)
                timings["disk: write"].append(written)
                timings["disk: load"].append(loaded)
    finally:
        engine.close()
        shutil.rmtree(scratch, ignore_errors=True)
    disk = [w + r for w, r in zip(timings["disk: write"], timings["disk: load"])]
    print(f"[install] model {args.model}, LoRA rank {args.lora_rank}, {len(pool[0])} tensors, {size_mb:.1f} MB "
          f"fp32 per version, {args.versions} versions per way (median / mean ms)")
    for name, values in (*timings.items(), ("disk: total", disk)):
        print(f"  {name:12s} {1e3 * statistics.median(values):8.2f} / {1e3 * statistics.mean(values):8.2f}")
    print(f"  disk total / memory (medians): {statistics.median(disk) / statistics.median(timings['memory']):.1f}x")


if __name__ == "__main__":
    main()
