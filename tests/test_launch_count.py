"""Kernel launches of a QSVConv forward+backward on the Triton path, counted on
the CPU: the Triton launches recorded (``benchmarks/gpu_warmup.py``'s recorder:
the Triton path through the interpreter's dispatch, nothing executed) and the
aten ops that would each launch at least one CUDA kernel (views, ``empty`` and
other metadata-only ops are not counted).

Counts reached (bench_conv's layers, 64 channels, 4 heads, kNN graph, grads set
to None before the step), printed by the test:

* the operator (``qsv_pyg::attend`` + ``attend_backward``): 4 Triton kernels and
  2 aten ops (the zeroed β-gradient partials and their sum); before the
  once-per-graph check it was 4 + 16 (14 for the CSR check on every forward);
* the whole layer: 47 launches with feature quaternions (``"qsv"``), 31 with
  given ones (``"qsv-field"``); 61 and 45 before: the projections, the quaternion
  normalisation and their backward, outside the operator (the issue's aim of
  <= 10 per layer needs those fused; not done here).
"""
from __future__ import annotations

import collections
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gpu_warmup  # noqa: E402
from bench_conv import make_layer  # noqa: E402

from qsv_pyg.nn import triton_kernel as tk  # noqa: E402

#: aten ops that launch no kernel on CUDA (views, allocation, metadata, dispatch
#: entries of the custom ops whose insides are counted separately).
NO_LAUNCH = {"view", "_unsafe_view", "t", "transpose", "permute", "expand", "unsqueeze",
             "squeeze", "reshape", "detach", "slice", "select", "split", "alias",
             "as_strided", "empty", "new_empty", "empty_like", "empty_strided", "lift_fresh",
             "unbind", "_reshape_alias", "narrow", "split_with_sizes", "unflatten",
             "flatten", "promote_types", "attend", "attend_backward", "equal"}
# ("equal": the CSR cache's verified hit compares host memory: on CUDA hits are
# not verified, no kernel.)

#: Upper bounds per forward+backward (measured: see the module docstring).
OPERATOR_TRITON, OPERATOR_ATEN = 4, 2
LAYER_BOUND = {"qsv": 48, "qsv-field": 32}


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
    torch.manual_seed(0)
    edge_index = gpu_warmup._knn_graph(64, 8, torch.device("cpu"))
    layer = make_layer(name, 64, 4)
    x = torch.randn(64, 64, requires_grad=True)
    quat = torch.randn(64, 4, 4) if name == "qsv-field" else None
    inside = _Count()
    forward, backward = tk.forward, tk.backward

    def counted(fn):
        def run(*args, **kwargs):
            with inside:
                return fn(*args, **kwargs)
        return run

    sink: list = []
    with gpu_warmup.recording(sink):
        layer(x, edge_index, quat=quat).sum().backward()  # a first call: the graph's caches
        layer.zero_grad(set_to_none=True)
        x.grad = None
        sink.clear()
        total = _Count()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(tk, "forward", counted(forward))
            mp.setattr(tk, "backward", counted(backward))
            with total:
                layer(x, edge_index, quat=quat).sum().backward()
    # (the inner mode takes the operator's own ops: the outer one does not see them)
    return len(sink), sum(inside.ops.values()), sum(total.ops.values()), inside.ops, total.ops


@pytest.mark.parametrize("name", ["qsv", "qsv-field"])
def test_qsvconv_launch_count_on_the_triton_path(name, capsys):
    triton_launches, operator_aten, layer_aten, inside, total = _count(name)
    with capsys.disabled():
        print(f"\n{name}: {triton_launches} Triton + {operator_aten} aten in the operator; "
              f"{triton_launches + operator_aten + layer_aten} launches in the layer "
              f"({dict(total)})")
    assert triton_launches == OPERATOR_TRITON
    assert operator_aten <= OPERATOR_ATEN, dict(inside)
    assert triton_launches + operator_aten + layer_aten <= LAYER_BOUND[name], dict(total)
