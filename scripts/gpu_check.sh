#!/usr/bin/env bash
# scripts/gpu_check.sh: shardwise's GPU checks on one lent GPU, within 9 minutes (docs/development.md#how-shardwise-is-tested, C35).
#
# What it does, in this order (each check has a time budget; one that overruns is stopped,
# its line says TIMEOUT, and the next one starts; time a check does not use goes to the
# ones after it):
#   tests    python3 -m pytest tests/gpu (4 workers with xdist; JUnit report)   115 s
#   train    the main job, `shardwise train --nproc 1`, against its first steps   55 s
#            on this machine's CPU and a stored CPU curve (benchmarks/gpu/train_job.py)
#   speed    GPT MFU at the largest size that fits (formulas, not trials):      165 s
#            ZeRO stage 0 and 3, eager and compiled, and plain PyTorch
#            (benchmarks/gpu/gpt_speed.py, sizes from benchmarks/gpu/gpt_sizes.py)
#   kernels  flex block-sparse attention vs dense at 8k, compiled block vs       50 s
#            eager, fused operators (benchmarks/gpu/kernels.py)
#   optim    LAMB and 8-bit AdamW on their Triton kernels vs fused AdamW, their   30 s
#            torch path, bitsandbytes and apex where installed (benchmarks/gpu/optimizers.py)
#   memory   CUDA peak and fragmentation per recomputation policy, with and      25 s
#            without the contiguous checkpoint buffer (benchmarks/gpu/recompute_memory.py)
#   offload  the largest GPT with the optimizer on the CPU, then on NVMe with    85 s
#            the parameters, vs the speed check's run (benchmarks/gpu/offload_scale.py)
# and prints one line per check, `PASS|FAIL|SKIP|TIMEOUT check: key numbers (s of budget)`.
# Each benchmark is usable alone (`python3 benchmarks/gpu/NAME.py --help`) and prints
# one JSON line of results.
#
# Results, in $OUT (at most 8 files come back from the device machine; 4 are written):
#   summary.txt          the summary lines
#   results.json         every check's JSON result, the environment
#   gpu_check.log        environment, then every check's output (long ones cut to their ends)
#   artifacts.tar.gz     per-check logs and JSON, the JUnit report, the main job's run
#                        directory (metrics, plots, summary; no checkpoint)
#
# The GPU machine: python3 (3.12) with CUDA torch 2.11, transformers 5.17, no network.
# shardwise's pure-Python needs it lacks are carried as wheels in the git-ignored .whl/
# folder of the checkout that the device tool sends (the session's own checkout), fetched
# beforehand on a machine with PyPI, from the repository root:
#
#   grep -v '^#' scripts/gpu_wheels.txt | xargs python3 -m pip download --no-deps \
#       --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
#       --platform manylinux2014_x86_64 --platform any -d .whl
#
# This script installs them (pip --target $WORK/site, no index) when pydantic is missing,
# and runs everything from the repository with PYTHONPATH, no virtual environment.
#
# Through the device tool (one call; the script takes about 9 minutes, the machine's start
# comes on top): command `bash scripts/gpu_check.sh`, carry [".whl"], timeout_s 590. The
# first H100 run (2026-11-27) used 468 s of the old 480 and starved the checks: the tests
# took 89 s with four workers while 24 of them failed at once (passing, the offload and
# checkpoint launches run in full), the speed check's six runs need about 160 s.
# To rerun some checks with more time (e.g. the offload check alone, 4 minutes):
#   SHARDWISE_GPU_CHECKS="offload" SHARDWISE_GPU_CHECK_SECONDS=240 bash scripts/gpu_check.sh
#
# Rehearsal without a GPU (every benchmark at toy size on the CPU; minutes on 2 cores):
#   SHARDWISE_GPU_CHECK_CPU=1 OUT=/tmp/gpucheck_out bash scripts/gpu_check.sh
# Without CUDA and without SHARDWISE_GPU_CHECK_CPU=1 each check starts and says SKIP.
#
# Settings (environment):
#   OUT                          results folder (required)
#   SHARDWISE_GPU_CHECKS         checks to run, in order (default: all seven above)
#   SHARDWISE_GPU_CHECK_SECONDS  total budget (default 540; 1800 in the CPU rehearsal)
#   SHARDWISE_GPU_CHECK_CPU=1    the CPU rehearsal (--toy sizes)
#   SHARDWISE_GPU_CHECK_WORK     scratch folder (default ${TMPDIR:-/tmp}/shardwise-gpu-check);
#                                the NVMe swap files go there too
#   PYTHON                       interpreter (default python3, or .venv/bin/python when
#                                python3 has no torch)

