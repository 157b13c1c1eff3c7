"""The fused QSV aggregation (qsv_pyg.nn.qsv_kernel) and its block-matrix helpers."""
import pytest
import torch

import qsv_pyg.nn._cpu_ext as cpu_ext
import qsv_pyg.nn.qsv_conv as qsv_conv_module
from qsv_pyg.nn import QSVConv, unit_quaternion
from qsv_pyg.nn.qsv_kernel import qsv_aggregate, softmax_last
from qsv_pyg.quaternion import (
    block_matrix_to_quaternion_grad,
    conjugate,
    hamilton_product,
    quaternion_to_block_matrix,
    quaternion_to_matrix,
    random_unit_quaternion,
    rotate,
)

from conftest import fixed_degree_edge_index

DTYPES = [torch.float32, torch.float64]
TOL = {torch.float32: dict(rtol=2e-5, atol=2e-5),
       torch.float64: dict(rtol=1e-10, atol=1e-10)}


def gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.fixture(params=["cpp", "torch"])
def impl(request, monkeypatch):
    """Run a test with the C++ CPU kernel and with the PyTorch path."""
    if request.param == "torch":
        monkeypatch.setenv("QSV_PYG_CPU_KERNEL", "0")
    elif cpu_ext.cpu_kernel() is None:
        pytest.skip(f"C++ kernel unavailable: {cpu_ext._STATE['error']}")
    return request.param


# ------------------------------------------------------------- block matrix
@pytest.mark.parametrize("dtype", DTYPES)
def test_block_matrix_is_the_sandwich(dtype):
    q = random_unit_quaternion(5, 3, generator=gen(0), dtype=dtype)
    x = torch.randn(5, 3, 4, generator=gen(1), dtype=dtype)
    Q = quaternion_to_block_matrix(q)
    assert Q.shape == (5, 3, 4, 4) and Q.dtype == dtype
    torch.testing.assert_close((Q @ x.unsqueeze(-1)).squeeze(-1), rotate(q, x), **TOL[dtype])
    torch.testing.assert_close(Q[..., 1:, 1:], quaternion_to_matrix(q), **TOL[dtype])
    eye = torch.eye(4, dtype=dtype).expand_as(Q)
    torch.testing.assert_close(Q @ Q.transpose(-1, -2), eye, **TOL[dtype])
    # Q(q)^T is the matrix of q*
    torch.testing.assert_close(Q.transpose(-1, -2), quaternion_to_block_matrix(conjugate(q)),
                               **TOL[dtype])


def test_block_matrix_rejects_wrong_last_dim():
    with pytest.raises(ValueError, match="last dimension of size 4"):
        quaternion_to_block_matrix(torch.randn(3, 3))


def test_block_matrix_grad_matches_autograd():
    q = torch.randn(6, 2, 4, dtype=torch.float64, generator=gen(2), requires_grad=True)
    g = torch.randn(6, 2, 4, 4, dtype=torch.float64, generator=gen(3))
    (auto, ) = torch.autograd.grad((quaternion_to_block_matrix(q) * g).sum(), q)
    torch.testing.assert_close(block_matrix_to_quaternion_grad(q.detach(), g), auto)


# ------------------------------------------------------------------ softmax
@pytest.mark.parametrize("k", [1, 2, 5, 8, 15, 16, 17, 32])
def test_softmax_last_matches_torch(k):
    s = 30.0 * torch.randn(50, 3, k, generator=gen(k))
    s[0, 0] = 1e4  # large logits must not overflow
    out = softmax_last(s)
    torch.testing.assert_close(out, torch.softmax(s, dim=-1))
    assert torch.isfinite(out).all()


