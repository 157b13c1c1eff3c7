#!/usr/bin/env bash
# The prepared GPU run: two commands of at most 10 minutes each on one H100/H200,
# on an image as it is (python3, a CUDA torch, Triton and torch_geometric; no
# torch-scatter, no torch-cluster, no network, nothing installed).
#
#     bash benchmarks/run_gpu.sh warmup      # command 1: warm-up, tests, conv benchmarks
#     bash benchmarks/run_gpu.sh measure     # command 2: training, epoch, DDP, determinism
#     bash benchmarks/run_gpu.sh --dry-run   # the plan of both (no GPU needed)
#     bash benchmarks/run_gpu.sh all         # both, one after the other
#
# Each phase is one command: its steps run under `timeout` (the limit in seconds
# is listed with each), inside the phase's deadline (WARMUP_BUDGET_S, default
# 420 s; MEASURE_BUDGET_S, default 420 s) that cuts the last steps short if
# earlier ones overran; then benchmarks/gpu_report.py (at most 15 s) judges what
# the folder holds. Both phases write into the same folder ($OUT, else
# benchmarks/out/gpu); a phase's report marks what it did not run "unmeasured",
# and `python3 benchmarks/gpu_report.py FOLDER1 FOLDER2` joins the two phases'
# folders when they came back separately. Every step writes JSON, steps.tsv
# records each step's phase, exit status and seconds, summary.md/summary.json
# hold the verdicts. What each verdict means: benchmarks/README.md, section "GPU".
#
# Each phase starts with the warm-up step (benchmarks/gpu_warmup.py): one
# forward+backward of every configuration the timed steps run, at tiny sizes,
# which compiles every Triton kernel variant they launch into the caches below
# before anything is timed (a second phase on the same machine finds them
# there; on a fresh machine it compiles them again). The test steps launch
# test-only variants (tiny graphs, int32 indices, half precision) and compile
# them themselves: their limits are sized for a cold cache (the Triton tests
# compile about 64 variants of 0.4-1.8 s each), as are the compiled training
# steps' (an inductor graph per block). No step stops at the first failure
# (no -x): every test runs and reports.
#
# Two commands of 420 s and the machine's start fit in a 15-minute lease: run
# them back to back (a machine stays warm for 30 s after a command).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
cache=${QSV_GPU_CACHE:-/tmp/qsv-gpu-cache}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$cache/triton}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$cache/inductor}

DRY=0
phases=()
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY=1 ;;
        warmup|measure) phases+=("$arg") ;;
        all) phases+=(warmup measure) ;;
        *) echo "usage: bash benchmarks/run_gpu.sh [warmup|measure|all] [--dry-run]" >&2
           exit 2 ;;
    esac
