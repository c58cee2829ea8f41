#!/usr/bin/env bash
# The GPU machine's driver: install the carried wheels, then run the named steps, each under its own
# timeout, logging under $OUT. Run from the repository root, where .whl/ holds the wheels (diffusers,
# importlib_metadata, torchao, nvidia-cudnn-frontend, einops, sageattention, fa3_fwd, fx_fp8's own).
#
#   benchmarks/gpu_run.sh [STEP ...]      (default: env quick)
#
# The next GPU run (one call, ~8.5 min from a started machine; estimates, not measured):
#   benchmarks/gpu_run.sh env pytest attention wan
#   env ~10 s, wheels ~10 s, pytest -m cuda ~90 s, attention ~120 s, wan <= 300 s
#
# steps (seconds of timeout; override with e.g. QUICK_TIMEOUT=400):
#   env        nvidia-smi, versions, what is installed (60)
#   quick      benchmarks/cuda_bench.py --quick: linears, conditioning linears, attention (QUICK_TIMEOUT, 320)
#   flux       benchmarks/cuda_bench.py --flux: full-depth Flux-dev (FLUX_TIMEOUT, 320)
#   pytest     python -m pytest -m cuda -q <repo>/tests (PYTEST_TIMEOUT, 300); its junit report becomes
#              $OUT/gpu_record.csv (benchmarks/gpu_record.py add: the record with this run merged)
#   attention  benchmarks/attention_kernels.py --quick (ATTENTION_TIMEOUT, 300): every kernel candidate, the
#              m64n128 tile, the Gluon kernel, the pre-pass with wide / 32-row steps, at 4608-32768 keys
#   wan        benchmarks/cuda_bench.py --wan: Wan2.1 1.3B and 14B shapes at 480p (WAN_TIMEOUT, 320;
#              its --budget, 280 s, skips the variants that would not finish and says so)
#   w8a16      benchmarks/w8a16_forms.py: the weight-only kernel's forms on the conditioning linears (W8A16_TIMEOUT, 180)
#   tune       benchmarks/tune_run.py: fx_fp8.tune on Flux-dev's and Wan-14B's shapes, tables in $OUT/tune (TUNE_TIMEOUT, 300)
# Each step logs to $OUT/<step>.log; $OUT/gpu_run.log gets the environment and one line per step
# (exit status, seconds); the benchmarks append their dated sections to $OUT/RESULTS.md.
# PYTEST_ARGS adds arguments to pytest (e.g. "-n 4" with pytest-xdist among the wheels),
# BENCH_ARGS adds arguments to cuda_bench.py (e.g. "--budget 250"; "--dry-run" checks this driver on CPU),
# ATTENTION_ARGS to attention_kernels.py, TUNE_ARGS to tune_run.py (e.g. "--only flux").
# Exit status: the first failing step's (124: its timeout), 0 when all passed.
set -u

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${OUT:-/tmp/fx_fp8_gpu_out}
SITE=${SITE:-/tmp/site}
WORK=${WORK:-/tmp/fx_fp8_gpu_run}   # cwd for every step: not the repository, whose fx_fp8/ would shadow the wheel
PYTHON=${PYTHON:-$(command -v python3 || command -v python)}
mkdir -p "$OUT" "$WORK"
export PYTHON REPO   # the env step runs in its own bash
OUT=$(cd "$OUT" && pwd)   # the steps run in $WORK
LOG=$OUT/gpu_run.log
STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(env quick)

for step in "${STEPS[@]}"; do
  case $step in env|quick|flux|pytest|attention|w8a16|wan|tune) ;;
    *) echo "gpu_run.sh: unknown step '$step' (expected env, quick, flux, pytest, attention, w8a16, wan, tune)" >&2; exit 2 ;;
  esac
done

note() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$LOG"; }

