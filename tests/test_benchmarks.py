"""Smoke tests of the benchmark scripts: tiny sizes, no timing assertions."""
import json
import os
from pathlib import Path

import pytest
import torch

from conftest import BENCHMARKS, load_benchmark

ROOT = Path(__file__).resolve().parents[1]

BENCH = str(BENCHMARKS)
bench_conv = load_benchmark("bench_conv")
common = load_benchmark("common")
summarize = load_benchmark("summarize")


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
                               "--min-time", "0", "--graphs", "knn", "random",
                               "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["results"] == json.loads(json.dumps(payload["results"]))
    assert [r["graph"] for r in saved["results"]] == ["knn"] * 2 + ["random"] * 2
    for row in saved["results"]:
        assert set(row["layers"]) == set(bench_conv.LAYERS)
        for res in row["layers"].values():
            assert res["forward_ms"] > 0 and res["fwd_bwd_ms"] > 0 and res["saved_mib"] >= 0
    text = summarize.conv_tables(saved)
    assert "knn: QSVConv (qsv) ≤ 0.8× gat" in text
    assert "random: QSVConv (qsv-field) ≤ 0.5× transformer" in text
    assert "knn: QSVConv (qsv) ≤ 3.0× spmm" in text
    assert "qsv-field linear in N·k (knn, k = 4)" in text


def test_random_graphs_have_variable_degree_and_shuffled_edges():
    ei = bench_conv.random_graph(200, 8, torch.Generator().manual_seed(0))
    assert ei.shape == (2, 1600)
    deg = torch.bincount(ei[1], minlength=200)
    assert deg.min() < 8 < deg.max()
    assert not bool((ei[1][1:] >= ei[1][:-1]).all())


def test_spmm_floor_is_the_adjacency_product():
    ei = torch.tensor([[1, 2, 0, 2], [0, 0, 1, 2]])
    x = torch.randn(3, 5, requires_grad=True)
    ref = torch.zeros(3, 5).index_add(0, ei[1], x[ei[0]])
    out = bench_conv.SpMM(ei, 3)(x)
    torch.testing.assert_close(out, ref)
    w = torch.randn(3, 5)
    (g, ) = torch.autograd.grad((out * w).sum(), x)
    (g_ref, ) = torch.autograd.grad((ref * w).sum(), x)
    torch.testing.assert_close(g, g_ref)


def test_s2_peer_is_optional_and_timed_on_its_grid(tmp_path):
    pytest.importorskip("torch_harmonics")
    payload = bench_conv.main(["--graphs", "s2", "--s2-nlat", "8", "--s2-cutoffs", "0.5",
                               "--channels", "16", "--heads", "4", "--repeats", "1",
                               "--min-time", "0", "--out", str(tmp_path / "s2.json")])
    (row, ) = payload["results"]
    assert row["graph"] == "s2" and row["n"] == 128 and row["k"] > 0
    assert set(row["layers"]) == {"qsv", "qsv-field", "nattn-s2", "spmm"}


def test_bench_conv_rejects_unknown_layer():
    with pytest.raises(ValueError, match="unknown layer"):
        bench_conv.make_layer("nope", 16, 4)


def test_bench_conv_edge_dim_gives_edge_features_to_the_layers_that_take_them(tmp_path):
    layers = ["qsv", "gat", "transformer", "simple-sum"]
    payload = bench_conv.main(["--sizes", "64", "--ks", "4", "--repeats", "1",
                               "--min-time", "0", "--graphs", "random", "--edge-dim", "3",
                               "--layers", *layers, "--out", str(tmp_path / "c.json")])
    assert payload["args"]["edge_dim"] == 3
    assert set(payload["results"][0]["layers"]) == set(layers)
    assert "errors" not in payload["results"][0]
    conv = bench_conv.make_layer("qsv", 16, 4, edge_dim=3)
    assert conv.edge_dim == 3 and conv.lin_edge is not None
    assert bench_conv.make_layer("gat", 16, 4, edge_dim=3).lin_edge is not None
    assert bench_conv.make_layer("gat", 16, 4).lin_edge is None


