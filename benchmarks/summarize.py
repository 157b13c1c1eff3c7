"""Markdown tables (and target verdicts) from recorded benchmark JSON files.

    python benchmarks/summarize.py benchmarks/results/<run>/bench_conv_cpu.json
    python benchmarks/summarize.py benchmarks/results/<run>/*.json > summary.md

Used to write benchmarks/README.md from what was measured, never by hand.
"""
from __future__ import annotations

import json
import statistics
import sys
from typing import Dict, List

# Upper bounds on QSVConv's forward+backward time as a multiple of another
# layer's, per graph family (issue 11): attention peers on every graph, the bare
# SpMM floor on kNN graphs, torch-harmonics' neighbourhood attention on its grids.
CONV_TARGETS = {
    "knn": {"gat": 0.8, "transformer": 0.5, "spmm": 3.0},
    "random": {"gat": 0.8, "transformer": 0.5},
    "s2": {"nattn-s2": 0.3},
}


def _graph(row: dict) -> str:
    return row.get("graph", "knn")  # files written before the families existed


def conv_tables(payload: dict) -> str:
    rows = payload["results"]
    layers = list(dict.fromkeys(x for r in rows for x in r["layers"]))
    out: List[str] = []
    m = payload["machine"]
    out.append(f"Machine: {m.get('cpu', m.get('gpu', m.get('processor')))}; torch "
               f"{m['torch']}, torch_geometric {m['torch_geometric']}, "
               f"{m['torch_threads']} thread(s), device {m['device']}. "
               f"Channels {payload['args']['channels']}, heads {payload['args']['heads']}.")

    def cell(t: dict, x: str, key: str) -> str:
        return f"{t[x][key]:.2f}" if x in t else "-"

    for key, title in (("fwd_bwd_ms", "forward + backward"), ("forward_ms", "forward only")):
        out.append(f"\n{title} (median ms; `qsv/X` < 1 means QSVConv is faster)\n")
        head = ["graph", "N", "k"] + layers + [f"qsv/{x}" for x in layers if x != "qsv"]
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "---|" * len(head))
        for r in rows:
            t = r["layers"]
            cells = [_graph(r), str(r["n"]), str(r["k"])] + [cell(t, x, key) for x in layers]
            cells += [f"{t['qsv'][key] / t[x][key]:.2f}" if x in t else "-"
                      for x in layers if x != "qsv"]
            out.append("| " + " | ".join(cells) + " |")
    mem = "peak_mib" if "peak_mib" in rows[0]["layers"]["qsv"] else "saved_mib"
    out.append(f"\nmemory ({'CUDA peak' if mem == 'peak_mib' else 'saved for backward'}, MiB)\n")
    out.append("| graph | N | k | " + " | ".join(layers) + " |")
    out.append("|" + "---|" * (len(layers) + 3))
    for r in rows:
        t = r["layers"]
        out.append(f"| {_graph(r)} | {r['n']} | {r['k']} | "
                   + " | ".join(f"{t[x][mem]:.1f}" if x in t else "-" for x in layers) + " |")
    out.append("\nTargets (forward + backward, worst over each family's graphs):\n")
    out.extend(conv_verdicts(rows))
    return "\n".join(out)


def conv_verdicts(rows: List[dict]) -> List[str]:
    """One line per (family, QSVConv mode, peer) target, and linearity in N·k."""
    out: List[str] = []
    # "qsv": quaternions from the features (the drop-in layer); "qsv-field":
    # given per-node quaternions (the models' mode). Both are QSVConv.
    for family, bounds in CONV_TARGETS.items():
        fam = [r for r in rows if _graph(r) == family]
        for mode in ("qsv", "qsv-field"):
            for other, bound in bounds.items():
                pairs = [r["layers"] for r in fam if mode in r["layers"] and other in r["layers"]]
                if not pairs:
                    continue
                ratios = [t[mode]["fwd_bwd_ms"] / t[other]["fwd_bwd_ms"] for t in pairs]
                met = max(ratios) <= bound
                out.append(f"- {family}: QSVConv ({mode}) ≤ {bound}× {other}: median "
                           f"{statistics.median(ratios):.2f}×, worst {max(ratios):.2f}× — "
                           f"{'met' if met else 'NOT met'}"
                           + ("" if met else f" ({sum(x <= bound for x in ratios)}/"
                                             f"{len(ratios)} graphs within)"))
    for mode in ("qsv", "qsv-field"):
        fam = [r for r in rows if _graph(r) == "knn" and mode in r["layers"]]
        for k in sorted({r["k"] for r in fam}):
            sub = sorted((r for r in fam if r["k"] == k), key=lambda r: r["n"])
            per_edge = [1e3 * r["layers"][mode]["fwd_bwd_ms"] / (r["n"] * k) for r in sub]
            mean = statistics.fmean(per_edge)
            spread = max(abs(p / mean - 1) for p in per_edge)
            out.append(f"- {mode} linear in N·k (knn, k = {k}): µs per edge "
                       + ", ".join(f"N={r['n']}: {p:.3f}" for r, p in zip(sub, per_edge))
                       + f"; max deviation from the mean {100 * spread:.0f}% — "
                       + ("within ±20%" if spread <= 0.2 else "outside ±20%"))
    return out


