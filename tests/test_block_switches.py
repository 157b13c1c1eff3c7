"""The block switches of the block study (issue: why the kernel matters less here):
no root weight, no MLP, kernel-only; their parameter counts, training, flags, presets
and the block table."""
from __future__ import annotations

import json

import pytest
import torch

from qsv_pyg.experiments import runner
from qsv_pyg.experiments.tables import BLOCK, BLOCK_KERNELS, BLOCK_VARIANTS, block_slug
from qsv_pyg.models import build_model
from qsv_pyg.training import cli as train_cli
from qsv_pyg.training.config import PRESETS, TrainConfig, ablation_fields

SMALL = dict(shell_sizes=(64, 36, 16, 9, 4), k_cross=4, k_inner=3, heads=2,
             widths=(16, 16, 24, 24, 32))


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models, shared cores


def _model(**kw):
    torch.manual_seed(0)
    return build_model("qsv", **{**SMALL, **kw})


def _count(modules) -> int:
    return sum(p.numel() for m in modules for p in m.parameters())


def test_no_root_weight_removes_exactly_the_root_maps():
    full, noroot = _model(), _model(root_weight=False)
    roots = [conv.lin_skip for conv in full.qsv_convs().values()]
    assert all(r is not None for r in roots)
    assert all(conv.lin_skip is None and not conv.root_weight
               for conv in noroot.qsv_convs().values())
    assert noroot.num_parameters() == full.num_parameters() - _count(roots)
    assert "no root weight" in noroot.describe()


def test_mlp_ratio_zero_removes_exactly_the_mlp_branches():
    full, nomlp = _model(), _model(mlp_ratio=0.0)
    blocks = [*full.cross, *full.within]
    branch = _count([b.mlp for b in blocks]) + _count([b.norm_mlp for b in blocks])
    assert branch > 0
    assert nomlp.num_parameters() == full.num_parameters() - branch
    assert all(b.mlp is None and b.norm_mlp is None for b in [*nomlp.cross, *nomlp.within])
    assert "no MLP" in nomlp.describe()
    # Kernel-only removes both, and nothing else.
    ko = _model(root_weight=False, mlp_ratio=0)
    roots = _count([c.lin_skip for c in full.qsv_convs().values()])
    assert ko.num_parameters() == full.num_parameters() - branch - roots


def test_default_block_is_unchanged():
    # State-dict names of the MLP branch are those of earlier checkpoints.
    keys = _model().state_dict().keys()
    assert "cross.0.norm_mlp.weight" in keys and "cross.0.mlp.0.weight" in keys
    assert "within.0.conv.conv.lin_skip.weight" in keys


@pytest.mark.parametrize("variant", sorted(BLOCK_VARIANTS))
@pytest.mark.parametrize("kernel", sorted(BLOCK_KERNELS))
def test_every_block_variant_trains(variant, kernel):
    switches = TrainConfig().replace(**BLOCK_VARIANTS[variant][1],
                                     **BLOCK_KERNELS[kernel][1]).model_overrides()
    model = _model(**switches)
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    logits = model(images)
    assert logits.shape == (2, 10) and torch.isfinite(logits).all()
    (logits.logsumexp(-1).mean() + model.auxiliary_loss()).backward()
    # Without the root weight a cross block's target features reach the conv only as
    # its quaternion source, which is the field here: the target LayerNorm is unused.
    unused = (("log_beta",) if kernel == "both-off" else ()) + (
        ("norm_dst",) if variant in ("no-root", "kernel-only") else ())
    for name, p in model.named_parameters():
        if p.requires_grad and not any(u in name for u in unused):
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
    # One optimiser step changes the output: the model learns.
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.step()
    assert not torch.allclose(model(images), logits)


def test_bad_mlp_ratio_and_controls():
    for bad in (-1.0, float("nan"), True, "2"):
        with pytest.raises(ValueError, match="mlp_ratio"):
            _model(mlp_ratio=bad)
    ctl = dict(shell_sizes=SMALL["shell_sizes"], k_cross=4, k_inner=3, widths=(8,) * 5)
    # The root weight is a QSVConv switch: a control refuses it by name ...
    with pytest.raises(TypeError, match="root_weight"):
        build_model("attention-gat", **ctl, root_weight=False)
    # ... and the MLP ratio is the block's, so a control takes it.
    gat = build_model("attention-gat", **ctl, mlp_ratio=0)
    assert all(b.mlp is None for b in gat.cross)


