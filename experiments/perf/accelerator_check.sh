#!/usr/bin/env bash
# The accelerator measurements of docs/accelerators.md, as one command per phase, each
# sized to about 5 minutes on one H100/H200 (16 cores), so that a 15-minute device
# session runs both phases with time to spare:
#
#   bash experiments/perf/accelerator_check.sh perf  OUTDIR   # GPU timings first, on an idle GPU
#   bash experiments/perf/accelerator_check.sh suite OUTDIR   # the test suite and the suites
#   bash experiments/perf/accelerator_check.sh ceiling OUTDIR # the memory ceiling
#   bash experiments/perf/accelerator_check.sh trial OUTDIR   # issue 28: trial_lbfgs's targets
#
# Run from the repository root with the package importable (PYTHONPATH=. or installed).
# `suite` needs sif2jax (importing it takes about 48 s per process on a 2-core CPU: no
# step imports it before the GPU timings are done) and the LIBSVM files (HDM_DATA_DIR).
# Every step has its own time limit and writes its log under OUTDIR as it goes, so a
# step that runs out of time costs only itself; OUTDIR ends with at most 8 files.
set -u
phase=${1:?usage: accelerator_check.sh perf|suite|ceiling|trial OUTDIR}
out=${2:?usage: accelerator_check.sh perf|suite|ceiling|trial OUTDIR}
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
    stamp overhead
    timeout 60 $py -m experiments.perf.overhead --optimizer hdm_auto --sizes 1e6,1e7 \
      --check-every 1,8 --repeats 3 2>&1 | tee "$out/overhead_hdm_auto.txt"
    # XLA:GPU's command buffers (CUDA graphs) with the loops in them: the loop's
    # predicate is then decided on the device, not read by the host each iteration
    stamp "overhead, command buffers"
    XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL --xla_gpu_graph_min_graph_size=1" \
      timeout 60 $py -m experiments.perf.overhead --optimizer hdm_auto --sizes 1e6,1e7 \
      --check-every 1,8 --repeats 3 2>&1 | tee "$out/overhead_hdm_auto_cmdbuf.txt"
    timeout 45 $py -m experiments.perf.overhead --optimizer trial_lbfgs --sizes 1e6,1e7 \
      --repeats 3 2>&1 | tee "$out/overhead_trial_lbfgs.txt"
    timeout 60 $py -m experiments.perf.overhead --optimizer hdm_auto --sizes 1e6 \
      --check-every 1,8 --repeats 1 --steps 10 --kernels --hlo-dir "$out/hlo" 2>&1 \
      | tee "$out/kernels_hdm_auto.txt"
    stamp batched
    timeout 80 $py -m experiments.perf.batched --batches 1,1024,16384 \
      --solvers 'hdm_auto(),osgm_best(),trial_lbfgs(),optax.lbfgs()' --repeats 3 2>&1 \
      | tee "$out/batched.txt"
    stamp batched_bounded
    timeout 80 $py -m experiments.perf.batched_bounded --batches 1,1024 --repeats 3 2>&1 \
      | tee "$out/batched_bounded.txt"
    stamp large
    timeout 45 $py -m experiments.perf.large --sizes 1e7 --repeats 3 \
      --solvers 'hdm_auto(),trial_lbfgs(),optax.lbfgs()' 2>&1 | tee "$out/large.txt"
    ;;
  trial)
    # Issue 28's targets for trial_lbfgs() (experiments/perf/targets.py says which), each
    # ratio from one process with its peers in the same interleaved rounds; about 2 minutes
    # on one H100 (2026-11-27; the step limits add up to 450 s). Outputs: 7 files.
    # TRIAL_SIZES and TRIAL_BATCHES replace the sizes and batches (a smoke run on a CPU).
    # K = 50 iterations at every size: with overhead.py's default of 200 below n = 1e6 the
    # float32 run reaches its floor by iteration 50 and optax.lbfgs()'s zoom then spends
    # about 12 cheap calls per iteration (2298 calls in 200), which per call says nothing.
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
    $py -c "import jax, optax, optimistix; print('jax', jax.__version__, jax.devices(), 'optax', optax.__version__, 'optimistix', optimistix.__version__)"
    stamp "overhead: trial_lbfgs, optax.lbfgs, optx.LBFGS; kernels"
    timeout 300 $py -m experiments.perf.overhead --optimizer trial_lbfgs --sizes "${TRIAL_SIZES:-1e5,1e6,1e7}" \
      --steps 50 --repeats 3 --peers 'optax.lbfgs(),optx.LBFGS' --kernels --hlo-dir "$out/hlo" \
      --json "$out/overhead_trial_lbfgs.json" 2>&1 | tee "$out/overhead_trial_lbfgs.txt"
    stamp batched
    timeout 90 $py -m experiments.perf.batched --batches "${TRIAL_BATCHES:-1,1024,16384}" \
      --solvers 'trial_lbfgs(),optax.lbfgs()' --repeats 3 --json "$out/batched.json" 2>&1 \
      | tee "$out/batched.txt"
    stamp targets
    $py -m experiments.perf.targets --overhead "$out/overhead_trial_lbfgs.json" \
      --batched "$out/batched.json" 2>&1 | tee "$out/targets.txt"
    stamp "tests/test_trial_lbfgs.py"
    timeout 60 $py -m pytest tests/test_trial_lbfgs.py -q -p no:cacheprovider \
      -k "compact or matches_reference or pair_products or strict" \
      > "$out/pytest_trial_lbfgs.txt" 2>&1
    tail -n 3 "$out/pytest_trial_lbfgs.txt"
    tar czf "$out/hlo.tgz" -C "$out" hlo && rm -rf "$out/hlo"
    ;;
  ceiling)
    # the largest n each solver runs at (GBs per run; last, with the GPU to itself)
    timeout 100 $py -m experiments.perf.large --ceiling --start 2.5e8 --bisect 1 --timeout 45 \
      2>&1 | tee "$out/ceiling.txt"
    ;;
  suite)
    export XLA_PYTHON_CLIENT_PREALLOCATE=false  # several processes share the GPU
    stamp "tests and suites in parallel"
    (timeout 200 $py -m pytest -n 10 -q -rfs -p no:cacheprovider > "$out/pytest.txt" 2>&1
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
    # rows, summaries and figures as one file (a device session returns few files)
    tar czf "$out/suite_outputs.tgz" -C "$out" work && rm -rf "$out/work"
    ;;
  *)
    echo "unknown phase $phase (perf, suite, ceiling or trial)" >&2
    exit 2
    ;;
esac
stamp done
