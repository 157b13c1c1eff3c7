"""benchmarks/run_gpu.sh cannot rot: its dry run lists both phases and every
step, every listed command's script exists and accepts its flags, each phase
fits in one 10-minute command and starts with the warm-up, the warm-up covers
the configurations the steps run, and the report reads exactly the files the
steps write."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"

from conftest import load_benchmark  # noqa: E402

gpu_report = load_benchmark("gpu_report")

EXPECTED = {
    "warmup": ["gpu-info", "warmup", "conv-fp32", "conv-bf16", "cuda-tests", "triton-tests",
               "report"],
    "measure": ["warmup-again", "train-eager-fp32", "epoch-paper-qsv", "train-eager-bf16",
                "train-compiled-fp32", "train-compiled-bf16", "determinism", "ddp-smoke",
                "report"],
}
#: One command on the GPU machine: at most 600 s; the phase's steps, its report
#: and a margin for Python's start-up must fit.
COMMAND_S, REPORT_S, MARGIN_S = 600, 15, 30
PHASE = re.compile(r"^phase (?P<name>\w+) (?P<budget>\d+)s$")
LINE = re.compile(r"^step (?P<name>[\w-]+) (?P<limit>\d+)s: (?P<cmd>.+)$")


def _dry_run(out: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """The dry run as on the GPU image: ``PYTHON`` unset (CI may set it), plus ``env``."""
    base = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    return subprocess.run(["bash", str(BENCH / "run_gpu.sh"), *args, "--dry-run"], cwd=REPO,
                          capture_output=True, text=True, timeout=60,
                          env={**base, "OUT": str(out), **env})


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """``(out, {phase: (budget, [(step, limit, argv)])})`` of the dry run."""
    out = tmp_path_factory.mktemp("gpu-out")
    proc = _dry_run(out)
    assert proc.returncode == 0, proc.stderr
    phases = {}
    current = None
    for line in proc.stdout.splitlines():
        m = PHASE.match(line)
        if m:
            current = phases.setdefault(m["name"], (int(m["budget"]), []))
            continue
        m = LINE.match(line)
        assert m and current is not None, f"not a phase or step line: {line!r}"
        current[1].append((m["name"], int(m["limit"]), shlex.split(m["cmd"])))
    assert not out.exists() or not any(out.iterdir()), "--dry-run must not write anything"
    return out, phases


def _steps(phases):
    return [s for _, steps in phases.values() for s in steps]


class _Parsed(Exception):
    def __init__(self, namespace):
        super().__init__("parsed")
        self.namespace = namespace


def _load(script: Path):
    spec = importlib.util.spec_from_file_location(f"_gpu_script_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_flags(script: Path, argv: list, monkeypatch) -> argparse.Namespace:
    """The script's own argparse result for ``argv`` (nothing is run)."""
    module = _load(script)
    if hasattr(module, "build_parser"):
        return module.build_parser().parse_args(argv)
    original = argparse.ArgumentParser.parse_args

    def parse_and_stop(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)
    with pytest.raises(_Parsed) as parsed:
        module.main(argv)
    return parsed.value.namespace


def test_two_phases_each_within_one_command(dry_run):
    _, phases = dry_run
    assert list(phases) == ["warmup", "measure"]
    for phase, (budget, steps) in phases.items():
        assert [name for name, _, _ in steps] == EXPECTED[phase], phase
        limits = sum(limit for name, limit, _ in steps if name != "report")
        assert limits <= budget, f"{phase}: step limits {limits} s > its budget {budget} s"
        assert budget + REPORT_S + MARGIN_S <= COMMAND_S, phase
        assert [limit for name, limit, _ in steps if name == "report"] == [REPORT_S]
    text = (BENCH / "run_gpu.sh").read_text()
    assert "timeout" in text and "--dry-run" in text


