#!/usr/bin/env bash
# The project's test command (README, CI): set up the venv, then run every test suite.
# Suites that need a local Slurm cluster run when slurm/local-cluster/start.sh can bring one up (root).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
if [ -x slurm/local-cluster/start.sh ] && [ "$(id -u)" = 0 ] && [ "${MARLAAS_NO_SLURM:-0}" != 1 ]; then
    bash slurm/local-cluster/start.sh || echo "[test] local Slurm did not start: slurm tests will be skipped"
fi
# Build the tiny model once up front so its build time shows separately from the tests'.
.venv/bin/python tools/build_tiny_model.py
# --durations=30: the 30 slowest tests of each run, where the suite's time goes.
# -n 2 --dist loadfile: two workers (the 2-core CI machine), each test file whole on one of them (tests/conftest.py
# `pytest_xdist_make_scheduler`: a file's module-scoped job runs once; the Slurm files share one worker).
# The vLLM tests run beside them, in a pytest process of their own: vLLM's kernel-override scan of sys.modules
# trips over llvmlite objects that bm25s (env tests) imports (rollout ranks never import bm25s). Alone they kept
# 57% of the two cores busy (engine start-ups wait on their processes), which the other workers fill: run one
# after the other the two took 1,881 s + 549 s (2026-11-29). Their output follows the others'.
vllm_log=$(mktemp /tmp/marlaas-vllm-tests.XXXXXX.log)
.venv/bin/python -m pytest -q -ra --durations=30 -m vllm "$@" > "$vllm_log" 2>&1 &
vllm_pid=$!
trap 'kill "$vllm_pid" 2>/dev/null || true' EXIT
status=0
.venv/bin/python -m pytest -q -ra --durations=30 -n "${MARLAAS_TEST_WORKERS:-2}" --dist loadfile -m "not vllm" "$@" \
    || status=$?
vllm_status=0
wait "$vllm_pid" || vllm_status=$?
echo "[test] the vLLM tests (pytest -m vllm, run beside the others; log $vllm_log):"
cat "$vllm_log"
[ "$status" = 0 ] || exit "$status"
exit "$vllm_status"