def test_bench_geometric_times_qsv_geometric_against_its_gat_twin(tmp_path):
    """The GAT twin is QSVGeometric with GATConv layers (same width, heads and edge
    features; 0.7% fewer parameters at the defaults), and both train a step."""
    import numpy as np
    from torch_geometric.nn import GATConv
    bench_geometric = load_benchmark("bench_geometric")
    g = np.random.default_rng(0)
    (tmp_path / "Toy").mkdir()
    np.savez(tmp_path / "Toy" / "toy.npz", pos_train=g.normal(size=(8, 40, 3)),
             y_train=np.arange(8) % 2, pos_test=g.normal(size=(2, 40, 3)),
             y_test=np.arange(2) % 2)
    payload = bench_geometric.main(["--data-dir", str(tmp_path), "--dataset", "Toy",
                                    "--points", "24", "--batch-size", "4", "--batches", "2",
                                    "--repeats", "1", "--out", str(tmp_path / "g.json")])
    rows = {r["model"]: r for r in payload["rows"]}
    assert set(rows) == {"QSVGeometric", "GATConv in place"}
    assert rows["GATConv in place"]["ratio_to_gat"] == 1.0
    assert all(r["ms_per_step"] > 0 for r in rows.values())
    twin = bench_geometric.gat_twin(10)
    assert all(isinstance(c.conv, GATConv) and c.conv.lin_edge is not None for c in twin.convs)
    assert 0.98 < rows["GATConv in place"]["params"] / rows["QSVGeometric"]["params"] < 1.0
    assert json.loads((tmp_path / "g.json").read_text())["rows"] == payload["rows"]
    # --hidden-channels: both models at that width (the wide row's matched GAT twin)
    wide = bench_geometric.main(["--data-dir", str(tmp_path), "--dataset", "Toy",
                                 "--points", "24", "--batch-size", "4", "--batches", "1",
                                 "--repeats", "1", "--hidden-channels", "32"])
    wide_rows = {r["model"]: r for r in wide["rows"]}
    assert wide["hidden_channels"] == 32  # the default: the model's
    assert payload["hidden_channels"] == bench_geometric.QSVGeometric(10).hidden_channels
    assert wide_rows["QSVGeometric"]["params"] < rows["QSVGeometric"]["params"]
    # matched within 3% (the default's edge-message embedding, 8 x C per layer, has no
    # counterpart in GATConv, whose edge_dim only enters the attention)
    assert abs(wide_rows["GATConv in place"]["params"] / wide_rows["QSVGeometric"][
        "params"] - 1) < 0.03
    # --encode: every step starts from the positions (SO3 training), for both models
    calls = []
    real = bench_geometric.QSVGeometric.geometry
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bench_geometric.QSVGeometric, "geometry",
                   lambda self, *args, **kw: calls.append(args[2:3] + tuple(kw.values()))
                   or real(self, *args, **kw))
        enc = bench_geometric.main(["--data-dir", str(tmp_path), "--dataset", "Toy",
                                    "--points", "24", "--batch-size", "4", "--batches", "2",
                                    "--repeats", "1", "--encode"])
    assert enc["encode"] and not payload["encode"]
    # the graph and frames built inside, in every step (none passed in)
    assert calls and all(all(a is None for a in given) for given in calls)
    # --edge-messages: the edge_message modes other than the default ("target") are
    # timed beside the others
    em = bench_geometric.main(["--data-dir", str(tmp_path), "--dataset", "Toy",
                               "--points", "24", "--batch-size", "4", "--batches", "1",
                               "--repeats", "1", "--encode", "--edge-messages"])
    em_rows = {r["model"]: r for r in em["rows"]}
    assert set(em_rows) == {"QSVGeometric", "GATConv in place",
                            "QSVGeometric edge_message=False",
                            "QSVGeometric edge_message=source"}
    assert em_rows["QSVGeometric edge_message=False"]["params"] < \
        em_rows["QSVGeometric"]["params"] == em_rows["QSVGeometric edge_message=source"]["params"]