# ---------------------------------------------------------------- the kernel
def literal(v, q_src, q_dst, beta, nbr, use_abs):
    """Per edge, straight from the definition: r = q_i* q_j, sandwich, softmax."""
    n, k = nbr.shape
    q_dst = q_src if q_dst is None else q_dst
    qi = q_dst.unsqueeze(1).expand(n, k, *q_dst.shape[1:])        # [n, k, H, 4]
    qj = q_src[nbr]                                                # [n, k, H, 4]
    r = hamilton_product(conjugate(qi), qj)
    logit = r[..., 0].abs() if use_abs else r[..., 0]
    alpha = torch.softmax(beta * logit, dim=1)                     # [n, k, H]
    msg = rotate(r.unsqueeze(-2), v[nbr])                          # [n, k, H, M, 4]
    return (alpha[..., None, None] * msg).sum(dim=1), alpha


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("use_abs", [False, True])
@pytest.mark.parametrize("bipartite", [False, True])
@pytest.mark.parametrize("comp", [False, True], ids=["block-major", "component-major"])
def test_matches_literal_formula(dtype, use_abs, bipartite, comp, impl):
    n_src, k, H, M = 30, 5, 3, 4
    n_dst = 12 if bipartite else n_src
    nbr = torch.randint(0, n_src, (n_dst, k), generator=gen(4))
    v = torch.randn(n_src, H, M, 4, generator=gen(5), dtype=dtype)
    q_src = random_unit_quaternion(n_src, H, generator=gen(6), dtype=dtype)
    q_dst = random_unit_quaternion(n_dst, H, generator=gen(7), dtype=dtype) if bipartite \
        else None
    beta = torch.tensor([0.5, 2.0, 7.0], dtype=dtype)
    if comp:
        z, alpha = qsv_aggregate(v.transpose(2, 3), q_src, q_dst, beta, nbr, use_abs,
                                 component_major=True)
        z = z.transpose(2, 3)
    else:
        z, alpha = qsv_aggregate(v, q_src, q_dst, beta, nbr, use_abs)
    ref_z, ref_alpha = literal(v, q_src, q_dst, beta, nbr, use_abs)
    torch.testing.assert_close(z, ref_z, **TOL[dtype])
    torch.testing.assert_close(alpha, ref_alpha, **TOL[dtype])


@pytest.mark.parametrize("use_abs", [False, True])
@pytest.mark.parametrize("bipartite", [False, True])
@pytest.mark.parametrize("comp", [False, True], ids=["block-major", "component-major"])
def test_gradcheck(use_abs, bipartite, comp, impl):
    n_src, k, H, M = 16, 4, 2, 3
    n_dst = 9 if bipartite else n_src
    nbr = torch.randint(0, n_src, (n_dst, k), generator=gen(8))
    d = torch.float64
    v = torch.randn(n_src, H, M, 4, generator=gen(9), dtype=d, requires_grad=True)
    p_src = torch.randn(n_src, H, 4, generator=gen(10), dtype=d, requires_grad=True)
    p_dst = torch.randn(n_dst, H, 4, generator=gen(11), dtype=d, requires_grad=True)
    beta = (0.5 + torch.rand(H, generator=gen(12), dtype=d)).requires_grad_()

    def f(v, p_src, p_dst, beta):
        q_dst = unit_quaternion(p_dst) if bipartite else None
        return qsv_aggregate(v.transpose(2, 3) if comp else v, unit_quaternion(p_src),
                             q_dst, beta, nbr, use_abs, component_major=comp)

    # Both outputs (features and attention weights) carry gradients.
    assert torch.autograd.gradcheck(f, (v, p_src, p_dst, beta))


def test_only_needed_gradients(impl):
    n, k, H, M = 10, 3, 2, 2
    nbr = torch.randint(0, n, (n, k), generator=gen(13))
    v = torch.randn(n, H, M, 4, generator=gen(14), requires_grad=True)
    q = random_unit_quaternion(n, H, generator=gen(15))  # a fixed field
    beta = torch.ones(H)
    z, _ = qsv_aggregate(v, q, None, beta, nbr)
    z.sum().backward()
    assert v.grad is not None and torch.isfinite(v.grad).all()


@pytest.mark.parametrize("bad, match", [
    (dict(v=torch.randn(10, 2, 3)), "must be \\[N_src, H, M, 4\\]"),
    (dict(v=torch.randn(10, 2, 3, 4), component_major=True), "must be \\[N_src, H, 4, M\\]"),
    (dict(q_src=torch.randn(10, 3, 4)), "must be \\[N_src, H, M, 4\\]"),
    (dict(q_dst=torch.randn(4, 2, 4)), "q_dst"),
    (dict(beta=torch.ones(3)), "beta"),
    (dict(nbr=torch.zeros(6, 3, dtype=torch.long)), "6 targets but 10 sources"),
])
def test_shape_errors(bad, match):
    args = dict(v=torch.randn(10, 2, 3, 4), q_src=torch.randn(10, 2, 4), q_dst=None,
                beta=torch.ones(2), nbr=torch.zeros(10, 3, dtype=torch.long))
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        qsv_aggregate(**args)


