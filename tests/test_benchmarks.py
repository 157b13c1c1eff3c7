"""Smoke tests of the benchmark scripts: tiny sizes, no timing assertions."""
import json
import os
import sys

import pytest
import torch

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)

import bench_conv  # noqa: E402
import common  # noqa: E402
import summarize  # noqa: E402


def test_interleaved_timing_runs_round_robin():
    order = []
    fns = {"a": lambda: order.append("a"), "b": lambda: order.append("b")}
    times = common.interleaved_median_times(fns, torch.device("cpu"), repeats=3, warmup=1,
                                            inner=2)
    assert set(times) == {"a", "b"} and all(t >= 0 for t in times.values())
    assert order[:2] == ["a", "b"]  # one warm-up call each
    assert order[2:] == ["a", "a", "b", "b"] * 3


def test_bench_conv_writes_every_layer_and_summarizes(tmp_path, capsys):
    out = tmp_path / "conv.json"
    payload = bench_conv.main(["--sizes", "64", "128", "--ks", "4", "--repeats", "1",
                               "--min-time", "0", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["results"] == json.loads(json.dumps(payload["results"]))
    for row in saved["results"]:
        assert set(row["layers"]) == set(bench_conv.LAYERS)
        for res in row["layers"].values():
            assert res["forward_ms"] > 0 and res["fwd_bwd_ms"] > 0 and res["saved_mib"] >= 0
    text = summarize.conv_tables(saved)
    assert "QSVConv (qsv) ≤ 0.8× gat" in text and "QSVConv (qsv-field) ≤ 0.5× transformer" in text
    assert "qsv-field linear in N·k (k = 4)" in text


def test_bench_conv_rejects_unknown_layer():
    with pytest.raises(ValueError, match="unknown layer"):
        bench_conv.make_layer("nope", 16, 4)
