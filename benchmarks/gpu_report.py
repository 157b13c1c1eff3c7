"""Verdicts of a ``benchmarks/run_gpu.sh`` run: one summary table and ``summary.json``.

    python3 benchmarks/gpu_report.py benchmarks/out/gpu
    python3 benchmarks/gpu_report.py WARMUP_FOLDER MEASURE_FOLDER   # two phases' folders

With several folders (the two phases' results, when they came back apart) the
files are read from the last folder that has them, the steps of all are joined,
and the summary is written into the last folder.

Reads the JSON files the steps wrote (and ``steps.tsv``: every step's exit
status and seconds) and judges the GPU targets:

* conv: QSVConv (``qsv``) forward+backward ≤ 0.5× GATConv's time and activation
  memory (bytes saved for backward) ≤ 0.25× GATConv's, on every kNN and random
  graph with N ≥ 16k, in fp32 and in bf16;
* one CIFAR-10 epoch of ``paper-qsv`` ≤ 20 s (an H100/H200 target);
* compiled training throughput ≥ eager, every model the compiled step ran,
  fp32 and bf16;
* deterministic mode: two identical runs bit-identical, per model;
* the CUDA tests pass and the DDP (NCCL) smoke test runs.

A check whose file is missing (its step failed or ran out of time) is
``unmeasured``, with the step's status.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Dict, List, Optional

MIN_N = 16_384
CONV_TIME_BOUND, CONV_MEMORY_BOUND = 0.5, 0.25
EPOCH_BOUND_S = 20.0
PRECISIONS = ("fp32", "bf16")


def input_files() -> List[str]:
    """Every file the report reads (``steps.tsv`` from run_gpu.sh, the rest from its steps)."""
    return (["steps.tsv", "gpu.txt", "warmup.json", "epoch-paper-qsv.json", "determinism.json",
             "ddp.json"]
            + [f"conv-{p}.json" for p in PRECISIONS]
            + [f"train-{m}-{p}.json" for m in ("eager", "compiled") for p in PRECISIONS])


class Folders:
    """One or more output folders read as one: a file from the last that has it."""

    def __init__(self, folders):
        self.folders = [Path(f) for f in (folders if isinstance(folders, (list, tuple))
                                          else [folders])]

    def path(self, name: str) -> Path:
        for folder in reversed(self.folders):
            if (folder / name).exists():
                return folder / name
        return self.folders[-1] / name

    def __truediv__(self, name: str) -> Path:
        return self.path(name)

    def __str__(self) -> str:
        return " + ".join(str(f) for f in self.folders)


def _load(folder, name: str) -> Optional[dict]:
    path = folder / name
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_steps(folder) -> Dict[str, dict]:
    """``name -> {rc, seconds, budget, phase}`` from ``steps.tsv`` (of every
    folder, later ones last; a step run again keeps its last line)."""
    folders = folder.folders if isinstance(folder, Folders) else [Path(folder)]
    steps: Dict[str, dict] = {}
    for f in folders:
        path = f / "steps.tsv"
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            parts = line.split("\t")
            if len(parts) in (4, 5) and parts[0] != "step":
                steps[parts[0]] = {"rc": int(parts[1]), "seconds": float(parts[2]),
                                   "budget": float(parts[3]),
                                   "phase": parts[4] if len(parts) == 5 else ""}
    return steps


def _status(steps: Dict[str, dict], step: str) -> str:
    s = steps.get(step)
    if s is None:
        return f"unmeasured (step {step} did not run)"
    if s["rc"] in (124, 137):
        return f"unmeasured (step {step} hit its {s['budget']:.0f} s limit)"
    if s["rc"] != 0:
        return f"unmeasured (step {step} failed, exit {s['rc']})"
    return f"unmeasured (step {step} wrote no result)"


def _row(check: str, measured: str, target: str, verdict: str) -> dict:
    return {"check": check, "measured": measured, "target": target, "verdict": verdict}


def conv_checks(folder: Path, steps: Dict[str, dict]) -> List[dict]:
    rows = []
    for prec in PRECISIONS:
        step = f"conv-{prec}"
        payload = _load(folder, f"{step}.json")
        for what, key, bound in (("time", "fwd_bwd_ms", CONV_TIME_BOUND),
                                 ("activation memory", "saved_mib", CONV_MEMORY_BOUND)):
            check = f"QSVConv {what} ÷ GATConv, kNN + random, N ≥ 16k, {prec}"
            target = f"≤ {bound}× on every graph"
            if payload is None:
                rows.append(_row(check, "-", target, _status(steps, step)))
                continue
            ratios, missing = [], []
            for r in payload["results"]:
                if r.get("graph") not in ("knn", "random") or r["n"] < MIN_N:
                    continue
                t = r["layers"]
                if "qsv" in t and "gat" in t and t["gat"].get(key):
                    ratios.append((t["qsv"][key] / t["gat"][key], f"{r['graph']} N={r['n']} "
                                                                  f"k={r['k']}"))
                else:
                    missing.append(f"{r['graph']} N={r['n']} k={r['k']}")
            if not ratios:
                rows.append(_row(check, "no graph measured " + "; ".join(missing), target,
                                 "unmeasured (layers failed: see the JSON's errors)"))
                continue
            worst, where = max(ratios)
            within = sum(x <= bound for x, _ in ratios)
            ok = within == len(ratios) and not missing
            measured = (f"worst {worst:.2f}× ({where}), {within}/{len(ratios)} graphs within"
                        + (f"; not measured: {', '.join(missing)}" if missing else ""))
            rows.append(_row(check, measured, target, "met" if ok else "missed"))
        if payload is not None:
            rows += operator_gain(payload, prec)
    return rows


def operator_gain(payload: dict, prec: str) -> List[dict]:
    """What the one operator of the layer (``qsv``) gains over the same layer
    composed (``qsv-composed``: ``QSV_PYG_FUSED_LAYER=0``), time and activation
    memory, graphs with N ≥ 16k; informational (no target). Empty when the step
    did not run both."""
    rows = []
    for what, key in (("time", "fwd_bwd_ms"), ("activation memory", "saved_mib")):
        ratios = sorted(r["layers"]["qsv"][key] / r["layers"]["qsv-composed"][key]
                        for r in payload["results"]
                        if r.get("graph") in ("knn", "random") and r["n"] >= MIN_N
                        and "qsv" in r["layers"] and "qsv-composed" in r["layers"]
                        and r["layers"]["qsv-composed"].get(key))
        if ratios:
            rows.append(_row(f"QSVConv {what}: one operator ÷ composed, N ≥ 16k, {prec}",
                             f"{ratios[0]:.2f}–{ratios[-1]:.2f}× over {len(ratios)} graphs",
                             "(no target: the gain of qsv_pyg::attend_layer)", "measured"))
    return rows


def epoch_check(folder: Path, steps: Dict[str, dict], gpu: str) -> dict:
    payload = _load(folder, "epoch-paper-qsv.json")
    check = f"one CIFAR-10 epoch of paper-qsv ({gpu or 'GPU'})"
    target = f"≤ {EPOCH_BOUND_S:.0f} s (H100/H200)"
    if payload is None or not payload["result"].get("epoch_s_50k"):
        return _row(check, "-", target, _status(steps, "epoch-paper-qsv"))
    r = payload["result"]
    kind = "warm" if "warm_epoch_s" in r else "cold (an upper bound)"
    parts = [f"{r['epoch_s_50k']:.1f} s {kind}"]
    if r.get("cold_epoch_s_50k") and "warm_epoch_s" in r:
        parts.append(f"first epoch {r['cold_epoch_s_50k']:.1f} s")
    if "eval_s" in r:
        parts.append(f"+ {r['eval_s']:.1f} s evaluation")
    parts.append("synthetic data" if r.get("synthetic_data") else "CIFAR-10")
    ok = r["epoch_s_50k"] <= EPOCH_BOUND_S
    return _row(check, "; ".join(parts), target, "met" if ok else "missed")


def train_checks(folder: Path, steps: Dict[str, dict]) -> List[dict]:
    rows = []
    for prec in PRECISIONS:
        eager = _load(folder, f"train-eager-{prec}.json")
        compiled = _load(folder, f"train-compiled-{prec}.json")
        check = f"compiled ≥ eager training throughput, every compiled model, {prec}"
        target = "≥ 1.0× per model"
        if eager is None or compiled is None:
            which = f"train-eager-{prec}" if eager is None else f"train-compiled-{prec}"
            rows.append(_row(check, "-", target, _status(steps, which)))
            continue
        e, c = eager["results"], compiled["results"]
        # The models the compiled step was asked for (run_gpu.sh compiles a subset:
        # a cold inductor cache takes tens of seconds a model); older files: all.
        asked = (compiled.get("args") or {}).get("models") or list(e)
        pairs = {m: c[m]["train_images_per_s"] / e[m]["train_images_per_s"]
                 for m in asked if m in c and m in e}
        missing = [m for m in asked if m not in c]
        if not pairs:
            rows.append(_row(check, "-", target, _status(steps, f"train-compiled-{prec}")))
            continue
        measured = ", ".join(f"{m} {x:.2f}×" for m, x in pairs.items())
        if missing:
            measured += f"; not compiled in time: {', '.join(missing)}"
        left_out = [m for m in e if m not in asked]
        if left_out:
            measured += f"; not in the compiled step: {', '.join(left_out)}"
        ok = all(x >= 1.0 for x in pairs.values()) and not missing
        rows.append(_row(check, measured, target, "met" if ok else "missed"))
    return rows


def determinism_check(folder: Path, steps: Dict[str, dict]) -> dict:
    payload = _load(folder, "determinism.json")
    check = "deterministic mode: two runs bit-identical"
    target = "identical weights and logs, every model"
    if payload is None:
        return _row(check, "-", target, _status(steps, "determinism"))
    res = payload["results"]
    parts = []
    for m, r in res.items():
        if r.get("error"):
            parts.append(f"{m}: raised {r['error'][:120]}")
        elif r["identical"]:
            parts.append(f"{m}: identical")
        else:
            parts.append(f"{m}: {r['differing_tensors']}/{r['tensors']} tensors differ "
                         f"(max {r['max_abs_diff']:.1e})")
    ok = all(r.get("identical") for r in res.values())
    return _row(check, "; ".join(parts), target, "met" if ok else "missed")


def status_check(steps: Dict[str, dict], step: str, check: str, target: str,
                 folder: Path, result: Optional[str] = None) -> dict:
    s = steps.get(step)
    if s is None:
        return _row(check, "-", target, _status(steps, step))
    measured = f"exit {s['rc']} in {s['seconds']:.0f} s"
    if result:
        payload = _load(folder, result)
        if payload:
            measured += f"; {json.dumps({k: payload[k] for k in ('backend', 'world_size', 'losses') if k in payload})}"
    verdict = "met" if s["rc"] == 0 else ("unmeasured (time limit)" if s["rc"] in (124, 137)
                                         else "missed")
    return _row(check, measured, target, verdict)


def throughput_table(folder: Path) -> List[str]:
    """images/s per model: eager and compiled, fp32 and bf16."""
    cols = [(f"{mode} {prec}", f"train-{mode}-{prec}.json") for prec in PRECISIONS
            for mode in ("eager", "compiled")]
    data = {label: (_load(folder, name) or {}).get("results", {}) for label, name in cols}
    models = list(dict.fromkeys(m for d in data.values() for m in d))
    if not models:
        return []
    out = ["| model (train img/s) | " + " | ".join(label for label, _ in cols) + " |",
           "|---|" + "---:|" * len(cols)]
    for m in models:
        out.append(f"| {m} | " + " | ".join(
            f"{data[label][m]['train_images_per_s']:.0f}" if m in data[label] else "-"
            for label, _ in cols) + " |")
    return out


def warmup_check(folder, steps: Dict[str, dict]) -> dict:
    payload = _load(folder, "warmup.json")
    check = "warm-up: every configuration's Triton kernels compiled before timing"
    target = "every configuration runs"
    if payload is None:
        return _row(check, "-", target, _status(steps, "warmup"))
    failed = payload.get("failed", [])
    measured = f"{len(payload.get('runs', {}))} configurations in {payload.get('seconds')} s"
    if failed:
        measured += f"; failed: {', '.join(failed)}"
    return _row(check, measured, target, "missed" if failed else "met")


def report(folder) -> dict:
    folder = folder if isinstance(folder, Folders) else Folders(folder)
    steps = read_steps(folder)
    gpu = ""
    gpu_txt = folder / "gpu.txt"
    if gpu_txt.exists():
        lines = gpu_txt.read_text().splitlines()
        gpu = lines[1].split(",")[0].strip() if len(lines) > 1 else ""
    rows = [warmup_check(folder, steps),
            status_check(steps, "cuda-tests", "CUDA tests (pytest -m cuda)", "all pass", folder)]
    if "triton-tests" in steps:
        rows.append(status_check(steps, "triton-tests", "Triton kernel tests on the GPU",
                                 "all pass", folder))
    rows += conv_checks(folder, steps)
    rows.append(epoch_check(folder, steps, gpu))
    rows += train_checks(folder, steps)
    rows.append(determinism_check(folder, steps))
    rows.append(status_check(steps, "ddp-smoke", "DDP smoke test (NCCL, 2 steps)", "runs",
                             folder, "ddp.json"))
    lines = [f"GPU: {gpu or 'unknown'}; folder {folder}", "",
             "| check | measured | target | verdict |", "|---|---|---|---|"]
    lines += [f"| {r['check']} | {r['measured']} | {r['target']} | {r['verdict']} |"
              for r in rows]
    table = throughput_table(folder)
    if table:
        lines += ["", *table]
    if steps:
        lines += ["", "| step | phase | exit | seconds | limit |", "|---|---|---:|---:|---:|"]
        lines += [f"| {k} | {v['phase']} | {v['rc']} | {v['seconds']:.0f} | "
                  f"{v['budget']:.0f} |" for k, v in steps.items()]
    text = "\n".join(lines)
    summary = {"gpu": gpu, "checks": rows, "steps": steps}
    target = folder.folders[-1]
    write_text_atomic(target / "summary.md", text + "\n")
    write_text_atomic(target / "summary.json", json.dumps(summary, indent=2) + "\n")
    print(text)
    return summary


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder", nargs="+",
                        help="the output folder of benchmarks/run_gpu.sh (or one per phase)")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    missing = [f for f in args.folder if not Path(f).is_dir()]
    if missing:
        print(f"gpu_report: no such folder: {', '.join(missing)}", file=sys.stderr)
        return 2
    report(Folders(args.folder))
    return 0


if __name__ == "__main__":
    sys.exit(main())