# ---------------------------------------------------- inside QSVConv (dispatch)
def spy_fused(monkeypatch):
    calls = []
    original = qsv_conv_module.qsv_aggregate

    def spy(*args, **kwargs):
        calls.append(1 + int(kwargs.get("component_major", False)))  # 2: component-major
        return original(*args, **kwargs)

    monkeypatch.setattr(qsv_conv_module, "qsv_aggregate", spy)
    return calls


def grads(conv, x, out):
    params = [p for p in conv.parameters()]
    return torch.autograd.grad((out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum(),
                               [x] + params)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("routing", ["learned", "abs"])
@pytest.mark.parametrize("mode", ["features", "field", "batched-field", "wide-batched-field"])
def test_conv_fused_equals_unfused(monkeypatch, dtype, routing, mode, impl):
    # "wide-batched-field" has 8 * 8 / 4 = 16 blocks per head: component-major.
    n, k, H, C = 24, 5, 2, 8
    edge_index = fixed_degree_edge_index(n, k, seed=1)
    torch.manual_seed(0)
    conv = QSVConv(H * C, 6, heads=H, routing=routing, beta_init=1.7,
                   quat_source="features" if mode == "features" else "given").to(dtype)
    lead = {"batched-field": (3, n), "wide-batched-field": (8, n)}.get(mode, (n, ))
    x = torch.randn(*lead, H * C, generator=gen(16), dtype=dtype, requires_grad=True)
    quat = None if mode == "features" else torch.randn(n, H, 4, generator=gen(17), dtype=dtype)

    calls = spy_fused(monkeypatch)
    out, (_, alpha) = conv(x, edge_index, quat=quat, return_attention_weights=True)
    expected = [2] if mode == "wide-batched-field" else [1]
    assert calls == expected
    g = grads(conv, x, out)

    monkeypatch.setattr(QSVConv, "_use_fused", lambda self, *a: False)
    ref, (_, ref_alpha) = conv(x, edge_index, quat=quat, return_attention_weights=True)
    assert calls == expected
    g_ref = grads(conv, x, ref)
    torch.testing.assert_close(out, ref, **TOL[dtype])
    torch.testing.assert_close(alpha, ref_alpha, **TOL[dtype])
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, **TOL[dtype])


def test_conv_unfused_cases(monkeypatch):
    """Options the fused kernel does not cover take the general fixed-degree path."""
    n, k, H, C = 20, 4, 2, 8
    edge_index = fixed_degree_edge_index(n, k, seed=2)
    x = torch.randn(n, H * C, generator=gen(18))
    calls = spy_fused(monkeypatch)
    for kwargs in (dict(routing="uniform"), dict(transport="identity"),
                   dict(routing="geometric")):
        conv = QSVConv(H * C, 4, heads=H, **kwargs)
        conv(x, edge_index, pos=torch.randn(n, 3, generator=gen(19)))
    conv = QSVConv(H * C, 4, heads=H, dropout=0.5).train()
    conv(x, edge_index)
    assert calls == []
    conv.eval()(x, edge_index)  # dropout is off in eval: fused
    assert calls == [1]


# ----------------------------------------------------------- unit quaternion
@pytest.mark.parametrize("dtype", DTYPES)
def test_unit_quaternion_values_and_zero_norm(dtype):
    q = torch.randn(6, 4, generator=gen(20), dtype=dtype)
    q[2] = 0.0
    q[4] = 1e-12
    out = unit_quaternion(q)
    assert out.dtype == dtype
    torch.testing.assert_close(out.norm(dim=-1), torch.ones(6, dtype=dtype))
    ident = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=dtype)
    torch.testing.assert_close(out[2], ident)
    torch.testing.assert_close(out[4], ident)
    torch.testing.assert_close(out[0], q[0] / q[0].norm())


