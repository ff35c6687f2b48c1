#!/usr/bin/env bash
# Set up .venv (if missing or out of date) and run one of the project's jobs.
#   bash scripts/dev.sh demo   # the main job: xla-tp launch --check (tiny Llama, 8 emulated CPU devices)
#   bash scripts/dev.sh test       # the test suite's quick tier (under 8 minutes on CI's two cores)
#   bash scripts/dev.sh complete   # the complete tier: the tests the quick one leaves out, then the core's tests
#                                  # in .venv-core (torch 2.11, no torch_xla: scripts/core-env.txt); CI runs both tiers
#   bash scripts/dev.sh bench      # the benchmarks
set -euo pipefail
cd "$(dirname "$0")/.."
job="${1:-demo}"; shift || true

venv=.venv
stamp="$venv/.xla_tp-installed"
want="$(cat setup.py | sha256sum | cut -c1-16)"
if [ ! -x "$venv/bin/python" ]; then
  echo "[xla_tp] creating $venv" >&2
  python3 -m venv "$venv"
fi
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
  echo "[xla_tp] installing xla_tp and its pinned dependencies into $venv (first run: several minutes)" >&2
  "$venv/bin/pip" install -q -e '.[test]'
  echo "$want" > "$stamp"
fi

# XLA on the CPU: 8 virtual devices, SPMD. What the compiled program does here is what it does on TPU.
export PJRT_DEVICE="${PJRT_DEVICE:-CPU}" CPU_NUM_DEVICES="${CPU_NUM_DEVICES:-8}"
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
py="$venv/bin/python"
case "$job" in
  demo)  exec "$py" -m xla_tp.cli launch --check "$@" ;;
  # two workers (XLA_TP_TEST_WORKERS), each with 8 emulated devices; a test file runs whole on one worker, so
  # its module fixtures (a compiled model, a fresh process's results) are built once
  test)  "$venv/bin/ruff" check --quiet xla_tp tests bench &&
         exec "$py" -m pytest -q -n "${XLA_TP_TEST_WORKERS:-2}" --dist loadfile --durations=15 -m "not complete" tests "$@" ;;
  complete) "$py" -m pytest -q -n "${XLA_TP_TEST_WORKERS:-2}" --dist loadfile --durations=15 -m complete tests "$@"
         core=.venv-core; core_want="$(sha256sum scripts/core-env.txt | cut -c1-16)"
         if [ ! -x "$core/bin/python" ]; then echo "[xla_tp] creating $core" >&2; python3 -m venv "$core"; fi
         if [ "$(cat "$core/.installed" 2>/dev/null || true)" != "$core_want" ]; then
           echo "[xla_tp] installing the torch_xla-free environment into $core (first run: a few minutes)" >&2
           "$core/bin/pip" install -q -r scripts/core-env.txt && echo "$core_want" > "$core/.installed"
         fi
         files=$(grep -l "^pytestmark = pytest.mark.core" tests/*/test_*.py)  # the files that need torch only
         echo "[xla_tp] the core's tests without torch_xla ($core, $("$core/bin/python" -c 'import torch; print("torch", torch.__version__)'))" >&2
         PYTHONPATH=. exec "$core/bin/python" -m pytest -q -p no:cacheprovider -m "core" $files ;;
  bench) exec "$py" -m bench "$@" ;;
  *) echo "unknown job '$job': use demo, test, complete or bench" >&2; exit 2 ;;
esac
