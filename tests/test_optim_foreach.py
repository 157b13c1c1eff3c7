"""The riemannian backend's foreach step against geoopt's per-parameter loop.

``DecoupledRiemannianAdam.step`` computes geoopt's RiemannianAdam update (with
decoupled weight decay) in foreach ops and one row-wise block over all unit
quaternions; ``step_per_parameter`` is geoopt's own loop. They must agree to
rounding over many steps, for Euclidean and sphere parameters alike, with
state that either can load.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from qsv_pyg.models import build_model
from qsv_pyg.training.optim import build_optimizer

geoopt = pytest.importorskip("geoopt")

SMALL_QSV = dict(shell_sizes=(16, 9, 4), k_cross=4, k_inner=3, heads=2, widths=(16, 16, 16))
TIGHT = dict(rtol=1e-6, atol=1e-7)
#: CUDA's multi-tensor kernels may round the last bit differently from per-tensor ones.
TIGHT_CUDA = dict(rtol=1e-5, atol=1e-6)


class OpCount(TorchDispatchMode):
    """Counts the aten ops dispatched inside the block (and the host reads)."""

    def __init__(self):
        super().__init__()
        self.ops, self.reads = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.reads += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def _pair(device="cpu", **kw):
    torch.manual_seed(0)
    model = build_model("qsv", **SMALL_QSV).to(device)
    ref = copy.deepcopy(model)
    opts = [build_optimizer(m, lr=3e-3, weight_decay=0.05, sphere_lr_scale=20.0, **kw)
            for m in (model, ref)]
    return model, ref, opts[0], opts[1]


def _same_grads(model, ref, seed, skip=()):
    g = torch.Generator().manual_seed(seed)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if any(s in name for s in skip):
            p.grad = q.grad = None
            continue
        grad = torch.randn(p.shape, generator=g).to(p.device)
        if getattr(p, "manifold", None) is None:
            grad = grad * 0.1
        p.grad, q.grad = grad, grad.clone()


def _assert_match(opt, ref_opt, model, ref):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        tol = TIGHT_CUDA if p.is_cuda else TIGHT
        torch.testing.assert_close(p, q, **tol, msg=name)
        if p in opt.state:
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(opt.state[p][key], ref_opt.state[q][key], **tol,
                                           msg=f"{name} {key}")
            assert opt.state[p]["step"] == ref_opt.state[q]["step"]


def _compare(device, steps=8):
    model, ref, opt, ref_opt = _pair(device)
    assert any(isinstance(p, geoopt.ManifoldParameter) for p in model.parameters())
    for step in range(steps):
        # Some steps leave parameters without a gradient (different step counts,
        # also inside the sphere group); the lr changes as under a schedule.
        _same_grads(model, ref, step, skip=("fields.1",) if step in (2, 3) else ())
        for o in (opt, ref_opt):
            for group in o.param_groups:
                group["lr"] = 3e-3 * (0.5 + 0.1 * step) * (20.0 if group["sphere"] else 1.0)
        opt.step()
        ref_opt.step_per_parameter()
        _assert_match(opt, ref_opt, model, ref)
    for p in model.sphere_parameters():
        torch.testing.assert_close(p.norm(dim=-1), torch.ones(p.shape[:-1], device=device))


def test_foreach_step_matches_geoopt_per_parameter():
    _compare("cpu")


@pytest.mark.cuda
def test_foreach_step_matches_geoopt_per_parameter_cuda():
    _compare("cuda")


def test_state_dicts_load_into_either_implementation():
    model, ref, opt, ref_opt = _pair()
    for step in range(3):
        _same_grads(model, ref, step)
        opt.step()
        ref_opt.step_per_parameter()
    # The per-parameter state continues under the foreach step and vice versa.
    a, b = copy.deepcopy(model), copy.deepcopy(ref)
    opt_a = build_optimizer(a, lr=3e-3, weight_decay=0.05, sphere_lr_scale=20.0)
    opt_b = build_optimizer(b, lr=3e-3, weight_decay=0.05, sphere_lr_scale=20.0)
    opt_a.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    opt_b.load_state_dict(copy.deepcopy(opt.state_dict()))
    for step in range(3, 6):
        _same_grads(a, b, step)
        opt_a.step()
        opt_b.step_per_parameter()
        _assert_match(opt_a, opt_b, a, b)


def test_amsgrad_and_other_manifolds_fall_back_to_per_parameter():
    model, ref, opt, ref_opt = _pair()
    for o in (opt, ref_opt):
        for group in o.param_groups:
            group["amsgrad"] = True
    for step in range(3):
        _same_grads(model, ref, step)
        opt.step()
        ref_opt.step_per_parameter()
        _assert_match(opt, ref_opt, model, ref)
    assert all("max_exp_avg_sq" in s for s in opt.state.values())

    class OnStiefel(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = geoopt.ManifoldParameter(torch.eye(4, 2), manifold=geoopt.Stiefel())
            self.b = nn.Parameter(torch.zeros(2))

    torch.manual_seed(0)
    m1 = OnStiefel()
    m2 = copy.deepcopy(m1)
    o1, o2 = (build_optimizer(m, lr=1e-2, weight_decay=0.0, backend="riemannian")
              for m in (m1, m2))
    for step in range(3):
        _same_grads(m1, m2, step)
        o1.step()
        o2.step_per_parameter()
        _assert_match(o1, o2, m1, m2)


def test_foreach_step_is_a_few_dozen_ops_and_reads_nothing_back():
    """The point of the foreach step: a fraction of geoopt's per-parameter op count."""
    model, ref, opt, ref_opt = _pair()
    counts = {}
    for step in range(3):  # the first step also creates the moments
        _same_grads(model, ref, step)
        with OpCount() as fast:
            opt.step()
        with OpCount() as slow:
            ref_opt.step_per_parameter()
        counts = {"foreach": fast.ops, "per_parameter": slow.ops}
        assert fast.reads == 0
    n_params = sum(1 for p in model.parameters() if p.requires_grad)
    print(f"\n{n_params} parameters: {counts}")
    assert counts["foreach"] * 8 < counts["per_parameter"], counts
    assert counts["foreach"] < 100, counts
