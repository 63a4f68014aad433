#!/usr/bin/env bash
# The checks only a GPU can make (benchmarks/README.md gives their goals and figures), each step under its own time limit (about
# 15 minutes together, more than one device call's 10: split them with ONLY=), everything it prints
# appended to $OUT/gpu.log, the profile picture of a GPU run written to $OUT/gpu-profile.html. Run from
# the repository root on a machine with torch (CUDA), lightning, transformers and accelerate installed:
#   OUT=gpu-out bash benchmarks/gpu_checks.sh
# ONLY=name,name runs just those checks (a check's name is the word after "check" below).
set -u
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
LOG=$OUT/gpu.log
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=offline
PY=${PYTHON:-python3}

check() {  # check NAME SECONDS COMMAND...: one step, its output in the log, its exit status after it
    local name=$1 limit=$2
    shift 2
    if [ -n "${ONLY:-}" ] && [[ ",$ONLY," != *",$name,"* ]]; then return 0; fi
    local start=$SECONDS
    echo "===== $name (limit ${limit}s): $*" | tee -a "$LOG"
    timeout -k 5 "$limit" "$@" 2>&1 | grep -v "Tip:\|litlogger\|TPU available\|HPU available" | tee -a "$LOG"
    echo "===== $name: exit ${PIPESTATUS[0]} after $((SECONDS - start))s" | tee -a "$LOG"
}

check environment 20 bash -c "nvidia-smi -L; nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv;
  $PY -c 'import torch, lightning, transformers, accelerate; print(torch.__version__, torch.version.cuda,
  torch.cuda.get_device_name(), lightning.__version__, transformers.__version__, accelerate.__version__)'"
check cuda-tests 60 "$PY" -m pytest -q -p no:cacheprovider -rs tests/timing/test_clock.py \
    tests/timing/test_phase_memory.py tests/communication/test_recorder.py tests/test_peaks.py \
    tests/timing/test_kernel_clock.py
# the module tree against an unhooked run's kernels, the device's idle share (GPU-bound and launch-bound)
check module-kernels 150 "$PY" benchmarks/module_kernels.py --cases gpt2-124m-8x1024,gpt2-124m-2x128,mlp
# the real traces the CPU tests read (tests/timing/kernel_traces), one archive back
check kernel-traces 60 bash -c "$PY benchmarks/module_kernels.py --record $OUT/kernel_traces &&
  tar -czf $OUT/kernel_traces.tar.gz -C $OUT kernel_traces && rm -r $OUT/kernel_traces"
# the CPU's gloo goal on a machine with more cores than ranks x threads (the shared CI machine has 2):
# whether the 2-core machine's spread is the machine's (benchmarks/README.md, "Exposed communication"), against
# the training step's own sync - no_sync (the outside steps' beside it)
check comm-truth-gloo-cores 300 "$PY" benchmarks/comm_truth.py --frameworks lightning,hf --repeats 2 --pairs 50
check window-and-mfu 120 "$PY" benchmarks/gpu_window.py --repeats 2
check timing-truth-124m 70 "$PY" benchmarks/timing_truth.py --device cuda --bf16 --cases gpt2-124m --repeats 3
check timing-truth-small 40 "$PY" benchmarks/timing_truth.py --device cuda --bf16 --cases gpt2-small,mlp --repeats 1
check step-profiler-truth 45 "$PY" benchmarks/step_profiler_truth.py --device cuda
# joules per step from the window against NVML's counter read by the loop around the same clean steps, and
# the mean power against the GPU's limit (needs nvidia-ml-py: the energy extra; exit 2 says what is missing)
check energy 40 "$PY" benchmarks/energy_truth.py --device cuda
check generation-truth 45 "$PY" benchmarks/generation_truth.py --device cuda --bf16 --models gpt2,gpt2-124m --repeats 3
check comm-truth-nccl 90 "$PY" benchmarks/comm_truth.py --device cuda --frameworks loop --pairs 50
# what a fresh process's first profile times that its second does not (0.130 against 0.104 s on one H100)
check first-profile 30 bash -c "$PY benchmarks/first_profile.py; $PY benchmarks/first_profile.py --calls"
check picture 25 "$PY" benchmarks/picture_screenshot.py --device cuda --html "$OUT/gpu-profile.html" --no-shot
# the whole suite last, in parallel (pytest-xdist and pytest-timeout, where installed): what it reaches in
# its time, each test named as it ends (tools absent there fail or skip)
if "$PY" -c "import xdist, pytest_timeout" 2>/dev/null; then
    check whole-suite 100 "$PY" -m pytest -p no:cacheprovider -v --tb=line -n 14 --timeout 80 tests
fi