set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 2
: "${OUT:?set OUT to the folder for the results}"
REHEARSAL=${SHARDWISE_GPU_CHECK_CPU:-0}
CHECKS=${SHARDWISE_GPU_CHECKS:-tests train speed kernels optim memory offload}
if [[ $REHEARSAL == 1 ]]; then TOTAL=${SHARDWISE_GPU_CHECK_SECONDS:-1800}; else TOTAL=${SHARDWISE_GPU_CHECK_SECONDS:-540}; fi
WORK=${SHARDWISE_GPU_CHECK_WORK:-${TMPDIR:-/tmp}/shardwise-gpu-check}
MARGIN=15  # seconds kept for the summary, the combined files and the archive
GRACE=10   # a benchmark plans to end within its budget; the hard stop comes this much later
declare -A NOMINAL=([tests]=115 [train]=55 [speed]=165 [kernels]=50 [optim]=30 [memory]=25 [offload]=85)
START=$(date +%s)
END=$((START + TOTAL - MARGIN))

mkdir -p "$OUT" "$WORK/logs"
rm -rf "$WORK"/*.json "$WORK"/tests.xml "$WORK"/logs/*.log "$WORK/runs"
SUMMARY="$OUT/summary.txt"
LOG="$OUT/gpu_check.log"
: >"$SUMMARY"
: >"$LOG"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export TORCHINDUCTOR_CACHE_DIR="$WORK/inductor"  # shared by every check: a graph compiles once

say() { echo "$*" | tee -a "$LOG"; }

for check in $CHECKS; do
    [[ -n ${NOMINAL[$check]:-} ]] || { echo "unknown check '$check' (known: ${!NOMINAL[*]})" >&2; exit 2; }
done

# -- the interpreter and shardwise's imports ------------------------------------------------
PY=${PYTHON:-python3}
if ! "$PY" -c 'import torch' 2>/dev/null && [[ -z ${PYTHON:-} && -x "$REPO/.venv/bin/python" ]]; then
    PY="$REPO/.venv/bin/python"
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c 'import pydantic' 2>/dev/null; then
    if compgen -G "$REPO/.whl/*.whl" >/dev/null; then
        say "installing the carried wheels into $WORK/site: $(cd "$REPO/.whl" && echo *.whl)"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$WORK/site" "$REPO"/.whl/*.whl 2>&1 | tee -a "$LOG"
        export PYTHONPATH="$PYTHONPATH:$WORK/site"
    else
        say "pydantic is missing and no wheels are in .whl/: fetch them as this script's header says"
    fi
fi

# -- the environment ------------------------------------------------------------------------
say "shardwise GPU check: $(git -C "$REPO" log -1 --format='%h %s' 2>/dev/null | cut -c1-100)"
say "started $(date -u '+%Y-%m-%d %H:%M:%S UTC'); budget ${TOTAL} s; checks: $CHECKS; rehearsal: $REHEARSAL"
"$PY" - "$WORK/environment.json" <<'PYTHON' 2>&1 | tee -a "$LOG"
import importlib.metadata, json, os, platform, sys
facts = {"python": sys.version.split()[0], "executable": sys.executable, "cpus": os.cpu_count(),
         "machine": platform.machine()}
for name in ("torch", "triton", "transformers", "accelerate", "peft", "pydantic", "numpy", "safetensors"):
    try:
        facts[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        facts[name] = "not installed"
try:
    import torch
    facts["cuda_available"] = torch.cuda.is_available()
    if torch.cuda.is_available():
        facts["device"] = torch.cuda.get_device_name(0)
        facts["device_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 2)
        facts["cuda"] = torch.version.cuda
except Exception as error:  # reported, not fatal: each check then says what fails
    facts["cuda_available"] = f"unknown: {type(error).__name__}: {str(error)[:160]}"
try:
    with open("/proc/meminfo") as meminfo:
        facts["host_memory_gib"] = round(int(meminfo.readline().split()[1]) / 2**20, 1)
except OSError:
    pass
try:
    import shardwise  # noqa: F401
    facts["shardwise_import"] = "ok"
except Exception as error:
    facts["shardwise_import"] = f"{type(error).__name__}: {str(error)[:200]}"
json.dump(facts, open(sys.argv[1], "w"), indent=1)
print("environment: " + ", ".join(f"{key} {value}" for key, value in facts.items()))
PYTHON
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw \
        --format=csv 2>&1 | tee -a "$LOG"
fi
CUDA=$(grep -q '"cuda_available": true' "$WORK/environment.json" 2>/dev/null && echo 1 || echo 0)
TOY=()
if [[ $REHEARSAL == 1 ]]; then TOY=(--toy --device cpu); fi

# -- one check ------------------------------------------------------------------------------
budget_for() {  # the time left, less the nominal budgets of the checks after $1
    local check=$1 later=0 seen=0 other
    for other in $CHECKS; do
        if [[ $seen == 1 ]]; then later=$((later + NOMINAL[$other])); fi
        if [[ $other == "$check" ]]; then seen=1; fi
    done
    local left=$((END - $(date +%s) - later))
    if ((left < NOMINAL[$check] / 3)); then left=$((NOMINAL[$check] / 3)); fi
    echo "$left"
}

nvme_path() {  # a folder on a disk: on tmpfs O_DIRECT fails, and the "disk" would be memory
    local candidate
    for candidate in "$WORK" "$REPO" "${HOME:-/root}"; do
        case $(stat -f -c %T "$candidate" 2>/dev/null) in
            tmpfs | ramfs | "") ;;
            *) echo "$candidate"; return ;;
        esac
    done
    echo "$WORK"
}

test_workers() {  # four pytest workers, one file each at a time, where pytest-xdist is installed:
    # the GPU is shared by their ranks (each test is small), and the files' launches overlap
    if "$PY" -c 'import xdist' 2>/dev/null; then echo "-n 4 --dist loadfile"; fi
}

command_for() {  # the check's command line, given its budget
    local check=$1 budget=$2
    case $check in
        tests)   echo "$PY -m pytest tests/gpu -q -p no:cacheprovider --timeout=150 $(test_workers) --junitxml=$WORK/tests.xml" ;;
        train)   echo "$PY benchmarks/gpu/train_job.py ${TOY[*]} --budget $budget --out-dir $WORK/runs --json-out $WORK/train.json" ;;
        speed)   echo "$PY benchmarks/gpu/gpt_speed.py ${TOY[*]} --budget $budget --json-out $WORK/speed.json" ;;
        kernels) echo "$PY benchmarks/gpu/kernels.py ${TOY[*]} --budget $budget --json-out $WORK/kernels.json" ;;
        optim)   echo "$PY benchmarks/gpu/optimizers.py ${TOY[*]} --budget $budget --json-out $WORK/optim.json" ;;
        memory)  echo "$PY benchmarks/gpu/recompute_memory.py ${TOY[*]} --budget $budget --json-out $WORK/memory.json" ;;
        offload) echo "$PY benchmarks/gpu/offload_scale.py ${TOY[*]} --budget $budget --baseline $WORK/speed.json --nvme-path $(nvme_path) --json-out $WORK/offload.json" ;;
    esac
}

run_check() {
    local check=$1 budget command started rc seconds line
    budget=$(budget_for "$check")
    command=$(command_for "$check" "$budget")
    echo "== $check: budget ${budget} s: $command" | tee -a "$WORK/logs/$check.log"
    started=$(date +%s)
    # timeout signals its whole process group: the benchmark's children stop with it
    timeout --signal=TERM --kill-after=10 $((budget + GRACE)) $command >>"$WORK/logs/$check.log" 2>&1
    rc=$?
    seconds=$(($(date +%s) - started))
    if [[ $check == tests ]]; then
        "$PY" benchmarks/gpu/summarize.py tests --junit "$WORK/tests.xml" --rc "$rc" --json-out "$WORK/tests.json"
    fi
    line=$("$PY" benchmarks/gpu/summarize.py line "$check" --rc "$rc" --seconds "$seconds" --budget "$budget" \
        --json "$WORK/$check.json" --log "$WORK/logs/$check.log")
    echo "$line" >>"$SUMMARY"
    {
        echo
        echo "== $check (exit $rc, ${seconds} s of ${budget} s) =="
        tail -c 400000 "$WORK/logs/$check.log"
    } >>"$LOG"
    echo "$line"
}

for check in $CHECKS; do
    run_check "$check"
done

# -- results --------------------------------------------------------------------------------
"$PY" benchmarks/gpu/summarize.py combine --work "$WORK" --out "$OUT/results.json" --summary "$SUMMARY" --checks $CHECKS
ARTIFACTS=(logs)
for item in tests.xml $(cd "$WORK" && ls -- *.json 2>/dev/null) runs; do
    [[ -e "$WORK/$item" ]] && ARTIFACTS+=("$item")
done
tar -czf "$OUT/artifacts.tar.gz" -C "$WORK" --exclude='checkpoint' --exclude='.cache' --exclude='*.pt' --exclude='*.safetensors' \
    "${ARTIFACTS[@]}" 2>>"$LOG"
if (($(stat -c %s "$OUT/artifacts.tar.gz") > 15 * 2**20)); then  # the device tool returns files up to 16 MiB
    SMALLER=()
    for item in "${ARTIFACTS[@]}"; do [[ $item == runs ]] || SMALLER+=("$item"); done
    tar -czf "$OUT/artifacts.tar.gz" -C "$WORK" "${SMALLER[@]}" 2>>"$LOG"
fi
{
    echo
    echo "== summary ($(($(date +%s) - START)) s; CUDA $CUDA; rehearsal $REHEARSAL) =="
    cat "$SUMMARY"
} | tee -a "$LOG"