install() {
  shopt -s nullglob
  local wheels=("$REPO"/.whl/*.whl)
  shopt -u nullglob
  if [ ${#wheels[@]} -eq 0 ]; then
    note "no wheels in $REPO/.whl: nothing to install"
    return 1
  fi
  # the wheels' checksums: a warm machine keeps $SITE, and a rebuilt fx_fp8 wheel must replace the old one
  local signature
  signature=$(cd "$REPO/.whl" && md5sum -- *.whl)
  if [ -f "$SITE/.installed" ] && [ "$(cat "$SITE/.installed")" = "$signature" ]; then
    note "the same wheels are already installed in $SITE"
    return 0
  fi
  local t0=$SECONDS
  rm -rf "$SITE"   # pip install --target does not replace what is there
  if ! ls "$REPO"/.whl/ | grep -qi '^fx_fp8'; then
    note "no fx_fp8 wheel in .whl: building one from $REPO"
    "$PYTHON" -m pip wheel -q --no-deps --no-build-isolation -w "$WORK/wheel" "$REPO" >>"$LOG" 2>&1 \
      && wheels+=("$WORK"/wheel/fx_fp8*.whl)
  fi
  "$PYTHON" -m pip install -q --no-index --no-deps --target "$SITE" "${wheels[@]}" >>"$LOG" 2>&1 || {
    note "pip install into $SITE failed (see above)"; return 1; }
  echo "$signature" >"$SITE/.installed"
  note "installed ${#wheels[@]} wheels into $SITE in $((SECONDS - t0)) s: $(cd "$REPO/.whl" && ls | tr '\n' ' ')"
}

environment() {
  nvidia-smi || true
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv || true
  "$PYTHON" - <<'EOF'
import importlib, os, platform
import torch
print("python", platform.python_version(), "| torch", torch.__version__, "| CUDA", torch.version.cuda,
      "| cuDNN", torch.backends.cudnn.version(), "| GPU", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
for name in ("triton", "torchao", "diffusers", "transformers", "accelerate", "peft", "cudnn", "einops",
             "sageattention", "flash_attn_interface", "fx_fp8"):
    try:
        m = importlib.import_module(name)
        print(f"{name}: {getattr(m, '__version__', '?')} from {os.path.dirname(m.__file__ or '?')}")
    except Exception as e:
        print(f"{name}: not importable ({type(e).__name__}: {str(e)[:120]})")
EOF
  git -C "$REPO" log -1 --format='repository commit: %h %s' 2>/dev/null || true
}

record_gpu_run() {   # the GPU record from pytest's junit report: $OUT/gpu_record.csv, to copy over benchmarks/'s
  [ -f "$OUT/pytest-junit.xml" ] || { note "no junit report: the GPU record is not updated"; return 0; }
  local gpu torch
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  torch=$(cd "$WORK" && "$PYTHON" -c 'import torch; print(torch.__version__)' 2>/dev/null)
  "$PYTHON" "$REPO/benchmarks/gpu_record.py" add "$OUT/pytest-junit.xml" --gpu "${gpu:-unknown GPU}" \
    --torch "${torch:-unknown}" --source "gpu_run.sh pytest, junit $(date +%Y-%m-%dT%H:%M)" \
    --record "$REPO/benchmarks/gpu_record.csv" --out "$OUT/gpu_record.csv" 2>&1 | tee -a "$LOG"
}

run_step() {
  local step=$1 limit cmd
  case $step in
    env)       limit=60;                        cmd=(environment) ;;
    quick)     limit=${QUICK_TIMEOUT:-320};     cmd=("$PYTHON" "$REPO/benchmarks/cuda_bench.py" --quick --out "$OUT/RESULTS.md" ${BENCH_ARGS:-}) ;;
    flux)      limit=${FLUX_TIMEOUT:-320};      cmd=("$PYTHON" "$REPO/benchmarks/cuda_bench.py" --flux --out "$OUT/RESULTS.md" ${BENCH_ARGS:-}) ;;
    pytest)    limit=${PYTEST_TIMEOUT:-300};    cmd=("$PYTHON" -m pytest -m cuda -q -p no:cacheprovider --junitxml "$OUT/pytest-junit.xml" ${PYTEST_ARGS:-} "$REPO/tests") ;;
    attention) limit=${ATTENTION_TIMEOUT:-300}; cmd=("$PYTHON" "$REPO/benchmarks/attention_kernels.py" --quick ${ATTENTION_ARGS:-}) ;;
    w8a16)     limit=${W8A16_TIMEOUT:-180};     cmd=("$PYTHON" "$REPO/benchmarks/w8a16_forms.py" --out "$OUT/RESULTS.md") ;;
    tune)      limit=${TUNE_TIMEOUT:-300};      cmd=(env FX_FP8_TUNE_DIR="$OUT/tune" "$PYTHON" "$REPO/benchmarks/tune_run.py" --out-dir "$OUT/tune" --results "$OUT/RESULTS.md" ${TUNE_ARGS:-}) ;;
    wan)       limit=${WAN_TIMEOUT:-320};       cmd=("$PYTHON" "$REPO/benchmarks/cuda_bench.py" --wan --out "$OUT/RESULTS.md" ${BENCH_ARGS:-}) ;;
  esac
  if [ "$step" = attention ] && [ ! -f "$REPO/benchmarks/attention_kernels.py" ]; then
    note "step attention: benchmarks/attention_kernels.py is not in this checkout"; return 2
  fi
  note "step $step: ${cmd[*]} (timeout $limit s)"
  local t0=$SECONDS rc
  if [ "$step" = env ]; then
    (cd "$WORK" && timeout -k 5 "$limit" bash -c "$(declare -f environment); environment") >"$OUT/env.log" 2>&1; rc=$?
    cat "$OUT/env.log" >>"$LOG"
  else
    (cd "$WORK" && timeout -k 15 "$limit" "${cmd[@]}") >"$OUT/$step.log" 2>&1; rc=$?
  fi
  note "step $step: exit $rc in $((SECONDS - t0)) s$([ $rc -eq 124 ] && echo ' (timed out)'), log $OUT/$step.log"
  [ "$step" = pytest ] && record_gpu_run
  tail -n 5 "$OUT/$step.log" 2>/dev/null | sed 's/^/    /' | tee -a "$LOG" >/dev/null
  return $rc
}

note "gpu_run.sh ${STEPS[*]}: repository $REPO, output $OUT"
note "GPU: $(nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,utilization.gpu --format=csv,noheader 2>&1 | head -3)"
install || exit 1
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
status=0
for step in "${STEPS[@]}"; do
  run_step "$step" || { rc=$?; [ $status -eq 0 ] && status=$rc; }
done
note "done: exit $status"
exit $status
