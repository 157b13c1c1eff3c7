"""Issues 21 and 31: one concept, one name; one default, one place; one check per run.

A field's flag, its model keyword and its table-row key are one word; old
spellings still work where they are read (flags, ``config.json`` keys, checkpoints,
table rows), each with a :class:`DeprecationWarning`, and nowhere else; each old
spelling has one meaning (``beta_prior``: the prior's weight); defaults are read
from the model, QSVConv or the preset table, not retyped; the study's committed
runs reproduce the same models and are reused by its documented command.
"""
from __future__ import annotations

import inspect
import json
import os
import re
import shlex
import warnings
from pathlib import Path

import pytest

from qsv_pyg.experiments import runner
from qsv_pyg.experiments.tables import BEYOND, STUDY, Row
from qsv_pyg.models import GraphNet, available_models, build_model, zoo
from qsv_pyg.models.graph_net import (
    CONV_KEYWORDS,
    DEFAULT_HEADS,
    GRAPHNET_QUAT_SOURCES,
    QSV_DEFAULTS,
    graph_net_default,
)
from qsv_pyg.nn import QUAT_SOURCES, QSVConv
from qsv_pyg.nn.qsv_kernel import BACKENDS
from qsv_pyg.training import stopping
from qsv_pyg.training.checkpoint import load_checkpoint, save_checkpoint
from qsv_pyg.training.cli import build_parser, config_from_args, main, parse_fields
from qsv_pyg.training.config import (
    OPTIMIZER_BACKENDS,
    RENAMED_FIELDS,
    ConfigError,
    TrainConfig,
    ablation_fields,
    preset_config,
    upgrade_keys,
)
from qsv_pyg.training.presets import (
    AUTO_PRESETS,
    CPU_SCALE_MODEL_ARGS,
    DEFAULT_SCHEDULE,
    PRESETS,
)
from qsv_pyg.training.resume import config_for_resume, unrecorded_fields
from qsv_pyg.training.trainer import TIMING_FIELDS

from tiny_cifar import TINY_QSV, write_tiny_cifar10  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
STUDY_RUNS = REPO / "docs" / "results" / "study"
#: The data folder of the README's commands: $QSV_DATA_DIR, else ../shared/data.
SHARED_DATA = Path(os.environ.get("QSV_DATA_DIR") or REPO.parent / "shared" / "data")
SMALL_QSV = dict(shell_sizes=(16, 9, 4), k_cross=4, k_inner=3, widths=(16, 16, 16), heads=2)
SMALL_SHELLS = dict(shell_sizes=(16, 9, 4), k_cross=4, k_inner=3, qsv_widths=(16, 16, 16),
                    qsv_heads=2, match_tol=0.25)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("data")
    write_tiny_cifar10(root)
    return root


# ------------------------------------------------------------------ one word per concept
def test_flag_model_keyword_and_row_key_are_one_word():
    for name, key in ablation_fields().items():
        negated = TrainConfig.__dataclass_fields__[name].metadata["negate"]
        assert key == name or (name, key, negated) == ("frozen_beta", "learn_beta", True), name
    # The beta prior: its weight and its centre, by one name each.
    assert ablation_fields()["beta_prior_weight"] == "beta_prior_weight"
    assert ablation_fields()["beta_prior_centre"] == "beta_prior_centre"
    cfg = TrainConfig(model="qsv", beta_prior_weight=0.0, beta_prior_centre=1.5)
    assert cfg.model_overrides() == {"beta_prior_weight": 0.0, "beta_prior_centre": 1.5}
    assert BEYOND.row("no-beta-prior").switches == {"beta_prior_weight": 0.0}
    assert BEYOND.row("no-beta-prior").flags() == ["--beta-prior-weight", "0.0"]
    # What a row may switch, the model takes under the same name.
    assert build_model("qsv", beta_prior_weight=0.0).qsv_options["beta_prior_weight"] == 0.0
    assert build_model("qsv", beta_prior_centre=1.5).qsv_options["beta_prior_centre"] == 1.5


