"""benchmarks/run_gpu.sh cannot rot: its dry run lists every step, every listed
command's script exists and accepts its flags, the limits fit in 8 minutes, and
the report reads exactly the files the steps write."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
sys.path.insert(0, str(BENCH))

import gpu_report  # noqa: E402

EXPECTED = ["gpu-info", "cuda-tests", "conv-fp32", "conv-bf16", "train-eager-fp32",
            "train-eager-bf16", "train-compiled-fp32", "train-compiled-bf16", "epoch-paper-qsv",
            "ddp-smoke", "determinism", "report"]
if (REPO / "tests" / "test_triton_kernel.py").exists():
    EXPECTED.insert(2, "triton-tests")
LINE = re.compile(r"^step (?P<name>[\w-]+) (?P<limit>\d+)s: (?P<cmd>.+)$")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-out")
    proc = subprocess.run(["bash", str(BENCH / "run_gpu.sh"), "--dry-run"], cwd=REPO,
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "OUT": str(out), "PYTHON": "python"})
    assert proc.returncode == 0, proc.stderr
    steps = []
    for line in proc.stdout.splitlines():
        m = LINE.match(line)
        assert m, f"not a step line: {line!r}"
        steps.append((m["name"], int(m["limit"]), shlex.split(m["cmd"])))
    assert not out.exists() or not any(out.iterdir()), "--dry-run must not write anything"
    return out, steps


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


def test_dry_run_lists_every_step_within_eight_minutes(dry_run):
    _, steps = dry_run
    assert [name for name, _, _ in steps] == EXPECTED
    total = sum(limit for _, limit, _ in steps)
    assert total <= 470, f"step limits add up to {total} s (8 minutes = 480 s)"
    text = (BENCH / "run_gpu.sh").read_text()
    assert "timeout" in text and "--dry-run" in text


def test_every_listed_command_exists_and_its_flags_parse(dry_run, monkeypatch):
    _, steps = dry_run
    checked = []
    for name, _, cmd in steps:
        if cmd[0] == "nvidia-smi":
            continue
        assert cmd[0] == "python", (name, cmd)
        if cmd[1:3] == ["-m", "pytest"]:
            args = cmd[3:]
            for path in [a for a in args if not a.startswith("-") and "/" in a or a == "tests"]:
                assert (REPO / path).exists(), (name, path)
            if "-m" in args:  # the marker expression uses registered markers only
                marker = args[args.index("-m") + 1]
                assert f'"{marker}:' in (REPO / "pyproject.toml").read_text(), marker
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
    assert {"conv-fp32", "train-compiled-bf16", "epoch-paper-qsv", "ddp-smoke", "determinism",
            "report"} <= set(checked)


def test_the_report_reads_what_the_steps_write(dry_run):
    out, steps = dry_run
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
    assert verdicts["compiled ≥ eager training throughput, every model, fp32"] == "missed"
    assert verdicts["CUDA tests (pytest -m cuda)"] == "met"
    assert verdicts["deterministic mode: two runs bit-identical"].startswith("unmeasured")
    assert verdicts["DDP smoke test (NCCL, 2 steps)"].startswith("unmeasured")
    text = (tmp_path / "summary.md").read_text()
    assert "| check | measured | target | verdict |" in text and "resnet20" in text
    assert json.loads((tmp_path / "summary.json").read_text())["gpu"] == "NVIDIA H200"
