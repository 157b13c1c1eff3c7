#!/usr/bin/env bash
# One short GPU measurement (< 5 minutes on an H100/H200): both benchmarks plus a
# timed synthetic CIFAR-sized training epoch of the QSV model, all written as JSON
# to ${OUT:-benchmarks/out}. Usage, from a checkout (no install needed: it needs torch,
# torch_geometric, tqdm and matplotlib; torch-cluster and geoopt are optional — kNN then
# falls back to exact brute force and the field optimiser to projected AdamW):
#     bash benchmarks/run_gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
out=${OUT:-benchmarks/out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python benchmarks/bench_conv.py --device cuda --graphs knn random --sizes 4096 16384 65536 --ks 16 \
    --repeats 20 --min-time 0.2 --out "$out/bench_conv_gpu.json" --plot "$out/bench_conv_gpu.png"
python benchmarks/bench_train.py --device cuda --batch-size 256 --amp bf16 \
    --repeats 20 --out "$out/bench_train_gpu_bf16.json"
python benchmarks/bench_train.py --device cuda --batch-size 256 --amp none --no-stages \
    --repeats 20 --out "$out/bench_train_gpu_fp32.json"
python benchmarks/bench_epoch.py --device cuda --batch-size 256 --amp bf16 \
    --out "$out/bench_epoch_gpu.json"
