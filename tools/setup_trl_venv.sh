#!/usr/bin/env bash
# Creates the venv of the single-process baseline that tools/bench_vs_trl.py compares against: TRL's
# GRPOTrainer + PEFT, kept apart from the project's venv (trl pins its own transformers/accelerate range).
# Idempotent. Usage: bash tools/setup_trl_venv.sh [VENV_DIR]   (default ~/.cache/marlaas_hpc/trl-venv)
set -euo pipefail
VENV=${1:-${HOME}/.cache/marlaas_hpc/trl-venv}
[ -x "$VENV/bin/python" ] || python3.11 -m venv "$VENV"
PY="$VENV/bin/python"
pip_q() { "$PY" -m pip "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; }
pip_q install -q --upgrade pip >/dev/null
# torch first: the pin resolves to the local CPU wheel (a bare 'torch' would pull a multi-GB CUDA build).
pip_q install -q "torch==2.13.0"
pip_q install -q "trl==1.16.0" peft safetensors pyyaml
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$PY" -c "import torch, trl, peft, transformers; print(f'[trl-venv] ok: torch {torch.__version__}, trl {trl.__version__}, peft {peft.__version__}, transformers {transformers.__version__}')"