def test_flags_model_keywords_and_presets_are_one_word():
    assert ablation_fields()["root_weight"] == "root_weight"
    assert ablation_fields()["mlp_ratio"] == "mlp_ratio"
    cfg, _ = train_cli.config_from_args(
        train_cli.parse_fields(["--model", "qsv", "--no-root-weight", "--mlp-ratio", "0"]))
    assert cfg.model_overrides() == {"root_weight": False, "mlp_ratio": 0.0}
    help_text = train_cli.build_parser().format_help()
    assert "--no-root-weight" in help_text and "--mlp-ratio" in help_text
    assert PRESETS["paper-qsv-kernel-only"]["root_weight"] is False
    assert PRESETS["paper-qsv-kernel-only"]["mlp_ratio"] == 0.0
    assert PRESETS["paper-qsv-no-mlp"]["mlp_ratio"] == 0.0
    with pytest.raises(Exception, match="mlp-ratio"):
        train_cli.config_from_args(train_cli.parse_fields(["--model", "qsv",
                                                          "--mlp-ratio", "-1"]))


def test_block_table_plan(tmp_path):
    slugs = BLOCK.slugs
    assert len(slugs) == 9 and BLOCK.reference == block_slug("full", "qsv")
    for variant in BLOCK_VARIANTS:
        for kernel in ("qsv", "both-off"):
            assert block_slug(variant, kernel) in slugs
    assert block_slug("kernel-only", "identity") in slugs
    row = BLOCK.row("kernel-only-both-off")
    assert dict(row.switches) == {"root_weight": False, "mlp_ratio": 0.0,
                                  "routing": "uniform", "transport": "identity"}
    assert row.flags() == ["--no-root-weight", "--mlp-ratio", "0.0", "--routing", "uniform",
                           "--transport", "identity"]
    settings = runner.RunSettings(budget_minutes=30.0, data_dir=None, device="cpu")
    specs = runner.plan_runs(BLOCK, None, tmp_path, settings, validate_models=False)
    assert len(specs) == 11  # nine rows at seed 0, the kernel-only pair at seed 1 too
    assert specs[0].row.slug == "kernel-only-qsv"
    assert specs[0].config.model_overrides()["root_weight"] is False


def _fake_run(root, slug, seed, acc, params=1000):
    folder = runner.run_dir(root, "block", slug, seed)
    folder.mkdir(parents=True)
    (folder / "metrics.json").write_text(json.dumps(
        {"test_acc": acc, "steps": 100, "stopped_early": True, "epochs": 3,
         "epochs_planned": 10, "params": params}))
    (folder / "config.json").write_text(json.dumps({"time_budget": 30.0}))


def test_block_report_measures_each_switch_within_its_block(tmp_path):
    from qsv_pyg.experiments.block_report import BLOCK_FILES, PAPER_COSTS
    from qsv_pyg.experiments.report import write_report

    _fake_run(tmp_path, "full-qsv", 0, 0.65, 160_000)
    _fake_run(tmp_path, "full-both-off", 0, 0.60, 150_000)
    _fake_run(tmp_path, "kernel-only-qsv", 0, 0.50, 90_000)
    _fake_run(tmp_path, "kernel-only-qsv", 1, 0.52, 90_000)
    _fake_run(tmp_path, "kernel-only-both-off", 0, 0.30, 80_000)
    _fake_run(tmp_path, "kernel-only-both-off", 1, 0.36, 80_000)
    _fake_run(tmp_path, "kernel-only-identity", 0, 0.45, 80_000)
    # A switch run without its block's QSV run of the same seed is not paired.
    _fake_run(tmp_path, "no-mlp-both-off", 0, 0.55)
    paths = write_report(BLOCK, tmp_path)
    for name in BLOCK_FILES:
        assert paths[name].is_file() and paths[name].stat().st_size > 0, name
    costs = json.loads(paths["block_costs.json"].read_text())
    by = {v["variant"]: v for v in costs["variants"]}
    assert list(by) == list(BLOCK_VARIANTS)  # block order, not run order
    assert by["full"]["costs"]["both-off"]["per_seed"] == pytest.approx([-5.0])
    ko = by["kernel-only"]["costs"]
    assert ko["both-off"]["seeds"] == [0, 1]
    assert ko["both-off"]["per_seed"] == pytest.approx([-20.0, -16.0])
    assert ko["both-off"]["mean"] == pytest.approx(-18.0)
    assert ko["identity"]["per_seed"] == pytest.approx([-5.0])
    assert by["no-mlp"]["costs"]["both-off"]["mean"] is None
    assert "identity" not in by["full"]["costs"]  # not in the plan
    assert by["kernel-only"]["kernels"]["qsv"]["params"] == 90_000
    md = paths["block_costs.md"].read_text()
    assert "−18.00 ± 2.83 (n=2)" in md and "−5.00" in md and "−21.8" in md
    assert costs["paper"] == PAPER_COSTS
