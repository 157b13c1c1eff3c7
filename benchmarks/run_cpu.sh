#!/usr/bin/env bash
# The recorded CPU benchmark set (about 15 minutes on 2 cores; run on an idle machine).
# Writes JSON and figures to ${OUT:-benchmarks/results/$(date +%F)-cpu}; then
#     python benchmarks/summarize.py $OUT/*.json
# prints the tables and target verdicts that go into benchmarks/README.md.
# The spherical peer needs `pip install --no-deps torch-harmonics` (skipped without it).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-benchmarks/results/$(date +%F)-cpu}
mkdir -p "$out"
conv="python benchmarks/bench_conv.py --layers qsv qsv-field gat transformer spmm"
# kNN and random variable-degree graphs: N x average degree, 4 heads of 16 channels.
$conv --graphs knn random --sizes 1024 4096 16384 65536 --ks 8 16 32 --repeats 3 \
    --min-time 0.2 --out "$out/bench_conv_cpu.json" --plot "$out/bench_conv_cpu.png"
# More heads: 8 of 16 channels, and 16 of 4 channels (the paper's setting).
$conv --graphs knn random --sizes 1024 4096 --ks 8 16 32 --channels 128 --heads 8 \
    --repeats 3 --min-time 0.2 --out "$out/bench_conv_h8_cpu.json"
$conv --graphs knn random --sizes 1024 4096 --ks 8 16 32 --channels 64 --heads 16 \
    --repeats 3 --min-time 0.2 --out "$out/bench_conv_h16_cpu.json"
# torch-harmonics' NeighborhoodAttentionS2 on its 32 x 64 grid (2048 points).
$conv --graphs s2 --s2-nlat 32 --s2-cutoffs 0.1 0.16 --channels 128 --heads 8 \
    --repeats 3 --min-time 0.2 --out "$out/bench_conv_s2_cpu.json"
python benchmarks/bench_train.py --batch-size 64 --out "$out/bench_train_cpu.json"
# Cora: every examples/citation.py row's training step beside GATConv's (needs ../shared/data).
python benchmarks/bench_cora.py --out "$out/bench_cora.json"
# TU: every examples/tu_graphs.py row's training epoch beside GAT's, on the five sets.
python benchmarks/bench_tu.py --out "$out/bench_tu.json"
python benchmarks/bench_train.py --models qsv attention-gat attention-transformer \
    --batch-size 64 --compile --no-stages --out "$out/bench_train_cpu_compile.json"
