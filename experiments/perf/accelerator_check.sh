#!/usr/bin/env bash
# The accelerator measurements of docs/accelerators.md, one command per phase, each sized to
# about 5 minutes on one H100/H200 (16 cores):
#
#   bash experiments/perf/accelerator_check.sh perf  OUTDIR   # timings, on an idle GPU
#   bash experiments/perf/accelerator_check.sh suite OUTDIR   # the test suite and small suites
#
# Run from the repository root with the package importable (PYTHONPATH=. or installed).
# `suite` needs sif2jax and the LIBSVM files (HDM_DATA_DIR). Every step has its own time
# limit and writes its log under OUTDIR as it goes.
set -u
phase=${1:?usage: accelerator_check.sh perf|suite OUTDIR}
out=${2:?usage: accelerator_check.sh perf|suite OUTDIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
start=$(date +%s)
stamp() { echo "[$(($(date +%s) - start)) s] $*"; }
py=${PYTHON:-python3}

case "$phase" in
  perf)
    # One process on the GPU at a time: these are timings.
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
    $py -c "import jax, optax; print('jax', jax.__version__, jax.devices(), 'optax', optax.__version__)"
    stamp "overhead: trial_lbfgs beside optax.lbfgs and optx.LBFGS"
    timeout 240 $py -m experiments.perf.overhead --optimizer trial_lbfgs \
      --sizes "${SIZES:-1e5,1e6,1e7}" --steps 50 --repeats 3 --peers 'optax.lbfgs(),optx.LBFGS' \
      2>&1 | tee "$out/overhead_trial_lbfgs.txt"
    stamp "overhead: hdm_auto"
    timeout 60 $py -m experiments.perf.overhead --optimizer hdm_auto --sizes "${SIZES:-1e6,1e7}" \
      --repeats 3 2>&1 | tee "$out/overhead_hdm_auto.txt"
    stamp batched
    timeout 150 $py -m experiments.perf.batched --batches "${BATCHES:-1,1024,16384}" \
      --solvers 'hdm_auto(),osgm_best(),trial_lbfgs(),optax.lbfgs(),trial_lbfgs() sb' --repeats 3 2>&1 \
      | tee "$out/batched.txt"
    ;;
  suite)
    export XLA_PYTHON_CLIENT_PREALLOCATE=false  # several processes share the GPU
    stamp "tests and suites in parallel"
    # -v: one line per test as it ends, so a run cut off by the timeout still names its failures
    (timeout 200 $py -m pytest -n 10 -v -rfs -p no:cacheprovider > "$out/pytest.txt" 2>&1
      stamp "pytest exit $?" >> "$out/pytest.txt") &
    (timeout 200 $py -m experiments.benchmark --no-progress --suite libsvm32 --seeds 5 \
      --solvers 'hdm_auto()' 'optax.lbfgs()' --jobs 2 --out "$out/work/libsvm32" > "$out/libsvm32.txt" 2>&1
      stamp "libsvm32 exit $?" >> "$out/libsvm32.txt") &
    (timeout 200 $py -m experiments.benchmark --no-progress --suite user cutest \
      --problems AKIVA HILBERTB BOX3 rosenbrock-100 --solvers 'hdm_auto()' 'trial_lbfgs()' \
      'optax.lbfgs()' --out "$out/work/small" > "$out/small.txt" 2>&1
      stamp "user/cutest exit $?" >> "$out/small.txt") &
    (timeout 200 $py -m experiments.table1 --datasets w1a heart_scale --out "$out/work/table1" \
      > "$out/table1.txt" 2>&1; stamp "table1 exit $?" >> "$out/table1.txt") &
    wait
    for f in "$out"/*.txt; do echo "== $f"; tail -n 6 "$f"; done
    tar czf "$out/suite_outputs.tgz" -C "$out" work && rm -rf "$out/work"
    ;;
  *)
    echo "unknown phase $phase (perf or suite)" >&2
    exit 2
    ;;
esac
stamp done