def test_each_phase_starts_by_warming_up(dry_run):
    _, phases = dry_run
    for phase, (_, steps) in phases.items():
        first = next(cmd for name, _, cmd in steps if name != "gpu-info")
        assert first[1] == "benchmarks/gpu_warmup.py" and "--device" in first, phase


def test_the_warm_up_covers_what_the_steps_run(dry_run):
    """gpu_warmup.py's configurations are run_gpu.sh's: the conv layers, channels
    and heads, the trained models and their batch size."""
    gpu_warmup = load_benchmark("gpu_warmup")

    steps = {name: cmd for name, _, cmd in _steps(dry_run[1])}

    def flag(cmd, name, default=None):
        if name not in cmd:
            return default
        i = cmd.index(name) + 1
        values = []
        while i < len(cmd) and not cmd[i].startswith("--"):
            values.append(cmd[i])
            i += 1
        return values

    conv = steps["conv-fp32"]
    layers = flag(conv, "--layers")
    assert set(gpu_warmup.CONV_LAYERS) == {x for x in layers if x.startswith("qsv")}
    assert int(flag(conv, "--channels", ["64"])[0]) == gpu_warmup.CONV_CHANNELS
    assert int(flag(conv, "--heads", ["4"])[0]) == gpu_warmup.CONV_HEADS
    assert tuple(int(k) for k in flag(conv, "--ks")) == gpu_warmup.CONV_KS
    for name in ("train-eager-fp32", "train-eager-bf16"):
        assert tuple(flag(steps[name], "--models")) == gpu_warmup.TRAIN_MODELS
    for name in ("train-eager-fp32", "train-compiled-fp32", "train-compiled-bf16"):
        train = steps[name]
        assert set(flag(train, "--models")) <= set(gpu_warmup.TRAIN_MODELS)
        assert int(flag(train, "--batch-size")[0]) == gpu_warmup.TRAIN_BATCH
    det = steps["determinism"]
    assert set(flag(det, "--models")) <= set(gpu_warmup.TRAIN_MODELS)
    assert int(flag(det, "--batch-size", ["128"])[0]) == gpu_warmup.TRAIN_BATCH
    ddp_batch = int(flag(steps["ddp-smoke"], "--batch-size", ["32"])[0])
    assert ("qsv", ddp_batch) in gpu_warmup.OTHER_BATCHES


def test_no_pytest_step_stops_at_the_first_failure(dry_run):
    for name, _, cmd in _steps(dry_run[1]):
        if cmd[1:3] == ["-m", "pytest"]:
            assert "-x" not in cmd and "--exitfirst" not in cmd, name


def test_python_variable_chooses_the_interpreter(tmp_path):
    proc = _dry_run(tmp_path, "warmup", PYTHON="/opt/py/bin/python")
    lines = [l for l in proc.stdout.splitlines() if LINE.match(l)]
    assert proc.returncode == 0 and lines
    for line in lines:
        cmd = shlex.split(LINE.match(line)["cmd"])
        assert cmd[0] in ("/opt/py/bin/python", "nvidia-smi"), line


