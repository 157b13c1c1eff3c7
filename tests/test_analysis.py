"""Routing analysis of a trained QSV model (qsv_pyg.analysis, examples/analyze.py).

One tiny QSV model is trained for one short epoch on random CIFAR-10-shaped data;
the checks are about bookkeeping and invariants (ranges, exact uniformity,
restored settings, errors), not about what a real model learns.
"""
from __future__ import annotations

import importlib.util
import json
import math
import warnings
from pathlib import Path

import pytest
import torch

from qsv_pyg.analysis import (
    INTERVENTIONS,
    NotQSVModelError,
    intervene,
    intervention_accuracy,
    interventions_of,
    load_model,
    qsv_layers,
    rotation_angles,
    routing_statistics,
)
from qsv_pyg.data import BatchAugment, DeviceLoader, load_cifar
from qsv_pyg.models import build_model
from qsv_pyg.quaternion import conjugate, hamilton_product
from qsv_pyg.training.checkpoint import save_checkpoint
from qsv_pyg.training.cli import main as train_main
from qsv_pyg.training.config import TrainConfig

from tiny_cifar import write_tiny_cifar10  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

# Three levels (two cross layers, one within layer); the fields start Haar-random,
# so the relative rotations are far from the identity.
TINY_ARGS = {"shell_sizes": [16, 9, 4], "widths": [16, 16, 16], "heads": 2, "k_cross": 4,
             "k_inner": 3, "within_rounds": 1, "repulsion_k": 3}

