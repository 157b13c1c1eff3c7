#!/usr/bin/env bash
# The recorded CPU benchmark set (about 15 minutes on 2 cores; run on an idle machine).
# Writes JSON and figures to ${OUT:-benchmarks/results/$(date +%F)-cpu}; then
#     python benchmarks/summarize.py $OUT/*.json
# prints the tables that go into benchmarks/README.md.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-benchmarks/results/$(date +%F)-cpu}
mkdir -p "$out"
python benchmarks/bench_conv.py --sizes 1024 4096 16384 65536 --ks 8 16 32 --repeats 5 \
    --min-time 0.3 --out "$out/bench_conv_cpu.json" --plot "$out/bench_conv_cpu.png"
python benchmarks/bench_aggregation.py --sizes 4096 16384 --out "$out/bench_aggregation_cpu.json"
python benchmarks/bench_train.py --batch-size 64 --out "$out/bench_train_cpu.json"
python benchmarks/bench_train.py --models qsv attention-gat attention-transformer \
    --batch-size 64 --compile --no-stages --out "$out/bench_train_cpu_compile.json"