def train_tables(payload: dict) -> str:
    res: Dict[str, dict] = payload["results"]
    a = payload["args"]
    m = payload["machine"]
    mem = "peak_mib" if "peak_mib" in next(iter(res.values())) else "saved_mib"
    out = [f"Machine: {m.get('cpu', m.get('gpu', m.get('processor')))}; torch {m['torch']}, "
           f"{m['torch_threads']} thread(s), device {m['device']}; batch {a['batch_size']}, "
           f"amp {a['amp']}, compile {a['compile']}.", ""]
    ref = res.get("qsv")
    out.append(f"| model | params | train img/s | infer img/s | QSV train throughput ÷ model's | {mem} |")
    out.append("|---|---:|---:|---:|---:|---:|")
    for name, r in res.items():
        ratio = f"{ref['train_images_per_s'] / r['train_images_per_s']:.2f}" if ref else "-"
        out.append(f"| {name} | {r['params'] / 1e6:.3f}M | {r['train_images_per_s']:.1f} | "
                   f"{r['infer_images_per_s']:.1f} | {ratio} | {r[mem]:.1f} |")
    for name, r in res.items():
        if "stage_share" in r:
            out.append(f"\nstage share of {name} (forward + backward): " + ", ".join(
                f"{k} {100 * v:.0f}%" for k, v in r["stage_share"].items()))
    if ref:
        out.append("")
        for other in ("attention-gat", "attention-transformer"):
            if other in res:
                ratio = ref["train_images_per_s"] / res[other]["train_images_per_s"]
                out.append(f"- QSV training throughput ≥ 1.0× {other}: {ratio:.2f}× — "
                           + ("met" if ratio >= 1.0 else "NOT met"))
    return "\n".join(out)


def generic_table(payload: dict) -> str:
    rows = payload["results"]
    keys = [k for k in rows[0] if k not in ("n", "k")]
    out = ["| N | k | " + " | ".join(keys) + " |", "|" + "---|" * (len(keys) + 2)]
    for r in rows:
        out.append(f"| {r['n']} | {r['k']} | " + " | ".join(f"{r[k]:.2f}" for k in keys) + " |")
    return "\n".join(out)


#: The side-by-side real-data benchmarks: (header, key, format) per column.
CORA_COLUMNS = (("row", "row", "{}"), ("parameters", "parameters", "{:,}"),
                ("ms/step", "step_ms", "{:.1f}"), ("vs GATConv", "vs_gatconv", "{:.2f}×"))
TU_COLUMNS = (("dataset", "dataset", "{}"), ("row", "row", "{}"),
              ("parameters", "parameters", "{:,}"), ("ms/epoch", "epoch_ms", "{:.1f}"),
              ("vs GAT", "vs_gat", "{:.2f}×"))


def rows_table(rows: List[dict], columns) -> str:
    """A markdown table of ``rows`` (bench_cora.py's and bench_tu.py's ``rows``)."""
    out = ["| " + " | ".join(h for h, _, _ in columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        out.append("| " + " | ".join(f.format(r[k]) for _, k, f in columns) + " |")
    return "\n".join(out)


def cora_table(payload: dict) -> str:
    """bench_cora.py: one training step per citation row, side by side."""
    return rows_table(payload["rows"], CORA_COLUMNS)


def tu_table(payload: dict) -> str:
    """bench_tu.py: one training epoch per TU row and set, side by side."""
    return rows_table(payload["rows"], TU_COLUMNS)


def main(paths: List[str]) -> None:
    for path in paths:
        with open(path) as f:
            payload = json.load(f)
        print(f"\n### {path}\n")
        results = payload.get("results") or payload.get("result")
        if "rows" in payload and payload["rows"] and "vs_gatconv" in payload["rows"][0]:
            print(cora_table(payload))
        elif "rows" in payload and payload["rows"] and "vs_gat" in payload["rows"][0]:
            print(tu_table(payload))
        elif isinstance(results, list) and results and "layers" in results[0]:
            print(conv_tables(payload))
        elif isinstance(results, dict) and "train_images_per_s" in next(iter(results.values()), {}):
            print(train_tables(payload))
        elif isinstance(results, list):
            print(generic_table(payload))
        else:
            print("```\n" + json.dumps(results, indent=2) + "\n```")


if __name__ == "__main__":
    main(sys.argv[1:])
