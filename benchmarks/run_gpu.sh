#!/usr/bin/env bash
# The prepared command for the first GPU session: ≤ 8 minutes on one H100/H200.
#
#     bash benchmarks/run_gpu.sh             # OUT=<folder> to choose where results go
#     bash benchmarks/run_gpu.sh --dry-run   # list every step (no GPU needed)
#
# Steps, each under `timeout` (its limit in seconds is listed with it; a global
# deadline of GPU_BUDGET_S, default 450 s, cuts the last ones short if earlier ones
# ran long): the CUDA tests (pytest -m cuda) and the Triton kernel tests on the GPU;
# QSVConv against GATConv and TransformerConv on kNN and random graphs (N = 16k and
# 64k), fp32 and bf16; training throughput of every model, eager and compiled, fp32
# and bf16; a timed CIFAR-10 epoch of paper-qsv through the real training command
# (CIFAR-10 from $QSV_DATA_DIR if it is there, else synthetic images of the same
# size); a 2-step DDP smoke test with NCCL; two runs in deterministic mode compared
# bit for bit. Every step writes JSON under the output folder, steps.tsv records
# each step's exit status and seconds, and benchmarks/gpu_report.py prints the
# verdicts as one table (summary.md, summary.json). What each verdict means:
# benchmarks/README.md, section "GPU".
#
# Needs torch (CUDA), torch_geometric, tqdm, numpy; torch-cluster, geoopt and triton
# are optional (kNN then uses exact brute force on the GPU, the field optimiser
# projected AdamW, the QSV operator its PyTorch path).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

DRY=0
case "${1:-}" in
    --dry-run) DRY=1 ;;
    "") ;;
    *) echo "usage: bash benchmarks/run_gpu.sh [--dry-run]" >&2; exit 2 ;;
esac

out=${OUT:-benchmarks/out/gpu-$(date +%Y%m%d-%H%M%S)}
py=${PYTHON:-python}
total=${GPU_BUDGET_S:-450}  # seconds for all steps (the report adds at most 15)
start=$SECONDS
if (( ! DRY )); then
    mkdir -p "$out"
    printf 'step\trc\tseconds\tlimit\n' > "$out/steps.tsv"
fi

# step NAME LIMIT_S COMMAND...: run COMMAND under `timeout`, log to $out/NAME.log and
# append "NAME rc seconds limit" to steps.tsv (rc 124: the limit was reached).
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
        echo "=== $name: skipped (the ${total} s budget is used up)"
        printf '%s\t124\t0\t%s\n' "$name" "$limit" >> "$out/steps.tsv"
        return 0
    fi
    echo "=== $name (limit ${limit} s): $*"
    local t0=$SECONDS
    timeout --kill-after=3 "$limit" "$@" 2>&1 | tee "$out/$name.log"
    local rc=${PIPESTATUS[0]}
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( SECONDS - t0 ))" "$limit" >> "$out/steps.tsv"
    echo "=== $name: exit $rc after $(( SECONDS - t0 )) s"
}

conv=(benchmarks/bench_conv.py --device cuda --graphs knn random --sizes 16384 65536
      --ks 8 16 32 --layers qsv qsv-field gat transformer --repeats 5 --min-time 0.05)
# Most informative first: a run cut short by its limit keeps the models it finished.
models=(qsv attention-gat attention-transformer resnet20 lattice attention-gatv2)
train=(benchmarks/bench_train.py --device cuda --batch-size 128 --no-stages --repeats 10
       --warmup 3 --models "${models[@]}")

step gpu-info 10 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv \
    --filename="$out/gpu.txt"
step cuda-tests 50 "$py" -m pytest -q -x -m cuda -p no:cacheprovider tests
if [[ -f tests/test_triton_kernel.py ]]; then
    step triton-tests 30 "$py" -m pytest -q -x -p no:cacheprovider tests/test_triton_kernel.py
fi
step conv-fp32 45 "$py" "${conv[@]}" --amp none --out "$out/conv-fp32.json"
step conv-bf16 45 "$py" "${conv[@]}" --amp bf16 --out "$out/conv-bf16.json"
step train-eager-fp32 30 "$py" "${train[@]}" --amp none --out "$out/train-eager-fp32.json"
step train-eager-bf16 30 "$py" "${train[@]}" --amp bf16 --out "$out/train-eager-bf16.json"
step train-compiled-fp32 45 "$py" "${train[@]}" --amp none --compile \
    --out "$out/train-compiled-fp32.json"
step train-compiled-bf16 45 "$py" "${train[@]}" --amp bf16 --compile \
    --out "$out/train-compiled-bf16.json"
step epoch-paper-qsv 60 "$py" benchmarks/bench_cli_epoch.py --preset paper-qsv --device cuda \
    --epochs 2 --budget-minutes 0.7 --timeout 55 --out "$out/epoch-paper-qsv.json"
step ddp-smoke 30 "$py" -m torch.distributed.run --standalone --nproc_per_node=1 \
    benchmarks/ddp_smoke.py --device cuda --out "$out/ddp.json"
step determinism 30 "$py" benchmarks/check_determinism.py --device cuda --mode deterministic \
    --models qsv attention-gat resnet20 --out "$out/determinism.json"

if (( DRY )); then
    printf 'step report 15s: %q benchmarks/gpu_report.py %q\n' "$py" "$out"
    exit 0
fi
timeout 15 "$py" benchmarks/gpu_report.py "$out"
echo "results in $out ($(( SECONDS - start )) s)"
