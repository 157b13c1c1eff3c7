"""Kernel launches of a QSVConv forward+backward on the Triton path, counted on
the CPU: the Triton launches recorded (``benchmarks/gpu_warmup.py``'s recorder:
the Triton path through the interpreter's dispatch, nothing executed) and the
aten ops that would each launch at least one CUDA kernel (views, ``empty`` and
other metadata-only ops are not counted), inside the operators included. The
step is the layer's own: a forward and a backward from a given (dense) output
gradient, after a first call that built the graph's caches, grads set to None.

Counts reached (bench_conv's layers, 64 channels, 4 heads, kNN graph), printed
by the test:

* ``"qsv"`` (feature quaternions, the default layer): **10**, the whole layer
  as one operator, ``qsv_pyg::attend_layer`` (``qsv_pyg.nn.fused_layer``):
  forward ``cat`` + ``mm`` (the quaternion map and root weight as one matmul)
  and 2 Triton kernels (``layer_rotate_rows``: normalisation and rotation;
  ``layer_forward_rows``: attention, projection, root term and bias);
  backward 2 Triton kernels, one row ``sum`` (the quaternion bias, bias and
  log beta at once), ``bmm`` (d W_h), ``addmm`` (d x) and ``mm`` (d W). Issue
  32's aim is <= 10. The same 10 with the heads averaged (``concat=False``,
  ``"qsv-mean"``; d W_h by one ``addmm``), and under bf16 autocast with float32
  features (``"qsv-bf16"``: the one operator runs in float32). It was 26 (28 with the test's own ``sum`` and
  ``ones_like``, as counted before) composing ``qsv_pyg::attend`` with the
  layer's PyTorch ops, and 46 before issue 32's launch work.
* ``"qsv-field"`` (given quaternions: a composition, as every configuration
  the one operator does not take, ``QSVConv.fused_layer_reason``): 20, of
  which the operator (``qsv_pyg::attend`` + ``attend_backward``) is 4 Triton
  kernels and 1 aten op (the sum of the β-gradient partials), the
  normalisation 1 kernel; the rest is the layer's own PyTorch ops (the
  per-head projection with its two copies, the root weight, the bias,
  ``exp`` of log β and their backward).
"""
from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("triton")
from conftest import load_benchmark  # noqa: E402

gpu_warmup = load_benchmark("gpu_warmup")
make_layer = load_benchmark("bench_conv").make_layer

from qsv_pyg.nn import triton_kernel as tk  # noqa: E402

#: aten ops that launch no kernel on CUDA (views, allocation, metadata, dispatch
#: entries of the custom ops whose insides are counted separately).
NO_LAUNCH = {"view", "_unsafe_view", "t", "transpose", "permute", "expand", "unsqueeze",
             "squeeze", "reshape", "detach", "slice", "select", "split", "alias",
             "as_strided", "empty", "new_empty", "empty_like", "empty_strided", "lift_fresh",
             "unbind", "_reshape_alias", "narrow", "split_with_sizes", "unflatten",
             "flatten", "promote_types", "attend", "attend_backward", "attend_layer",
             "attend_layer_backward", "equal"}
# ("equal": the CSR cache's verified hit compares host memory: on CUDA hits are
# not verified, no kernel.)

#: Per forward+backward (measured: see the module docstring): the Triton
#: kernels (exactly), the composed path's operator aten ops and the whole
#: layer's launches (bounds; the old counts fail them).
OPERATOR_KERNELS = {
    "qsv": ("layer_rotate_rows", "layer_forward_rows", "layer_backward_rows",
            "layer_backward_cols"),
    "qsv-mean": ("layer_rotate_rows", "layer_forward_rows", "layer_backward_rows",
                 "layer_backward_cols"),
    "qsv-bf16": ("layer_rotate_rows", "layer_forward_rows", "layer_backward_rows",
                 "layer_backward_cols"),
    "qsv-field": ("unit_rows", "rotate_rows", "forward_rows", "backward_rows",
                  "backward_cols"),
}
OPERATOR_ATEN = {"qsv": 1, "qsv-mean": 1, "qsv-bf16": 1, "qsv-field": 1}
LAYER_BOUND = {"qsv": 10, "qsv-mean": 10, "qsv-bf16": 10, "qsv-field": 20}


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in NO_LAUNCH and not func.is_view:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def _count(name: str):
    from qsv_pyg.nn import triton_layer
    torch.manual_seed(0)
    edge_index = gpu_warmup._knn_graph(64, 8, torch.device("cpu"))
    if name == "qsv-mean":  # the heads averaged (concat=False), as an output layer
        from qsv_pyg.nn import QSVConv
        layer = QSVConv(64, 16, heads=4, concat=False, check_finite=False)
    else:
        layer = make_layer("qsv" if name == "qsv-bf16" else name, 64, 4)
    # "qsv-bf16": under bf16 autocast, float32 features (the layer's output is
    # float32 under autocast: the next layer's input)
    amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=name == "qsv-bf16")
    x = torch.randn(64, 64, requires_grad=True)
    quat = torch.randn(64, 4, 4) if name == "qsv-field" else None
    grad = torch.randn(64, 16 if name == "qsv-mean" else 64)
    inside = _Count()

    def counted(fn):
        def run(*args, **kwargs):
            with inside:
                return fn(*args, **kwargs)
        return run

    sink: list = []
    with gpu_warmup.recording(sink):
        layer(x, edge_index, quat=quat).backward(grad)  # a first call: the graph's caches
        layer.zero_grad(set_to_none=True)
        x.grad = None
        sink.clear()
        total = _Count()
        with pytest.MonkeyPatch.context() as mp:
            for module in (tk, triton_layer):
                mp.setattr(module, "forward", counted(module.forward))
                mp.setattr(module, "backward", counted(module.backward))
            with total:
                with amp:
                    out = layer(x, edge_index, quat=quat)
                out.backward(grad)
    # (the inner mode takes the operators' own ops: the outer one does not see them)
    return [v[0] for v in sink], sum(inside.ops.values()), sum(total.ops.values()), \
        inside.ops, total.ops


@pytest.mark.parametrize("name", ["qsv", "qsv-mean", "qsv-bf16", "qsv-field"])
def test_qsvconv_launch_count_on_the_triton_path(name, capsys):
    kernels, operator_aten, layer_aten, inside, total = _count(name)
    triton_launches = len(kernels)
    with capsys.disabled():
        print(f"\n{name}: {triton_launches} Triton ({kernels}) + {operator_aten} aten in the "
              f"operator ({dict(inside)}); {triton_launches + operator_aten + layer_aten} "
              f"launches in the layer ({dict(total)})")
    assert sorted(kernels) == sorted(OPERATOR_KERNELS[name]), kernels
    assert operator_aten <= OPERATOR_ATEN[name], dict(inside)
    assert triton_launches + operator_aten + layer_aten <= LAYER_BOUND[name], dict(total)