def test_unit_quaternion_gradient():
    q = torch.randn(5, 3, 4, generator=gen(21), dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(unit_quaternion, (q, ))
    z = torch.zeros(2, 4, dtype=torch.float64, requires_grad=True)
    unit_quaternion(z).sum().backward()
    assert torch.equal(z.grad, torch.zeros_like(z))  # constant identity branch
    with pytest.raises(ValueError, match="last dimension of size 4"):
        unit_quaternion(torch.randn(3, 5))


def test_double_backward_is_refused_clearly(impl):
    n, k, H, M = 8, 3, 1, 1
    nbr = torch.randint(0, n, (n, k), generator=gen(22))
    v = torch.randn(n, H, M, 4, requires_grad=True)
    q = random_unit_quaternion(n, H, generator=gen(23))
    z, _ = qsv_aggregate(v, q, None, torch.ones(H), nbr)
    (g, ) = torch.autograd.grad(z.pow(2).sum(), v, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|twice"):
        g.sum().backward()


def test_conv_under_cpu_autocast_takes_the_general_path(monkeypatch):
    n, k, H, C = 20, 4, 2, 8
    edge_index = fixed_degree_edge_index(n, k, seed=3)
    x = torch.randn(n, H * C, generator=gen(24))
    conv = QSVConv(H * C, 4, heads=H)
    calls = spy_fused(monkeypatch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = conv(x, edge_index)
    assert calls == [] and torch.isfinite(out).all()
    ref = conv(x, edge_index)
    assert calls == [1]
    torch.testing.assert_close(out.float(), ref, atol=0.1, rtol=0.1)


def test_out_of_range_neighbours_are_rejected():
    n, k, H = 5, 2, 1
    nbr = torch.tensor([[0, 1]] * 4 + [[0, 7]])
    with pytest.raises(ValueError, match="neighbour indices must lie in \\[0, 5\\)"):
        qsv_aggregate(torch.randn(n, H, 1, 4), random_unit_quaternion(n, H), None,
                      torch.ones(H), nbr)


def test_only_attention_weights_used(impl):
    """Backward when only the attention weights are used: gradients reach q and beta."""
    n, k, H, M = 10, 3, 2, 2
    nbr = torch.randint(0, n, (n, k), generator=gen(33))
    v = torch.randn(n, H, M, 4, generator=gen(34), dtype=torch.float64, requires_grad=True)
    p = torch.randn(n, H, 4, generator=gen(35), dtype=torch.float64, requires_grad=True)
    beta = torch.ones(H, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda p, b: qsv_aggregate(v.detach(), unit_quaternion(p), None, b, nbr)[1], (p, beta))


def test_cpp_kernel_is_used_on_cpu_when_available():
    from qsv_pyg.nn.qsv_kernel import _kernel_for
    if cpu_ext.cpu_kernel() is None:
        pytest.skip(f"C++ kernel unavailable: {cpu_ext._STATE['error']}")
    v, q, beta = torch.randn(6, 2, 3, 4), torch.randn(6, 2, 4), torch.ones(2)
    nbr = torch.zeros(6, 2, dtype=torch.long)
    crow_t = torch.zeros(13, dtype=torch.int32)
    assert _kernel_for(v, q, q, beta, nbr, crow_t, comp=False) is cpu_ext.cpu_kernel()
    assert _kernel_for(v, q, q, beta, nbr, crow_t, comp=True) is None
    assert _kernel_for(v.double(), q, q, beta, nbr, crow_t, comp=False) is None  # mixed dtypes


def test_failed_build_warns_once_and_falls_back(monkeypatch):
    import torch.utils.cpp_extension as cpp_extension

    def broken(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setenv("QSV_PYG_CPU_KERNEL", "1")
    monkeypatch.setattr(cpp_extension, "load", broken)
    monkeypatch.setattr(cpu_ext, "_STATE", {"tried": False, "module": None, "error": None})
    with pytest.warns(UserWarning, match="could not be built.*no compiler here"):
        assert cpu_ext.cpu_kernel() is None
    assert cpu_ext.cpu_kernel() is None  # not retried
    n, k, H, M = 12, 3, 2, 2
    nbr = torch.randint(0, n, (n, k), generator=gen(30))
    v = torch.randn(n, H, M, 4, generator=gen(31))
    q = random_unit_quaternion(n, H, generator=gen(32))
    z, _ = qsv_aggregate(v, q, None, torch.ones(H), nbr)
    ref_z, _ = literal(v, q, None, torch.ones(H), nbr, False)
    torch.testing.assert_close(z, ref_z, **TOL[torch.float32])