def test_one_phase_alone_and_bad_arguments(tmp_path):
    proc = _dry_run(tmp_path, "measure")
    assert proc.returncode == 0 and proc.stdout.startswith("phase measure ")
    assert "phase warmup" not in proc.stdout
    bad = subprocess.run(["bash", str(BENCH / "run_gpu.sh"), "everything"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1


def test_every_listed_command_exists_and_its_flags_parse(dry_run, monkeypatch):
    steps = _steps(dry_run[1])
    checked = []
    for name, _, cmd in steps:
        if cmd[0] == "nvidia-smi":
            continue
        assert cmd[0] == "python3", (name, cmd)  # the GPU image has no `python`
        if cmd[1:3] == ["-m", "pytest"]:
            args = cmd[3:]
            for path in [a for a in args if not a.startswith("-") and "/" in a or a == "tests"]:
                assert (REPO / path).exists(), (name, path)
            if "-m" in args:  # the marker expression uses registered markers only
                marker = args[args.index("-m") + 1]
                assert f'"{marker}:' in (REPO / "pyproject.toml").read_text(), marker
            assert "-x" not in args, name
            continue
        if cmd[1:3] == ["-m", "torch.distributed.run"]:
            i = next(i for i, a in enumerate(cmd) if a.endswith(".py"))
            script, argv = REPO / cmd[i], cmd[i + 1:]
        else:
            script, argv = REPO / cmd[1], cmd[2:]
        assert script.exists(), (name, script)
        with monkeypatch.context() as patch:
            parse_flags(script, argv, patch)
        checked.append(name)
    assert {"warmup", "conv-fp32", "train-compiled-bf16", "epoch-paper-qsv", "ddp-smoke",
            "determinism", "report"} <= set(checked)


def test_the_report_reads_what_the_steps_write(dry_run):
    out, phases = dry_run
    steps = _steps(phases)
    written = {Path(cmd[cmd.index("--out") + 1]).name for _, _, cmd in steps if "--out" in cmd}
    written |= {Path(a.split("=", 1)[1]).name for _, _, cmd in steps for a in cmd
                if a.startswith("--filename=")}
    read = set(gpu_report.input_files()) - {"steps.tsv"}  # steps.tsv: the script's own
    assert read <= written, f"the report reads files no step writes: {sorted(read - written)}"


def _conv_payload(qsv_ms, gat_ms, qsv_mib, gat_mib):
    rows = [{"graph": g, "n": n, "k": 16, "layers": {
        "qsv": {"fwd_bwd_ms": qsv_ms, "saved_mib": qsv_mib},
        "gat": {"fwd_bwd_ms": gat_ms, "saved_mib": gat_mib}}}
        for g in ("knn", "random") for n in (4096, 16384, 65536)]
    return {"results": rows}


def test_report_verdicts_and_unmeasured_steps(tmp_path):
    (tmp_path / "steps.tsv").write_text(
        "step\trc\tseconds\tlimit\ncuda-tests\t0\t20\t50\nconv-fp32\t0\t30\t45\n"
        "conv-bf16\t124\t45\t45\ntrain-eager-fp32\t0\t20\t30\ntrain-compiled-fp32\t0\t40\t45\n"
        "epoch-paper-qsv\t0\t50\t60\n")
    (tmp_path / "gpu.txt").write_text("name, memory.total [MiB], driver_version\n"
                                      "NVIDIA H200, 143771 MiB, 550.54\n")
    (tmp_path / "conv-fp32.json").write_text(json.dumps(_conv_payload(1.0, 4.0, 1.0, 8.0)))
    train = {"qsv": {"train_images_per_s": 1000.0}, "resnet20": {"train_images_per_s": 500.0}}
    (tmp_path / "train-eager-fp32.json").write_text(json.dumps({"results": train}))
    (tmp_path / "train-compiled-fp32.json").write_text(json.dumps({"results": {
        "qsv": {"train_images_per_s": 1200.0}, "resnet20": {"train_images_per_s": 400.0}}}))
    (tmp_path / "epoch-paper-qsv.json").write_text(json.dumps({"result": {
        "epoch_s_50k": 12.5, "warm_epoch_s": 12.5, "cold_epoch_s_50k": 15.0, "eval_s": 1.0,
        "synthetic_data": True}}))
    summary = gpu_report.report(tmp_path)
    verdicts = {row["check"]: row["verdict"] for row in summary["checks"]}
    assert verdicts["QSVConv time ÷ GATConv, kNN + random, N ≥ 16k, fp32"] == "met"
    assert verdicts["QSVConv activation memory ÷ GATConv, kNN + random, N ≥ 16k, fp32"] == "met"
    assert "limit" in verdicts["QSVConv time ÷ GATConv, kNN + random, N ≥ 16k, bf16"]
    assert verdicts["one CIFAR-10 epoch of paper-qsv (NVIDIA H200)"] == "met"
    assert verdicts["compiled ≥ eager training throughput, every compiled model, fp32"] \
        == "missed"
    assert verdicts["CUDA tests (pytest -m cuda)"] == "met"
    assert verdicts["deterministic mode: two runs bit-identical"].startswith("unmeasured")
    assert verdicts["DDP smoke test (NCCL, 2 steps)"].startswith("unmeasured")
    text = (tmp_path / "summary.md").read_text()
    assert "| check | measured | target | verdict |" in text and "resnet20" in text
    assert json.loads((tmp_path / "summary.json").read_text())["gpu"] == "NVIDIA H200"
    assert not any("one operator" in check for check in verdicts)  # no qsv-composed rows


def test_report_the_one_operators_gain(tmp_path):
    """With ``qsv-composed`` beside ``qsv`` the report states the one operator's
    ratio to the composed layer (informational: no target)."""
    payload = _conv_payload(1.0, 4.0, 1.0, 8.0)
    for row in payload["results"]:
        row["layers"]["qsv-composed"] = {"fwd_bwd_ms": 2.0 if row["n"] > 16384 else 4.0,
                                         "saved_mib": 1.25}
    (tmp_path / "steps.tsv").write_text("step\trc\tseconds\tlimit\nconv-fp32\t0\t30\t45\n")
    (tmp_path / "conv-fp32.json").write_text(json.dumps(payload))
    rows = {row["check"]: row for row in gpu_report.report(tmp_path)["checks"]}
    time = rows["QSVConv time: one operator ÷ composed, N ≥ 16k, fp32"]
    assert time["measured"] == "0.25–0.50× over 4 graphs" and time["verdict"] == "measured"
    memory = rows["QSVConv activation memory: one operator ÷ composed, N ≥ 16k, fp32"]
    assert memory["measured"] == "0.80–0.80× over 4 graphs"


def test_report_joins_the_two_phases_folders(tmp_path):
    """The phases' folders came back apart ($OUT is emptied before each command):
    one report over both, written into the last."""
    first, second = tmp_path / "warmup", tmp_path / "measure"
    first.mkdir()
    second.mkdir()
    (first / "steps.tsv").write_text("step\trc\tseconds\tlimit\tphase\n"
                                     "warmup\t0\t80\t120\twarmup\ncuda-tests\t1\t60\t90\twarmup\n")
    (first / "warmup.json").write_text(json.dumps(
        {"runs": {"conv qsv fp32": {"seconds": 1.0}}, "seconds": 80.0, "failed": []}))
    (first / "conv-fp32.json").write_text(json.dumps(_conv_payload(1.0, 1.5, 1.0, 8.0)))
    (second / "steps.tsv").write_text("step\trc\tseconds\tlimit\tphase\n"
                                      "determinism\t0\t30\t40\tmeasure\n")
    (second / "determinism.json").write_text(json.dumps({"results": {
        "qsv": {"identical": True}}}))
    assert gpu_report.main([str(first), str(second)]) == 0
    summary = json.loads((second / "summary.json").read_text())
    verdicts = {row["check"]: row["verdict"] for row in summary["checks"]}
    assert verdicts["warm-up: every configuration's Triton kernels compiled before timing"] \
        == "met"
    assert verdicts["CUDA tests (pytest -m cuda)"] == "missed"
    assert verdicts["QSVConv time ÷ GATConv, kNN + random, N ≥ 16k, fp32"] == "missed"
    assert verdicts["deterministic mode: two runs bit-identical"] == "met"
    assert summary["steps"]["warmup"]["phase"] == "warmup"
    assert "| warmup | warmup | 0 | 80 | 120 |" in (second / "summary.md").read_text()
    assert not (first / "summary.json").exists()


def test_report_refuses_a_missing_folder(tmp_path, capsys):
    assert gpu_report.main([str(tmp_path / "nowhere")]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
