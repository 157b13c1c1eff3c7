"""End-to-end throughput of every model of the pipeline, measured side by side.

For each model at its default (parameter-matched) size and one common batch:
images/s of full training steps (forward, loss incl. auxiliary terms, backward,
optimizer step) and of inference, memory, and — for the graph models — the share
of time per stage (embedding, cross-shell blocks, within-shell blocks, head),
each stage timed forward+backward on its own captured inputs.

Examples::

    python benchmarks/bench_train.py                      # all models, batch 64, CPU
    python benchmarks/bench_train.py --quick              # batch 16, fewer repeats
    python benchmarks/bench_train.py --device cuda --batch-size 256 --amp bf16 --compile
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Dict, List

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info, median_time, memory_of, resolve_device, write_json  # noqa: E402

from qsv_pyg.models import build_model  # noqa: E402
from qsv_pyg.training.optim import build_optimizer  # noqa: E402

MODELS = ("qsv", "attention-gat", "attention-gatv2", "attention-transformer", "lattice",
          "resnet20")
AMP = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(device: torch.device, amp: str):
    if AMP[amp] is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=AMP[amp])


def stage_modules(model: torch.nn.Module) -> Dict[str, List[torch.nn.Module]]:
    """The pipeline stages of a GraphNet (empty for other models)."""
    if not hasattr(model, "cross"):
        return {}
    return {"embedding": [model.embed], "cross-shell blocks": list(model.cross),
            "within-shell blocks": list(model.within), "head": [model.norm, model.head]}


def stage_times(model, images, device, repeats) -> Dict[str, float]:
    """Forward+backward ms of each stage, on the inputs it sees in a real forward."""
    stages = stage_modules(model)
    captured = {}
    handles = []
    for mods in stages.values():
        for m in mods:
            def hook(mod, args, kwargs, out, _m=m):
                captured[id(_m)] = (args, kwargs)
            handles.append(m.register_forward_hook(hook, with_kwargs=True))
    with torch.no_grad():
        model(images)
    for h in handles:
        h.remove()

    def prep(a):
        if torch.is_tensor(a) and a.is_floating_point():
            return a.detach().requires_grad_(True)
        if isinstance(a, tuple):
            return tuple(prep(t) for t in a)
        return a

    out = {}
    for name, mods in stages.items():
        inputs = [(m, [prep(a) for a in captured[id(m)][0]],
                   {k: prep(v) for k, v in captured[id(m)][1].items()}) for m in mods]

        def run():
            for m, args, kwargs in inputs:
                y = m(*args, **kwargs)
                y.float().sum().backward()
        out[name] = 1e3 * median_time(run, device, repeats)
    return out


def bench_model(name: str, args, device: torch.device) -> dict:
    torch.manual_seed(0)
    model = build_model(name, num_classes=10).to(device)
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.05)
    if args.compile:  # a recompile per block shape, as in the trainer
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    run_model = torch.compile(model) if args.compile else model
    gen = torch.Generator().manual_seed(0)
    images = torch.randn(args.batch_size, 3, 32, 32, generator=gen).to(device)
    labels = torch.randint(0, 10, (args.batch_size,), generator=gen).to(device)
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")

    def loss_fn():
        with autocast(device, args.amp):
            logits = run_model(images)
            return F.cross_entropy(logits.float(), labels) + model.auxiliary_loss()

    def train_step():
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss_fn()).backward()
        scaler.step(opt)
        scaler.update()

    def infer():
        with torch.no_grad(), autocast(device, args.amp):
            run_model(images)

    model.train()
    t_train = median_time(train_step, device, args.repeats, warmup=args.warmup)
    model.eval()
    t_infer = median_time(infer, device, args.repeats, warmup=args.warmup)
    model.train()
    opt.zero_grad(set_to_none=True)
    mem = memory_of(loss_fn, device)
    res = {
        "params": sum(p.numel() for p in model.parameters()),
        "train_ms_per_step": 1e3 * t_train,
        "train_images_per_s": args.batch_size / t_train,
        "infer_images_per_s": args.batch_size / t_infer,
        **mem,
    }
    if stage_modules(model) and not args.no_stages:
        st = stage_times(model, images, device, max(3, args.repeats // 2))
        total = sum(st.values())
        res["stages_ms"] = st
        res["stage_share"] = {k: v / total for k, v in st.items()}
    return res


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--amp", default="none", choices=list(AMP))
    parser.add_argument("--compile", action="store_true", help="torch.compile each model")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-stages", action="store_true")
    parser.add_argument("--quick", action="store_true", help="batch 16, 3 repeats")
    parser.add_argument("--out", default="benchmarks/out/bench_train.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.batch_size, args.repeats, args.warmup = 16, 3, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    if args.amp != "none" and device.type != "cuda":
        parser.error("--amp needs a CUDA device")

    from tqdm import tqdm
    results = {}
    for name in tqdm(args.models, desc="models"):
        results[name] = bench_model(name, args, device)
        # Written after every model: a run cut short by a time limit keeps what it measured.
        write_json(args.out, {"args": vars(args), "machine": machine_info(device),
                              "results": results, "partial": len(results) < len(args.models)})

    mem_key = "peak_mib" if device.type == "cuda" else "saved_mib"
    ref = results.get("qsv")
    print(f"\nbatch={args.batch_size} device={device} amp={args.amp} compile={args.compile} "
          f"threads={torch.get_num_threads()}")
    print("| model | params | train img/s | infer img/s | qsv train speed-up vs model "
          f"| {mem_key} |\n|---|---|---|---|---|---|")
    for name, r in results.items():
        ratio = f"{ref['train_images_per_s'] / r['train_images_per_s']:.2f}x" if ref else "-"
        print(f"| {name} | {r['params'] / 1e6:.3f}M | {r['train_images_per_s']:.1f} | "
              f"{r['infer_images_per_s']:.1f} | {ratio} | {r[mem_key]:.1f} |")
    for name, r in results.items():
        if "stage_share" in r:
            shares = ", ".join(f"{k} {100 * v:.0f}%" for k, v in r["stage_share"].items())
            print(f"stage share ({name}, fwd+bwd): {shares}")

    payload = {"args": vars(args), "machine": machine_info(device), "results": results,
               "partial": False}
    write_json(args.out, payload)
    print(f"\nwrote {args.out}")
    return payload


if __name__ == "__main__":
    main()
