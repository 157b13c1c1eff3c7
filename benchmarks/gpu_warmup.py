"""Every Triton kernel variant that ``benchmarks/run_gpu.sh`` launches: compile
them first (on the GPU), list them or compile them for sm_90 (without one).

    python3 benchmarks/gpu_warmup.py --device cuda      # run every configuration once
    python3 benchmarks/gpu_warmup.py --list             # the variants (CPU, nothing runs)
    python3 benchmarks/gpu_warmup.py --compile-sm90     # compile each for sm_90 (no GPU)

On the GPU (``--device cuda``) the warm-up runs one forward+backward of every
configuration below at a tiny size, in float32 and under bf16 autocast: every
kernel variant the later steps launch is then compiled and in Triton's cache
(``TRITON_CACHE_DIR``) before anything is timed, so the timed steps' limits do
not have to absorb 0.4-1.8 s of compile per variant.

A *variant* is a kernel with its constexpr arguments and the dtypes of its
tensor arguments (what Triton compiles once). :func:`record_variants` finds
them on the CPU without running a kernel: the Triton path is taken through the
interpreter's dispatch (``QSV_PYG_TRITON=interpret``) and each launch is
recorded instead of executed. ``--compile-sm90`` compiles every recorded
variant for Hopper through ``triton.compile(ASTSource(...),
target=GPUTarget("cuda", 90, 32))``, as CI does for a subset
(``tests/test_gpu_variants.py``).

The configurations (:data:`CONV_LAYERS` with :data:`CONV_CHANNELS` /
:data:`CONV_HEADS`, :data:`TRAIN_MODELS`) are the ones run_gpu.sh passes to
``bench_conv.py`` and ``bench_train.py``; ``tests/test_gpu_script.py`` checks
that the two agree.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from qsv_pyg.nn import triton_kernel as tk  # noqa: E402
from qsv_pyg.nn import triton_tuning as tt  # noqa: E402

#: bench_conv.py's QSV layers, channels and heads as run_gpu.sh runs them.
CONV_LAYERS = ("qsv", "qsv-composed", "qsv-field")
CONV_CHANNELS, CONV_HEADS = 64, 4
#: bench_conv.py's neighbour counts in run_gpu.sh: the row kernels' launch
#: configurations are tuned per mean degree (issue 32 item 8d), so the warm-up
#: graphs have each degree the timed graphs have.
CONV_KS = (8, 16)
#: bench_train.py's models as run_gpu.sh runs them (most informative first).
TRAIN_MODELS = ("qsv", "attention-gat", "attention-transformer", "resnet20", "lattice",
                "attention-gatv2")
#: bench_train.py's and check_determinism.py's batch size in run_gpu.sh.
TRAIN_BATCH = 128
#: ``(model, batch)`` of the other steps: the paper-qsv epoch's evaluation batch
#: (``eval_batch_size``'s default; its training batch is TRAIN_BATCH) and the DDP
#: smoke test's batch. A GraphNet's batch rides along as channels of the operator
#: (``[N, H, B * C / 4, 4]``), so the batch size selects the kernels' tile sizes.
OTHER_BATCHES = (("qsv", 500), ("qsv", 32))
PRECISIONS = ("fp32", "bf16")
#: The nodes of the warm-up graphs (a multiple of 16, as the benchmarks' sizes:
#: Triton specialises integer arguments on divisibility by 16).
WARMUP_NODES = 64
KERNELS = ("rotate_rows", "forward_rows", "backward_rows", "backward_cols", "unit_rows",
           "unit_rows_backward", "layer_rotate_rows", "layer_forward_rows",
           "layer_backward_rows", "layer_backward_cols")

Variant = Tuple[str, Tuple[Tuple[str, str], ...], Tuple[Tuple[str, object], ...]]
#: Keyword arguments of a launch that are compile options, not constexprs: they
#: are part of a variant (a kernel compiled with 2 warps is another binary than
#: with 4) and are passed to the compiler as options.
LAUNCH_OPTIONS = ("num_warps", "num_stages")


def _autocast(device: torch.device, precision: str):
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def _knn_graph(n: int, k: int, device: torch.device) -> torch.Tensor:
    from qsv_pyg.geometry import knn_within
    gen = torch.Generator().manual_seed(0)
    return knn_within(torch.rand(n, 3, generator=gen), k).to(device)


def conv_configs(device: torch.device) -> Iterator[Tuple[str, Callable[[], None]]]:
    """``(name, run)``: one forward+backward of every bench_conv QSV layer."""
    from bench_conv import make_layer

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(WARMUP_NODES, CONV_CHANNELS, generator=gen).to(device)
    quat = torch.randn(WARMUP_NODES, CONV_HEADS, 4, generator=gen).to(device)
    for k in CONV_KS:
        edge_index = _knn_graph(WARMUP_NODES, k, device)
        for name in CONV_LAYERS:
            for precision in PRECISIONS:
                def run(name=name, precision=precision, edge_index=edge_index):
                    layer = make_layer(name, CONV_CHANNELS, CONV_HEADS).to(device)
                    xin = x.clone().requires_grad_(True)
                    with _autocast(device, precision):
                        out = layer(xin, edge_index,
                                    quat=quat if name == "qsv-field" else None)
                    out.float().sum().backward()
                yield f"conv {name} k{k} {precision}", run


def model_configs(device: torch.device) -> Iterator[Tuple[str, Callable[[], None]]]:
    """``(name, run)``: one training forward+backward of every bench_train model
    at its batch size, and of the other steps' ``(model, batch)``."""
    from qsv_pyg.models import build_model

    pairs = [(m, TRAIN_BATCH) for m in TRAIN_MODELS] + list(OTHER_BATCHES)
    built: Dict[str, torch.nn.Module] = {}  # one model per name (building takes seconds)

    def model_of(name: str) -> torch.nn.Module:
        if name not in built:
            torch.manual_seed(0)
            built[name] = build_model(name, num_classes=10).to(device)
        return built[name]

    for name, batch in pairs:
        for precision in PRECISIONS:
            def run(name=name, precision=precision, batch=batch):
                gen = torch.Generator().manual_seed(2)
                images = torch.randn(batch, 3, 32, 32, generator=gen).to(device)
                labels = torch.randint(0, 10, (batch, ), generator=gen).to(device)
                model = model_of(name)
                model.zero_grad(set_to_none=True)
                with _autocast(device, precision):
                    loss = F.cross_entropy(model(images).float(), labels) \
                        + model.auxiliary_loss()
                loss.backward()
            yield f"train {name} b{batch} {precision}", run