def test_a_benchmark_run_from_another_checkout_imports_that_checkout(tmp_path):
    """An A/B runs each side's scripts from its own checkout (a worktree): common.py
    puts that checkout first on sys.path, so the installed (editable) package does
    not stand in for it. A copy of the package marked as another checkout is the one
    a script beside it imports, even when this checkout is on PYTHONPATH."""
    import shutil
    import subprocess
    import sys
    other = tmp_path / "other"
    shutil.copytree(ROOT / "qsv_pyg", other / "qsv_pyg",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "build"))
    (other / "benchmarks").mkdir()
    shutil.copy(ROOT / "benchmarks" / "common.py", other / "benchmarks" / "common.py")
    script = other / "benchmarks" / "which.py"
    script.write_text("import common\nimport qsv_pyg\nprint(qsv_pyg.__file__)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         env=env, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()).resolve() == (other / "qsv_pyg" / "__init__.py").resolve()


def test_modelnet_split_check_finds_copies_and_reweights_to_the_test_mix(tmp_path):
    """The split check's 1-NN: test shapes that are rotated copies of training shapes
    sit at distance ~0 from them (the descriptor is rotation-invariant) and are
    classified right; the re-weighted validation accuracy is the per-class
    accuracies weighted by the test split's class shares."""
    import numpy as np
    from qsv_pyg.quaternion import quaternion_to_matrix, random_unit_quaternion
    split_check = load_benchmark("modelnet_split_check")
    g = np.random.default_rng(0)
    y = np.arange(40) % 2
    pos = g.normal(size=(40, 30, 3))
    pos[y == 0] *= [2.0, 0.4, 0.4]
    pos[y == 1] *= [1.0, 1.0, 0.1]
    rot = quaternion_to_matrix(random_unit_quaternion(6, generator=torch.Generator()
                                                      .manual_seed(1), dtype=torch.float64))
    test = np.einsum("sij,snj->sni", rot.numpy(), pos[:6])
    (tmp_path / "Toy").mkdir()
    np.savez(tmp_path / "Toy" / "toy.npz", pos_train=pos, y_train=y, pos_test=test,
             y_test=y[:6], classes=np.array(["long", "flat"]))
    out = split_check.main(["--data-dir", str(tmp_path), "--dataset", "Toy", "--points",
                            "30", "--out", str(tmp_path / "s.json")])
    test_r, val = out["test"], out["val"]
    assert test_r["shapes"] == 6 and val["shapes"] == 4
    # copies of training shapes (unless held out for validation) are found at ~0
    assert test_r["nearest_distance_quantiles"]["0.01"] < 1e-9
    assert test_r["accuracy"] >= 4 / 6
    shares = test_r["class_share"]
    assert val["accuracy_at_mix"] == pytest.approx(
        sum(s * a for s, a in zip(shares, val["per_class"])))
    assert json.loads((tmp_path / "s.json").read_text())["val"] == out["val"]


def test_ab_cpu_kernel_swaps_the_builds_and_rejects_a_bad_path(tmp_path, capsys):
    """Both sides a kernel library (here the same one): every round times each
    build and GATConv, and the JSON holds the ratios; a path that is neither a
    library nor a checkout is a usage error (exit 2)."""
    import qsv_pyg.nn._cpu_ext as cpu_ext

    module = cpu_ext.cpu_kernel()
    if module is None:
        pytest.skip(f"C++ kernel unavailable: {cpu_ext._STATE['error']}")
    ab = load_benchmark("ab_cpu_kernel")
    out = tmp_path / "ab.json"
    try:
        assert ab.main([module.__file__, module.__file__, "--n", "64", "--ks", "4",
                        "--rounds", "3", "--skip", "1", "--out", str(out)]) == 0
    finally:
        cpu_ext._STATE.update(tried=True, module=module)
    row = json.loads(out.read_text())["results"][0]
    assert row["k"] == 4 and set(row["ms"]) == {"a", "b", "gat"}
    assert row["b_over_a"] == pytest.approx(row["ms"]["b"] / row["ms"]["a"])
    assert "| 4 |" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        ab.main([str(tmp_path), module.__file__])
    assert exc.value.code == 2
    assert "neither a kernel library nor a checkout" in capsys.readouterr().err