def test_old_spellings_still_work_with_a_warning():
    # beta_prior has one meaning, the prior's weight: the old name of beta_prior_weight.
    assert RENAMED_FIELDS == {"beta_prior": "beta_prior_weight"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # today's names: no warning
        new, _ = config_from_args(parse_fields(["--model", "qsv", "--beta-prior-weight", "0"]))
    with pytest.warns(FutureWarning, match="--beta-prior is the old name of "
                                                "--beta-prior-weight"):
        old, _ = config_from_args(parse_fields(["--model", "qsv", "--beta-prior", "0"]))
    assert old == new and old.beta_prior_weight == 0.0 and old.beta_prior_centre is None
    with pytest.warns(FutureWarning, match="old spelling of 'composed'"):
        both, _ = config_from_args(parse_fields(["--model", "qsv", "--quat-source", "both"]))
    assert both.quat_source == "composed" and both.model_overrides() == {"quat_source": "composed"}
    assert "--beta-prior-weight W, --beta-prior W" in " ".join(build_parser().format_help().split())
    # A table row and replace() read the old keys too.
    with pytest.warns(DeprecationWarning, match="'beta_prior' is the old name of"):
        row = Row("old", "old spelling", "qsv", {"beta_prior": 0.0, "quat_source": "both"})
    assert row.switches == {"beta_prior_weight": 0.0, "quat_source": "composed"}
    with pytest.warns(DeprecationWarning, match="old name of 'beta_prior_weight'"):
        assert TrainConfig().replace(beta_prior=0.5).beta_prior_weight == 0.5
    with pytest.warns(DeprecationWarning, match="old spelling of 'composed'"):
        assert TrainConfig(model="qsv", quat_source="both").validate().quat_source == "composed"
    with pytest.raises(ConfigError, match="old name of 'beta_prior_weight'"):
        upgrade_keys({"beta_prior": 0.5, "beta_prior_weight": 0.5})
    # Models take the canonical names only: beta_prior (before issue 21 GraphNet's name
    # of the centre) is refused rather than read with a second meaning.
    with pytest.raises(TypeError, match="retired keyword 'beta_prior'.*beta_prior_centre"):
        build_model("qsv", beta_prior=1.5)
    with pytest.raises(TypeError, match="beta_prior"):
        GraphNet(beta_prior=1.5)
    assert "beta_prior" not in inspect.signature(GraphNet).parameters
    # The model's old spelling of a source: read with a warning, stored as today's.
    with pytest.warns(DeprecationWarning, match="old spelling of 'composed'"):
        model = build_model("qsv", **SMALL_QSV, quat_source="both")
    assert model.qsv_options["quat_source"] == "composed"


#: Where an old spelling may appear: the tables that read it, the text that documents
#: them, and the tests of both.
OLD_SPELLINGS = {
    r"\bbeta_prior\b": {"qsv_pyg/training/config.py", "qsv_pyg/models/zoo.py",
                        "tests/test_one_name.py"},
    r'"both"': {"qsv_pyg/nn/quat_sources.py", "qsv_pyg/nn/qsv_conv.py",
                "qsv_pyg/training/config.py", "qsv_pyg/models/graph_net.py",
                "qsv_pyg/analysis/routing.py", "tests/test_one_name.py",
                "tests/test_models.py", "tests/test_analysis.py"},
}


def test_old_spellings_are_read_where_they_arrive_and_nowhere_else():
    files = [*(REPO / "qsv_pyg").rglob("*.py"), *(REPO / "tests").rglob("*.py")]
    for pattern, allowed in OLD_SPELLINGS.items():
        found = {p.relative_to(REPO).as_posix() for p in files
                 if re.search(pattern, p.read_text(encoding="utf-8"))}
        assert found <= allowed, (pattern, found - allowed)


def test_each_name_has_one_meaning():
    # quat_source: every source of the package vs GraphNet's.
    assert set(GRAPHNET_QUAT_SOURCES) < set(QUAT_SOURCES)
    assert "both" not in GRAPHNET_QUAT_SOURCES
    from qsv_pyg.models import graph_net
    assert not hasattr(graph_net, "QUAT_SOURCES")
    # Back-ends: the kernel's vs the optimiser's.
    from qsv_pyg.training import optim
    assert BACKENDS == ("triton", "cpp", "torch")
    assert OPTIMIZER_BACKENDS == optim.OPTIMIZER_BACKENDS == ("auto", "riemannian", "projected")
    assert not hasattr(optim, "BACKENDS")
    # The intervention with both switches off has the trained ablation's name.
    from qsv_pyg.analysis import INTERVENTION_ALIASES, INTERVENTIONS, intervention_name
    assert "both-off" in INTERVENTIONS and "both" not in INTERVENTIONS
    assert STUDY.row("both-off").switches == {"routing": "uniform", "transport": "identity"}
    assert INTERVENTIONS["both-off"] == STUDY.row("both-off").switches
    assert INTERVENTION_ALIASES == {"both": "both-off"}
    with pytest.warns(DeprecationWarning, match="'both-off'"):
        assert intervention_name("both") == "both-off"


def test_an_old_config_json_reads_with_its_meaning():
    saved = json.loads((STUDY_RUNS / "qsv" / "seed0" / "config.json").read_text())
    assert "beta_prior" in saved and "beta_prior_centre" in saved  # written before issue 21
    saved.update(beta_prior=0.0, beta_prior_centre=1.5, quat_source="both")  # weight, centre
    with pytest.warns(DeprecationWarning) as caught:
        cfg = TrainConfig.from_dict(saved)
    assert {str(w.message) for w in caught} == {
        "'beta_prior' is the old name of 'beta_prior_weight'",
        "quat_source='both' is an old spelling of 'composed'"}
    assert (cfg.beta_prior_weight, cfg.beta_prior_centre, cfg.quat_source) == (0.0, 1.5,
                                                                              "composed")
    # The old name is the field, not a missing one (this config predates the block switches).
    assert unrecorded_fields(saved) == ("root_weight", "mlp_ratio")
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg


# ------------------------------------------------------------------ heads
def test_heads_is_qsvs_and_a_control_has_control_heads():
    assert inspect.signature(GraphNet).parameters["heads"].default == DEFAULT_HEADS == 16
    ctl = build_model("attention-gat", **SMALL_SHELLS)
    assert ctl.heads == zoo.CONTROL_HEADS == 4
    own = build_model("attention-gat", **SMALL_SHELLS, control_heads=2)
    assert own.heads == 2
    with pytest.warns(FutureWarning, match="control_heads"):
        old = build_model("attention-gat", **SMALL_SHELLS, heads=2)  # its old spelling
    assert (old.heads, old.widths) == (own.heads, own.widths)
    # The shared description gives QSV's heads, which a control takes as its reference.
    assert zoo.model_overrides_for("attention-gat", {"heads": 16}) == {"qsv_heads": 16}
    assert zoo.model_overrides_for("qsv", {"heads": 16}) == {"heads": 16}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_model("attention-gat", **SMALL_SHELLS)  # no old spelling, no warning
    assert "control_heads (default 4)" in " ".join(build_parser().format_help().split())


# ------------------------------------------------------------------ one default, one place
def test_defaults_are_read_not_retyped():
    assert {k: getattr(TrainConfig(), k) for k in DEFAULT_SCHEDULE} == DEFAULT_SCHEDULE
    for name in ("paper-qsv", "cpu-qsv"):
        differ = {k for k, v in DEFAULT_SCHEDULE.items() if PRESETS[name][k] != v}
        assert differ == ({"epochs", "warmup_epochs"} if name == "paper-qsv"
                          else {"epochs", "lr", "warmup_epochs"}), name
    help_of = TrainConfig.describe()
    for name in ("routing", "transport", "quat_source", "beta_init", "beta_prior_weight",
                 "beta_prior_centre", "repulsion_k", "repulsion_weight", "mlp_ratio"):
        key = ablation_fields()[name]
        assert f"model default {graph_net_default(key)}" in help_of[name].replace(":", ""), name
    assert graph_net_default("beta_prior_centre") == QSV_DEFAULTS["beta_prior_centre"] == 0.79
    # The QSVConv arguments GraphNet passes on default to QSVConv's own.
    conv = inspect.signature(QSVConv.__init__).parameters
    assert set(CONV_KEYWORDS) == {"routing", "transport", "beta_init", "learn_beta",
                                  "root_weight"}
    for name in CONV_KEYWORDS:
        assert graph_net_default(name) == QSV_DEFAULTS[name] == conv[name].default, name
    assert QSV_DEFAULTS["quat_source"] == "field" != conv["quat_source"].default  # GraphNet's
    assert graph_net_default("mlp_ratio") == inspect.signature(GraphNet).parameters[
        "mlp_ratio"].default
    # The model list is the registry's; the CPU-scale models are one shared description.
    assert {f"paper-{m}" for m in available_models()} <= set(PRESETS)
    assert set(AUTO_PRESETS) == {f"auto-{m}" for m in available_models()}
    assert set(CPU_SCALE_MODEL_ARGS) == set(available_models())
    qsv = CPU_SCALE_MODEL_ARGS["qsv"]
    assert qsv["heads"] == DEFAULT_HEADS
    for model in available_models():
        assert CPU_SCALE_MODEL_ARGS[model] == {
            k: tuple(v) if isinstance(v, list) else v
            for k, v in zoo.model_overrides_for(model, qsv).items()}, model
    assert preset_config("paper-qsv-no-beta-prior").beta_prior_weight == 0.0


# ------------------------------------------------------------------ the committed study
def test_the_study_runs_build_the_same_models():
    """Each model of a committed ``config.json``: its parameter count and widths."""
    expected = {"qsv": (160_810, (64,) * 5, 16), "lattice": (160_810, (64,) * 5, 16),
                "attention-transformer": (162_074, (52, 52, 52, 52, 56), 4),
                "attention-gat": (161_930, (64,) * 5, 4)}
    for slug, (params, widths, heads) in expected.items():
        cfg = TrainConfig.load(STUDY_RUNS / slug / "seed0" / "config.json")
        model = build_model(cfg.model, cfg.num_classes, **cfg.model_overrides())
        assert (model.num_parameters(), model.widths, model.heads) == (params, widths, heads)


def test_the_study_command_reuses_the_committed_runs():
    overrides = {"shell_sizes": [100, 64, 36, 16, 9], "widths": [64, 64, 64, 64, 64],
                 "heads": 16, "patch_size": 4}  # README: "the longer equal-budget study"
    train_args = ("--threads 1 --budget-clock process --anneal-to-budget --warmup-epochs 0.5 "
                  "--eval-at-minutes 5 10 20")
    settings = runner.RunSettings(budget_minutes=30, data_dir=str(SHARED_DATA), epochs=200,
                                  batch_size=128, lr=2e-3, device="cpu",
                                  model_overrides=overrides,
                                  train_args=tuple(shlex.split(train_args)))
    specs = runner.plan_runs(STUDY, None, REPO / "docs" / "results", settings,
                             validate_models=False)
    assert len(specs) == 11
    for spec in specs:
        assert runner._decide(spec) == ("reuse", []), spec.name


# ------------------------------------------------------------------ one check per run
def test_the_configuration_is_validated_once_on_its_way_to_the_trainer(data_dir, tmp_path,
                                                                       monkeypatch):
    calls = []
    original = TrainConfig.validate
    monkeypatch.setattr(TrainConfig, "validate",
                        lambda self: calls.append(1) or original(self))
    args = ["--model", "resnet20", "--data-dir", str(data_dir), "--out-dir",
            str(tmp_path / "run"), "--subset", "16", "--test-subset", "16", "--batch-size",
            "16", "--device", "cpu", "--no-progress", "--time-budget", "1e-9"]
    assert main(args) == 0
    assert len(calls) == 1
    with pytest.raises(ConfigError, match="unknown model 'nope'"):
        TrainConfig(model="nope").validate()  # the model name: checked there, and only there
    cfg = TrainConfig(model="resnet20").validate()
    assert cfg.is_validated()
    cfg.epochs = 3
    assert not cfg.is_validated()  # changed since


def test_an_old_checkpoint_resumes_exactly(data_dir, tmp_path, monkeypatch):
    """A run written before issue 21 (``beta_prior`` = the weight, ``quat_source`` both)
    resumes to the log of an uninterrupted run."""
    flags = [*TINY_QSV, "--beta-prior", "0.05", "--beta-prior-centre", "1.5",
             "--quat-source", "both"]

    def args(out, *extra):
        return [*flags, "--data-dir", str(data_dir), "--out-dir", str(out), "--epochs", "2",
                "--batch-size", "16", "--device", "cpu", "--no-progress", "--warmup-epochs",
                "1", "--lr", "3e-3", *extra]

    def log(out):
        return [{k: v for k, v in json.loads(line).items() if k not in TIMING_FIELDS}
                for line in (out / "log.jsonl").read_text().splitlines()]

    straight = tmp_path / "straight"
    assert main(args(straight)) == 0
    out = tmp_path / "run"
    clock = iter([0.0] * 7 + [1e9] * 1000)  # the budget ends before the 7th step
    monkeypatch.setattr(stopping, "wall_clock", lambda: next(clock))
    assert main(args(out, "--time-budget", "5")) == 0
    monkeypatch.undo()
    # Rewrite the run's files as the trainer wrote them before issue 21.
    state = load_checkpoint(out / "checkpoint.pt")
    config = state["config"]
    assert (config["beta_prior_weight"], config["quat_source"]) == (0.05, "composed")
    old = {("beta_prior" if k == "beta_prior_weight" else k): v for k, v in config.items()}
    old["quat_source"] = "both"
    state["config"] = old
    save_checkpoint(out / "checkpoint.pt", state)
    (out / "config.json").write_text(json.dumps(old, indent=2, sort_keys=True) + "\n")
    cfg = config_for_resume(out / "checkpoint.pt", {})
    assert (cfg.beta_prior_weight, cfg.beta_prior_centre, cfg.quat_source) == (0.05, 1.5,
                                                                              "composed")
    assert main(["--resume", str(out), "--no-progress"]) == 0
    assert log(out) == log(straight)
    rewritten = json.loads((out / "config.json").read_text())  # in today's names
    assert (rewritten["beta_prior_weight"], rewritten["quat_source"]) == (0.05, "composed")
    assert "beta_prior" not in rewritten