def configs(device: torch.device) -> List[Tuple[str, Callable[[], None]]]:
    return list(conv_configs(device)) + list(model_configs(device))


# ---------------------------------------------------------------- recording
def _dtype_name(t: torch.Tensor) -> str:
    return {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16",
            torch.float64: "*fp64", torch.int32: "*i32", torch.int64: "*i64"}[t.dtype]


class _Recorder:
    """Stands for one kernel: ``kernel[grid](*args, **constexprs)`` records the
    variant (and the launch) and runs nothing."""

    def __init__(self, name: str, arg_names: List[str], sink: list):
        self.name, self.arg_names, self.sink = name, arg_names, sink

    def __getitem__(self, grid):
        def launch(*args, **constexprs):
            sig = []
            for arg_name, value in zip(self.arg_names, args):
                if torch.is_tensor(value):
                    sig.append((arg_name, _dtype_name(value)))
                else:
                    sig.append((arg_name, "i64" if abs(int(value)) >= 2 ** 31 else "i32"))
            consts = tuple(sorted((k, _const(v)) for k, v in constexprs.items()))
            self.sink.append((self.name, tuple(sig), consts))
        return launch


def _const(value):
    import triton.language as tl
    if isinstance(value, tl.dtype):
        return f"tl.{value.name}"
    return value


def _arg_names(kernel) -> List[str]:
    names = getattr(kernel, "arg_names", None)
    if names is None:  # an InterpretedFunction wraps the JITFunction
        names = kernel.fn.arg_names
    return list(names)


@contextlib.contextmanager
def recording(sink: list):
    """Inside: the Triton path takes CPU tensors and records its launches in
    ``sink`` (``(kernel, signature, constexprs)`` each) without running them."""
    real = tk._kernels(True)  # the interpreted module: only for the argument names
    fake = type("RecordedKernels", (), {})()
    for name in KERNELS:
        setattr(fake, name, _Recorder(name, _arg_names(getattr(real, name)), sink))
    # Tuning on, with no choice remembered: the first call of each key launches
    # every candidate configuration, as on the GPU (issue 32 item 8d), so every
    # variant the GPU may compile is recorded.
    with _patched_env("QSV_PYG_TRITON", "interpret"), \
            _patched_env(tk.AUTOTUNE_ENV, "1"), _patched(tt, "TUNED", {}), \
            _patched(tt, "TIMINGS", {}), _patched(tt, "TUNE_REPEATS", 0), \
            _patched(tk, "_kernels", lambda interpret: fake):
        yield sink


@contextlib.contextmanager
def _patched(owner, attr, value):
    old = getattr(owner, attr)
    setattr(owner, attr, value)
    try:
        yield
    finally:
        setattr(owner, attr, old)