def _load_cli():
    spec = importlib.util.spec_from_file_location("qsv_analyze_cli",
                                                  REPO / "examples" / "analyze.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def cli():
    return _load_cli()


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("data")
    write_tiny_cifar10(root, n_train=32, n_test=24)
    return root


@pytest.fixture(scope="module")
def run_dir(data_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("runs") / "qsv"
    args = ["--model", "qsv", "--data-dir", str(data_dir), "--out-dir", str(out),
            "--epochs", "1", "--batch-size", "16", "--device", "cpu", "--no-progress",
            "--warmup-epochs", "1", "--lr", "3e-3"]
    for key, value in TINY_ARGS.items():
        args += ["--model-arg", f"{key}={json.dumps(value)}"]
    assert train_main(args) == 0
    return out


@pytest.fixture(scope="module")
def trained(run_dir):
    model, cfg, _ = load_model(run_dir)
    return model, cfg


@pytest.fixture(scope="module")
def images(data_dir) -> torch.Tensor:
    test = load_cifar("cifar10", "test", data_dir)
    return BatchAugment.for_dataset("cifar10", train=False)(test.images[:6])


def _settings(model):
    return {name: (c.routing, c.transport) for name, c in qsv_layers(model).items()}


# --------------------------------------------------------------------------- library


def test_statistics_ranges_and_uniform_intervention(trained, images):
    model, _ = trained
    before = _settings(model)
    stats = routing_statistics(model, [images[:4], images[4:]])
    assert [s["layer"] for s in stats] == ["cross0", "cross1", "within0"]
    for s in stats:
        assert s["images"] == 6 and len(s["entropy_ratio"]) == len(s["kl"]) == 2
        assert s["degree"] == (3 if s["layer"] == "within0" else 4)
        for ratio, kl in zip(s["entropy_ratio"], s["kl"]):
            assert 0.0 <= ratio <= 1.0 and kl >= 0.0
            assert kl == pytest.approx(math.log(s["degree"]) * (1 - ratio), abs=1e-9)
    # A learned routing on Haar-random fields is not uniform.
    assert min(min(s["kl"]) for s in stats) > 0

    with intervene(model, "uniform-routing"):
        uniform = routing_statistics(model, images)
    for s in uniform:
        assert s["routing"] == "uniform"
        assert s["entropy_ratio"] == pytest.approx([1.0, 1.0], abs=1e-12)
        assert s["kl"] == pytest.approx([0.0, 0.0], abs=1e-12)
    assert _settings(model) == before
    for conv in qsv_layers(model).values():  # the capture hooks are gone
        assert not conv._forward_pre_hooks and not conv._forward_hooks


def test_rotation_angles_match_hamilton_product(trained, images):
    model, _ = trained
    angles = rotation_angles(model, images)
    assert list(angles) == ["cross0", "cross1", "within0"]
    conv = qsv_layers(model)["within0"]
    edges = model.inner_edges
    q = model.fields[-1]().detach()  # [N, heads, 4], the innermost level's field
    q = q / q.norm(dim=-1, keepdim=True)
    r = hamilton_product(conjugate(q[edges[1]]), q[edges[0]])
    expected = torch.rad2deg(2 * torch.acos(r[..., 0].abs().clamp(max=1.0)))
    assert angles["within0"].shape == (edges.size(1), conv.heads)
    torch.testing.assert_close(angles["within0"], expected, atol=1e-3, rtol=0)
    for a in angles.values():
        assert bool(((a >= 0) & (a <= 180)).all())
    assert float(angles["cross0"].median()) > 10  # random fields: far from identity


def test_identity_transport_changes_outputs_and_settings_restored(trained, images):
    model, _ = trained
    before = _settings(model)
    with torch.no_grad():
        plain = model(images)
        with intervene(model, "identity-transport") as layers:
            assert all(c.transport == "identity" for c in layers.values())
            identity = model(images)
        with intervene(model, "both-off"):
            assert all((c.routing, c.transport) == ("uniform", "identity")
                       for c in qsv_layers(model).values())
        with pytest.warns(DeprecationWarning, match="'both-off'"):
            with intervene(model, "both"):  # its old spelling
                assert all((c.routing, c.transport) == ("uniform", "identity")
                           for c in qsv_layers(model).values())
    assert (plain - identity).abs().max() > 1e-4
    assert _settings(model) == before

    class Broken:
        def epoch(self, epoch):
            yield images, torch.zeros(images.size(0), dtype=torch.long)
            raise RuntimeError("loader failed")

    model.train()
    with pytest.raises(RuntimeError, match="loader failed"):
        intervention_accuracy(model, Broken(), "both-off")
    assert _settings(model) == before and model.training
    model.eval()
    with pytest.raises(ValueError, match="unknown intervention"):
        intervention_accuracy(model, Broken(), "rotate")


def test_intervention_accuracy_none_matches_plain_evaluation(trained, data_dir):
    model, _ = trained
    test = load_cifar("cifar10", "test", data_dir)
    loader = DeviceLoader(test, 10, augment=BatchAugment.for_dataset("cifar10", train=False))
    with torch.no_grad():
        logits = torch.cat([model(x) for x, _ in loader.epoch(0)])
    expected = float((logits.argmax(1) == test.labels).float().mean())
    accs = {mode: intervention_accuracy(model, loader, mode) for mode in INTERVENTIONS}
    assert accs["none"] == pytest.approx(expected)
    assert all(0.0 <= a <= 1.0 for a in accs.values())


# --------------------------------------------------------------------------- CLI


def test_cli_writes_report(cli, run_dir, data_dir, tmp_path, capsys):
    out = tmp_path / "analysis"
    assert cli.main([str(run_dir), "--data-dir", str(data_dir), "--test-subset", "20",
                     "--batch-size", "8", "--stat-batches", "2", "--device", "cpu",
                     "--out", str(out)]) == 0
    for name in cli.OUTPUT_FILES:
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    assert (out / "routing_entropy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads((out / "analysis.json").read_text())
    assert report["stat_images"] == 16 and report["test_images"] == 20
    for layer in report["routing"]:
        assert all(0 <= v <= 1 for v in layer["entropy_ratio"])
        assert all(v >= 0 for v in layer["kl"])
        ang = report["angles"][layer["layer"]]
        assert all(0 <= v <= 180 for v in ang["median"] + ang["mean"])
        assert sum(map(sum, ang["counts"])) == layer["degree"] * layer["num_targets"] * 2
    assert set(report["interventions"]) == set(INTERVENTIONS)
    assert report["interventions"]["none"]["delta"] == 0
    for r in report["interventions"].values():
        assert r["delta"] == pytest.approx(r["acc"] - report["interventions"]["none"]["acc"])
    printed = capsys.readouterr().out
    assert "| cross0 | 0 |" in printed and "| uniform-routing |" in printed
    assert "| both-off |" in printed
    assert (out / "analysis.md").read_text() in printed


def test_an_old_analysis_json_reads_with_todays_names():
    """``analysis.json`` written before the rename keys both switches off as "both"."""
    for path in ("analysis-qsv", "block/analysis-kernel-only-qsv"):
        report = json.loads((REPO / "docs" / "results" / path / "analysis.json").read_text())
        assert "both" in report["interventions"], path
        with pytest.warns(DeprecationWarning, match="'both-off'"):
            read = interventions_of(report)
        assert list(read) == list(INTERVENTIONS)
        assert read["both-off"] == report["interventions"]["both"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert interventions_of({"interventions": {"both-off": 1}}) == {"both-off": 1}


def test_cli_bad_checkpoint(cli, tmp_path, capsys):
    missing = tmp_path / "nowhere.pt"
    assert cli.main([str(missing), "--device", "cpu"]) == 2
    assert f"checkpoint file not found: {missing}" in capsys.readouterr().err
    empty_run = tmp_path / "empty-run"
    empty_run.mkdir()
    assert cli.main([str(empty_run), "--device", "cpu"]) == 2
    assert f"checkpoint file not found: {empty_run / 'checkpoint.pt'}" in capsys.readouterr().err

    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(b"not a checkpoint")
    assert cli.main([str(corrupt), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert str(corrupt) in err and "not a valid checkpoint" in err


@pytest.mark.parametrize("name,overrides", [
    ("resnet20", {}),
    ("attention-gat", {"shell_sizes": [16, 9, 4], "widths": [16, 16, 16], "heads": 2,
                       "k_cross": 4, "k_inner": 3, "within_rounds": 1}),
])
def test_cli_rejects_non_qsv_models(cli, tmp_path, capsys, name, overrides):
    cfg = TrainConfig(model=name, model_args=overrides)
    model = build_model(name, 10, **cfg.model_overrides())
    save_checkpoint(tmp_path / "checkpoint.pt", {"config": cfg.to_dict(),
                                                 "model": model.state_dict()})
    assert cli.main([str(tmp_path), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "needs a QSV model" in err and str(tmp_path) in err
    with pytest.raises(NotQSVModelError):
        routing_statistics(model, torch.zeros(1, 3, 32, 32))