done
if (( ${#phases[@]} == 0 )); then
    if (( DRY )); then
        phases=(warmup measure)
    else
        echo "usage: bash benchmarks/run_gpu.sh [warmup|measure|all] [--dry-run]" >&2
        exit 2
    fi
fi

out=${OUT:-benchmarks/out/gpu}
py=${PYTHON:-python3}

# step NAME LIMIT_S COMMAND...: run COMMAND under `timeout`, log to $out/NAME.log and
# append "NAME rc seconds limit phase" to steps.tsv (rc 124: the limit was reached).
step() {
    local name=$1 limit=$2
    shift 2
    if (( DRY )); then
        printf 'step %s %ss:' "$name" "$limit"
        printf ' %q' "$@"
        printf '\n'
        return 0
    fi
    local left=$(( total - (SECONDS - start) ))
    (( limit > left )) && limit=$left
    if (( limit < 5 )); then
        echo "=== $name: skipped (the phase's ${total} s are used up)"
        printf '%s\t124\t0\t%s\t%s\n' "$name" "$limit" "$phase" >> "$out/steps.tsv"
        return 0
    fi
    echo "=== $name (limit ${limit} s): $*"
    local t0=$SECONDS
    timeout --kill-after=3 "$limit" "$@" 2>&1 | tee "$out/$name.log"
    local rc=${PIPESTATUS[0]}
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( SECONDS - t0 ))" "$limit" "$phase" \
        >> "$out/steps.tsv"
    echo "=== $name: exit $rc after $(( SECONDS - t0 )) s"
}

conv=(benchmarks/bench_conv.py --device cuda --graphs knn random --sizes 16384 65536
      --ks 8 16 --layers qsv qsv-composed qsv-field gat transformer --repeats 5
      --min-time 0.05)
# Most informative first: a run cut short by its limit keeps the models it finished
# (the same list and batch as benchmarks/gpu_warmup.py's TRAIN_MODELS/TRAIN_BATCH).
models=(qsv attention-gat attention-transformer resnet20 lattice attention-gatv2)
train=(benchmarks/bench_train.py --device cuda --batch-size 128 --no-stages --repeats 10
       --warmup 3)
# Compiled: the paper model, one attention control and the CNN. Inductor compiles a
# graph per block shape (tens of seconds a model on a cold cache): all six would
# not fit in a step; the report judges the models a step measured.
compiled_models=(qsv attention-gat resnet20)

phase_warmup() {
    step gpu-info 10 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv \
        --filename="$out/gpu.txt"
    step warmup 120 "$py" benchmarks/gpu_warmup.py --device cuda --out "$out/warmup.json"
    step conv-fp32 40 "$py" "${conv[@]}" --amp none --out "$out/conv-fp32.json"
    step conv-bf16 40 "$py" "${conv[@]}" --amp bf16 --out "$out/conv-bf16.json"
    step cuda-tests 90 "$py" -m pytest -q -m cuda -p no:cacheprovider tests
    step triton-tests 120 "$py" -m pytest -q -p no:cacheprovider tests/test_triton_kernel.py
}

phase_measure() {
    step warmup-again 50 "$py" benchmarks/gpu_warmup.py --device cuda \
        --out "$out/warmup-again.json"
    step train-eager-fp32 30 "$py" "${train[@]}" --models "${models[@]}" --amp none \
        --out "$out/train-eager-fp32.json"
    step epoch-paper-qsv 60 "$py" benchmarks/bench_cli_epoch.py --preset paper-qsv \
        --device cuda --epochs 2 --budget-minutes 0.7 --timeout 55 \
        --out "$out/epoch-paper-qsv.json"
    step train-eager-bf16 30 "$py" "${train[@]}" --models "${models[@]}" --amp bf16 \
        --out "$out/train-eager-bf16.json"
    step train-compiled-fp32 90 "$py" "${train[@]}" --models "${compiled_models[@]}" \
        --amp none --compile --out "$out/train-compiled-fp32.json"
    step train-compiled-bf16 90 "$py" "${train[@]}" --models "${compiled_models[@]}" \
        --amp bf16 --compile --out "$out/train-compiled-bf16.json"
    step determinism 40 "$py" benchmarks/check_determinism.py --device cuda \
        --mode deterministic --models qsv attention-gat resnet20 --out "$out/determinism.json"
    step ddp-smoke 30 "$py" -m torch.distributed.run --standalone --nproc_per_node=1 \
        benchmarks/ddp_smoke.py --device cuda --out "$out/ddp.json"
}

for phase in "${phases[@]}"; do
    if [[ $phase == warmup ]]; then total=${WARMUP_BUDGET_S:-420}; else
        total=${MEASURE_BUDGET_S:-420}; fi
    start=$SECONDS
    if (( DRY )); then
        printf 'phase %s %ss\n' "$phase" "$total"
    else
        mkdir -p "$out"
        [[ -f $out/steps.tsv ]] || printf 'step\trc\tseconds\tlimit\tphase\n' > "$out/steps.tsv"
    fi
    "phase_$phase"
    if (( DRY )); then
        printf 'step report 15s: %q benchmarks/gpu_report.py %q\n' "$py" "$out"
    else
        timeout 15 "$py" benchmarks/gpu_report.py "$out"
        echo "phase $phase: results in $out ($(( SECONDS - start )) s)"
    fi
done