@contextlib.contextmanager
def _patched_env(name, value):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def record_variants(which: Optional[List[str]] = None,
                    precisions: Tuple[str, ...] = PRECISIONS) -> Dict[Variant, List[str]]:
    """``variant -> [configurations that launch it]`` of every configuration
    (or of those whose name starts with one of ``which``), found on the CPU.

    Only the ``precisions`` given are run (both by default): under bf16
    autocast, features that reach the operator in bf16 (the CIFAR models' conv
    output) stay bf16 on the Triton path (half storage, float32 accumulation;
    issue 32 item 7), so those configurations launch bf16 variants of their own
    (12 of the 35); the bench_conv layers' features are the float32 input."""
    out: Dict[Variant, List[str]] = {}
    device = torch.device("cpu")
    for name, run in configs(device):
        if which and not any(name.startswith(w) for w in which):
            continue
        if name.rsplit(" ", 1)[1] not in precisions:
            continue
        sink: list = []
        with recording(sink):
            run()
        for variant in sink:
            out.setdefault(variant, [])
            if name not in out[variant]:
                out[variant].append(name)
    return out


# ---------------------------------------------------------------- sm_90
def compile_sm90(variant: Variant) -> int:
    """Compile one variant for Hopper (sm_90) without a GPU; returns the cubin's size."""
    return len(build_sm90(variant).asm["cubin"])


def build_sm90(variant: Variant, aligned: bool = False):
    """The compiled kernel of one variant for sm_90. ``aligned``: every pointer
    argument specialised as 16-byte aligned, as Triton does at launch for
    freshly allocated tensors (what lets it vectorise loads: the PTX then shows
    ``ld.global.v4``); without, the most general binary."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    name, sig, consts = variant
    fn = getattr(tk._kernels(False), name)
    if type(fn).__name__ == "InterpretedFunction":
        raise RuntimeError("TRITON_INTERPRET=1 was set when the kernels were imported")
    options = {k: v for k, v in consts if k in LAUNCH_OPTIONS}
    constexprs = {k: (tl.dtype(v[3:]) if isinstance(v, str) and v.startswith("tl.") else v)
                  for k, v in consts if k not in LAUNCH_OPTIONS}
    signature = {**dict(sig), **{k: "constexpr" for k in constexprs}}
    attrs = {(i, ): [["tt.divisibility", 16]] for i, (_, d) in enumerate(sig)
             if d.startswith("*")} if aligned else None
    binary = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs,
                                      attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options=options)
    if "num_warps" in options and binary.metadata.num_warps != options["num_warps"]:
        raise RuntimeError(f"{name}: compiled with {binary.metadata.num_warps} warps, "
                           f"launched with {options['num_warps']}")
    return binary


def describe(variant: Variant) -> str:
    name, sig, consts = variant
    dtypes = sorted({d for _, d in sig if d.startswith("*")})
    return f"{name}[{', '.join(f'{k}={v}' for k, v in consts)}] {'/'.join(dtypes)}"


# ---------------------------------------------------------------- main
def warm_up(device: torch.device) -> dict:
    """Run every configuration once on ``device``: compiles every variant."""
    results = {}
    for name, run in configs(device):
        t0 = time.perf_counter()
        try:
            run()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            results[name] = {"seconds": round(time.perf_counter() - t0, 3)}
        except Exception as exc:  # report and go on: the later steps show the rest
            results[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        print(f"warm-up {name}: {results[name]}", flush=True)
    return results


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--list", action="store_true", help="print the variants (CPU)")
    mode.add_argument("--compile-sm90", action="store_true",
                      help="compile every variant for sm_90 (no GPU needed)")
    parser.add_argument("--device", default="cuda", help="device of the warm-up run")
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.list or args.compile_sm90:
        variants = record_variants()
        rows = []
        for variant, users in sorted(variants.items(), key=lambda kv: describe(kv[0])):
            row = {"variant": describe(variant), "used_by": users}
            if args.compile_sm90:
                t0 = time.perf_counter()
                row["cubin_bytes"] = compile_sm90(variant)
                row["compile_s"] = round(time.perf_counter() - t0, 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
        result = {"variants": rows, "count": len(rows)}
        print(f"{len(rows)} variants" + (", all compiled for sm_90" if args.compile_sm90
                                         else ""))
    else:
        try:
            device = torch.device(args.device)
        except RuntimeError:
            print(f"gpu_warmup: --device {args.device!r} is not a device", file=sys.stderr)
            return 2
        if device.type == "cuda" and not torch.cuda.is_available():
            print("gpu_warmup: --device cuda but no CUDA device", file=sys.stderr)
            return 2
        t0 = time.perf_counter()
        runs = warm_up(device)
        result = {"device": str(device), "runs": runs,
                  "seconds": round(time.perf_counter() - t0, 2),
                  "failed": [k for k, v in runs.items() if "error" in v]}
        print(f"warm-up done in {result['seconds']} s; failed: {result['failed'] or 'none'}")
    if args.out:
        from common import write_json
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
