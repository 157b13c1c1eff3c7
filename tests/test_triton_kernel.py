"""The Triton kernels of ``qsv_pyg::attend`` (qsv_pyg.nn.triton_kernel).

With CUDA they run compiled on the GPU. Without, the real registered operator
is sent to them on CPU tensors (``QSV_PYG_TRITON=interpret``) and they run in
Triton's interpreter: slow (about a second per call on these graphs), so the
graphs are tiny. The interpreted kernels are a copy of the kernel module
decorated with ``TRITON_INTERPRET=1`` set (qsv_pyg.nn.triton_kernel._kernels),
so this works whenever triton was first imported (torch_geometric imports it,
before any test module could set the variable). Every result is checked
against autograd of the literal per-edge formula, in float64.
"""
import pytest
import torch

triton = pytest.importorskip("triton")

from qsv_pyg.nn import qsv_kernel  # noqa: E402
from qsv_pyg.nn import triton_kernel as tk  # noqa: E402
from qsv_pyg.nn import triton_tuning as tt  # noqa: E402
from qsv_pyg.nn.csr import batch_csr, build_csr  # noqa: E402
from qsv_pyg.nn.qsv_kernel import attend, qsv_attend  # noqa: E402
from qsv_pyg.quaternion import (  # noqa: E402
    conjugate,
    hamilton_product,
    random_unit_quaternion,
    rotate,
)

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
TOL32 = dict(rtol=1e-5, atol=1e-5)
#: Half-precision storage (inputs, outputs, saved alpha / u) with float32
#: accumulation, against float64 from the same rounded inputs.
TOL_HALF = {torch.float16: dict(rtol=5e-3, atol=5e-3),
            torch.bfloat16: dict(rtol=4e-2, atol=4e-2)}


@pytest.fixture(autouse=True)
def triton_path(monkeypatch):
    """The operator takes the Triton kernels (interpreted on CPU)."""
    monkeypatch.setenv("QSV_PYG_TRITON", "1" if CUDA else "interpret")


def gen(seed):
    return torch.Generator().manual_seed(seed)


def random_graph(n_src, n_dst, num_edges, seed, isolated=(0, )):
    """Random edges (repeats allowed) in shuffled order; ``isolated`` targets get none."""
    g = gen(seed)
    src = torch.randint(0, n_src, (num_edges, ), generator=g)
    dst = torch.randint(0, n_dst, (num_edges, ), generator=g)
    for i in isolated:
        dst[dst == i] = (i + 1) % n_dst
    return torch.stack([src, dst])


def make_inputs(n_src, n_dst, H, M, D, rotate_, seed):
    """float64 CPU inputs: features, unit quaternions (or None), keys, beta."""
    g = gen(seed)
    v = torch.randn(n_src, H, M, 4, generator=g, dtype=torch.float64)
    qs = random_unit_quaternion(n_src, H, generator=g, dtype=torch.float64) if rotate_ else None
    qd = random_unit_quaternion(n_dst, H, generator=g, dtype=torch.float64) if rotate_ else None
    ks = torch.randn(n_src, H, D, generator=g, dtype=torch.float64)
    kd = torch.randn(n_dst, H, D, generator=g, dtype=torch.float64)
    beta = 0.5 + torch.rand(H, generator=g, dtype=torch.float64)
    return [v, qs, qd, ks, kd, beta]


def literal(v, qs, qd, ks, kd, beta, edge_index, n_dst, use_abs, scale=None, bias=None):
    """From the definition, per edge: logit beta <k_i, k_j> (plus ``bias``
    ``[E, H]``, edge order, when given), softmax over each target's edges,
    message r v_j r* with r = q_i* q_j (times ``scale`` ``[E, H]``, edge order,
    when given; the weights returned unscaled), sum."""
    src, dst = edge_index
    d = (kd[dst] * ks[src]).sum(-1)
    logit = beta * (d.abs() if use_abs else d)
    if bias is not None:
        logit = logit + bias
    alpha = torch.zeros_like(logit)
    for i in range(n_dst):
        m = dst == i
        if m.any():
            alpha[m] = torch.softmax(logit[m], dim=0)
    msg = v[src]
    if qs is not None:
        r = hamilton_product(conjugate(qd[dst]), qs[src])
        msg = rotate(r.unsqueeze(-2), msg)
    w = alpha if scale is None else alpha * scale
    z = v.new_zeros(n_dst, *v.shape[1:]).index_add(0, dst, w[..., None, None] * msg)
    return z, alpha


def on_device(graph, index_dtype=None):
    """The GraphCSR's arrays on DEVICE (optionally as ``index_dtype``)."""
    return graph._replace(**{f: getattr(graph, f).to(DEVICE, index_dtype)
                             for f in graph._fields})


def op_graph(g):
    """The operator's graph arguments of a GraphCSR."""
    return g.rowptr, g.col, g.row, g.rowptr_t, g.perm_t, g.row_t


def run_both(inputs, edge_index, graph, n_dst, use_abs, dtype=torch.float32, seed=0,
             scale=None, bias=None):
    """``(got, want)``: z, alpha (edge order) and the gradients of every input
    for a random cotangent, by the operator (``dtype`` on DEVICE) and by
    autograd of :func:`literal` in float64 (from the same rounded inputs);
    ``scale`` ``[E, H]`` in edge order, handed to the operator sorted; so is
    the additive logit term ``bias``, an input too (its gradient comes last)."""
    g = gen(seed)
    if bias is not None:
        inputs = [*inputs, bias]
    ins = [None if t is None else t.to(dtype) for t in inputs]
    ref_ins = [None if t is None else t.double().requires_grad_() for t in ins]
    dev_ins = [None if t is None else t.to(DEVICE).requires_grad_() for t in ins]
    if scale is not None:
        scale = scale.to(dtype)
    nb = 1 if bias is not None else 0
    z_ref, a_ref = literal(*ref_ins[:len(ref_ins) - nb], edge_index, n_dst, use_abs,
                           scale=None if scale is None else scale.double(),
                           bias=ref_ins[-1] if nb else None)
    gz = torch.randn(z_ref.shape, generator=g, dtype=torch.float64)
    ga = torch.randn(a_ref.shape, generator=g, dtype=torch.float64)
    params = [t for t in ref_ins if t is not None]
    want = [z_ref, a_ref] + list(torch.autograd.grad(
        (z_ref * gz).sum() + (a_ref * ga).sum(), params, materialize_grads=True))
    graph = on_device(graph)
    calls = dict(tk.CALLS)
    edge_scale = None if scale is None else scale.to(DEVICE)[graph.perm]
    z, alpha = qsv_attend(*dev_ins[:len(dev_ins) - nb], graph, use_abs, edge_scale=edge_scale,
                          edge_logit=dev_ins[-1][graph.perm] if nb else None)
    alpha_edges = torch.empty_like(alpha).index_copy_(0, graph.perm, alpha)
    loss = (z.double() * gz.to(DEVICE)).sum() + (alpha_edges.double() * ga.to(DEVICE)).sum()
    dev_params = [t for t in dev_ins if t is not None]
    got = [z, alpha_edges] + list(torch.autograd.grad(loss, dev_params,
                                                      materialize_grads=True))
    # the Triton kernels ran (not the C++ or PyTorch fallback)
    assert tk.CALLS["forward"] > calls["forward"] and tk.CALLS["backward"] > calls["backward"]
    assert all(t.dtype == dtype for t in got)
    return [t.detach().cpu().double() for t in got], [t.detach() for t in want]


def assert_all_close(got, want, **tol):
    names = ["z", "alpha", "grad v", "grad 1", "grad 2", "grad 3", "grad 4", "grad 5",
             "grad 6"]
    assert len(got) == len(want)
    for name, a, b in zip(names, got, want):
        torch.testing.assert_close(a, b, **tol, msg=lambda m: f"{name}: {m}")


# ------------------------------------------------------------ the variants
VARIANTS = {  # name: (key dim D, use_abs, rotate)
    "learned": (4, False, True),
    "abs": (4, True, True),
    "uniform": (0, False, True),
    "positions": (3, False, True),
    "learned-no-transport": (4, False, False),
    "abs-no-transport": (4, True, False),
    "uniform-no-transport": (0, False, False),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variants_match_the_literal_formula(variant):
    """Every routing (learned, abs, uniform = D 0, other key sizes) and
    transport (rotate or not), forward and all gradients, float32 to 1e-5;
    target 0 is isolated (z = 0, no NaN)."""
    D, use_abs, rot = VARIANTS[variant]
    n_src, n_dst, H, M = 8, 6, 3, 2
    ei = random_graph(n_src, n_dst, 20, seed=1)
    inputs = make_inputs(n_src, n_dst, H, M, D, rot, seed=2)
    got, want = run_both(inputs, ei, build_csr(ei, n_src, n_dst), n_dst, use_abs)
    assert_all_close(got, want, **TOL32)
    assert torch.equal(got[0][0], torch.zeros_like(got[0][0]))


#: Launch configurations (edges per step, rows per program, warps): the
#: heuristic one, shorter steps, several rows per program (3: rows past the
#: last in a partly filled program; 4: the largest the tuner tries).
CONFIGS = [(16, 1, 1), (4, 2, 1), (2, 3, 2), (8, 4, 1)]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "BE%d-T%d-w%d" % c)
@pytest.mark.parametrize("variant", ["learned", "abs-no-transport"])
def test_every_launch_configuration_matches_the_literal_formula(variant, config,
                                                                monkeypatch):
    """Issue 32 item 8c/d: each configuration the tuner may pick, forward and
    every gradient, float32 to 1e-5, on a bipartite graph whose 7 targets and
    5 sources leave the last program part-empty, with an isolated target and
    rows longer than a step (a scale and an edge logit on)."""
    monkeypatch.setattr(tk, "candidates", lambda s, degree: [tk.Config(*config)])
    D, use_abs, rot = VARIANTS[variant]
    n_src, n_dst, H, M = 5, 7, 2, 1
    ei = random_graph(n_src, n_dst, 30, seed=50, isolated=(3, ))
    inputs = make_inputs(n_src, n_dst, H, M, D, rot, seed=51)
    got, want = run_both(inputs, ei, build_csr(ei, n_src, n_dst), n_dst, use_abs, seed=52,
                         scale=torch.rand(30, H, generator=gen(53), dtype=torch.float64),
                         bias=torch.randn(30, H, generator=gen(54), dtype=torch.float64))
    assert_all_close(got, want, **TOL32)
    assert torch.equal(got[0][3], torch.zeros_like(got[0][3]))


def test_tuned_launch_matches_the_untuned_one(monkeypatch):
    """With tuning on (``QSV_PYG_AUTOTUNE=1`` takes the interpreter too) every
    candidate runs on the call's own buffers before the chosen one: the result
    is the untuned one, and the choice is remembered per key."""
    monkeypatch.setattr(tt, "TUNED", {})
    monkeypatch.setattr(tt, "TIMINGS", {})
    monkeypatch.setattr(tt, "TUNE_REPEATS", 1)
    n_src, n_dst, H, M = 6, 6, 2, 1
    ei = random_graph(n_src, n_dst, 24, seed=55)
    inputs = make_inputs(n_src, n_dst, H, M, 4, True, seed=56)
    graph = build_csr(ei, n_src, n_dst)
    monkeypatch.setenv(tk.AUTOTUNE_ENV, "0")
    untuned, _ = run_both(inputs, ei, graph, n_dst, False, seed=57)
    assert not tt.TUNED
    monkeypatch.setenv(tk.AUTOTUNE_ENV, "1")
    tuned, want = run_both(inputs, ei, graph, n_dst, False, seed=57)
    assert {key[0] for key in tt.TUNED} == {"forward_rows", "backward_rows", "backward_cols"}
    for a, b in zip(tuned, untuned):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert_all_close(tuned, want, **TOL32)
    rows = tt.tuned()
    assert len(rows) == 3 and all(len(r["timings_us"]) >= 2 for r in rows)


@pytest.mark.parametrize("variant", ["learned", "uniform", "abs-no-transport"])
def test_edge_logit_matches_the_literal_formula(variant):
    """The additive logit term b_ij on the Triton kernels: forward, every
    gradient and dL/db, float32 to 1e-5 (several edge steps per row)."""
    D, use_abs, rot = VARIANTS[variant]
    n_src, n_dst, H, M = 7, 4, 2, 1
    ei = random_graph(n_src, n_dst, 40, seed=40)  # degree > BLOCK_E: several steps
    inputs = make_inputs(n_src, n_dst, H, M, D, rot, seed=41)
    bias = 2 * torch.randn(40, H, generator=gen(42), dtype=torch.float64)
    got, want = run_both(inputs, ei, build_csr(ei, n_src, n_dst), n_dst, use_abs, bias=bias,
                         seed=43, scale=torch.rand(40, H, generator=gen(44),
                                                   dtype=torch.float64))
    assert len(got) == 3 + len([t for t in inputs if t is not None])
    assert_all_close(got, want, **TOL32)


def test_opcheck_with_edge_logit_on_the_triton_path():
    n_src, n_dst, H, M = 4, 3, 2, 1
    ei = random_graph(n_src, n_dst, 8, seed=45)
    g = on_device(build_csr(ei, n_src, n_dst))
    v, qs, qd, ks, kd, beta = (t.float().to(DEVICE).requires_grad_()
                               for t in make_inputs(n_src, n_dst, H, M, 4, True, seed=46))
    bias = torch.randn(8, H, generator=gen(47)).to(DEVICE).requires_grad_()
    calls = dict(tk.CALLS)
    torch.library.opcheck(attend, (v, qs, qd, ks, kd, beta, v.new_empty(0), bias,
                                   *op_graph(g), False, True))
    assert tk.CALLS["forward"] > calls["forward"] and tk.CALLS["backward"] > calls["backward"]


def test_backward_walks_never_read_and_write_one_buffer():
    """Issue 32 item 6: backward_rows' second walk over a row read the parked
    softmax gradient from ``gd`` and overwrote it in the same iteration; on a GPU
    two threads of a program may own an entry in the two layouts, so a read could
    see another thread's store. Every loop of every kernel now loads from and
    stores to disjoint buffers (the interpreter, which runs sequentially, cannot
    show the race; the tests above check that the results are unchanged)."""
    import ast
    import inspect

    from qsv_pyg.nn import _triton_kernels as kernels

    def pointer(call):  # tl.load(ptr + off, ...) -> "ptr"
        node = call.args[0]
        while isinstance(node, ast.BinOp):
            node = node.left
        return node.id if isinstance(node, ast.Name) else None

    def calls(loop, name):
        return {pointer(n) for n in ast.walk(loop) if isinstance(n, ast.Call)
                and isinstance(n.func, ast.Attribute) and n.func.attr == name}

    for name in ("forward_rows", "backward_rows", "backward_cols"):
        src = inspect.getsource(getattr(kernels, name).fn)
        loops = [n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.For)]
        assert loops, name
        for loop in loops:
            both = calls(loop, "load") & calls(loop, "store")
            assert not both, f"{name}: a loop loads and stores {sorted(both)}"


def _batched(n_src, n_dst, B, seed):
    from qsv_pyg.nn.csr import batch_edge_index
    ei = random_graph(n_src, n_dst, 12, seed=seed)
    graph = batch_csr(build_csr(ei, n_src, n_dst), B, n_src, n_dst)
    return batch_edge_index(ei, B, n_src, n_dst), graph


@pytest.mark.parametrize("kind", ["bipartite", "batched", "empty", "wide-rows"])
def test_graphs_match_the_literal_formula(kind):
    """A bipartite graph with several isolated targets, ``B`` disjoint copies
    (``csr.batch_csr``: how per-item batches reach the operator), a graph
    without edges, and rows of many blocks with high degree (a batch riding
    along as channels; several edge steps per row)."""
    H, M = 2, 2
    if kind == "bipartite":
        n_src, n_dst = 9, 5
        ei = random_graph(n_src, n_dst, 16, seed=3, isolated=(0, 3))
        graph = build_csr(ei, n_src, n_dst)
    elif kind == "batched":
        n, B = 4, 2
        ei, graph = _batched(n, n, B, seed=4)
        n_src = n_dst = n * B
    elif kind == "empty":
        n_src, n_dst = 4, 3
        ei = torch.zeros(2, 0, dtype=torch.long)
        graph = build_csr(ei, n_src, n_dst)
    else:  # 40 edges into 2 targets, 64 blocks per row: several [BE, BH, BM] steps
        n_src, n_dst, H, M = 6, 2, 1, 64
        ei = random_graph(n_src, n_dst, 40, seed=5, isolated=())
        graph = build_csr(ei, n_src, n_dst)
    inputs = make_inputs(n_src, n_dst, H, M, 4, True, seed=6)
    got, want = run_both(inputs, ei, graph, n_dst, use_abs=False)
    assert_all_close(got, want, **TOL32)


def test_int32_indices_and_determinism():
    """int32 CSR arrays give the very same results as int64, and two runs
    agree bit for bit (no atomics)."""
    n_src, n_dst, H, M = 7, 5, 2, 1
    ei = random_graph(n_src, n_dst, 15, seed=7)
    g64 = build_csr(ei, n_src, n_dst)
    v, qs, qd, ks, kd, beta = (t.float().to(DEVICE).requires_grad_()
                               for t in make_inputs(n_src, n_dst, H, M, 4, True, seed=8))

    def run(index_dtype):
        z, alpha, *_ = attend(v, qs, qd, ks, kd, beta, v.new_empty(0), v.new_empty(0),
                              *op_graph(on_device(g64, index_dtype)), True, True)
        grads = torch.autograd.grad(z.pow(2).sum() + alpha.sin().sum(),
                                    (v, qs, qd, ks, kd, beta))
        return [z, alpha, *grads]

    calls = tk.CALLS["backward"]
    a, b = run(torch.int64), run(torch.int32)
    assert tk.CALLS["backward"] == calls + 2
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_precision_accumulates_in_float32(dtype):
    """float16 / bfloat16 inputs: outputs and gradients in that dtype, within
    a few of its rounding steps of the float64 result."""
    n_src, n_dst, H, M = 8, 6, 2, 2
    ei = random_graph(n_src, n_dst, 20, seed=9)
    inputs = make_inputs(n_src, n_dst, H, M, 4, True, seed=10)
    got, want = run_both(inputs, ei, build_csr(ei, n_src, n_dst), n_dst, use_abs=True,
                         dtype=dtype)
    assert_all_close(got, want, **TOL_HALF[dtype])


# ------------------------------------------- per-edge scale (attention dropout)
def dropout_scale(num_edges, H, p, seed):
    """0 with probability ``p``, else 1/(1-p): an attention-dropout scale ``[E, H]``."""
    keep = torch.rand(num_edges, H, generator=gen(seed)) >= p
    return keep.double() / (1 - p)


def general_scale(num_edges, H, seed):
    """Any real values (negative, zero, large): nothing assumes a mask."""
    s = 2 * torch.randn(num_edges, H, generator=gen(seed), dtype=torch.float64)
    s[::4] = 0
    return s


SCALE_CASES = [  # (variant, scale kind)
    ("learned", "dropout"),
    ("abs", "general"),
    ("uniform", "dropout"),
    ("learned-no-transport", "general"),
    ("abs-no-transport", "dropout"),
    ("uniform-no-transport", "general"),
]


@pytest.mark.parametrize("variant,scale_kind", SCALE_CASES,
                         ids=["-".join(c) for c in SCALE_CASES])
def test_edge_scale_matches_the_literal_formula(variant, scale_kind):
    """y_i = sum_j alpha_ij s_ij u_j on the three kernels (the per-source pass
    reads s through perm_t): z, the unscaled weights and every gradient."""
    D, use_abs, rot = VARIANTS[variant]
    n_src, n_dst, H, M, E = 8, 6, 3, 2, 20
    ei = random_graph(n_src, n_dst, E, seed=21)
    inputs = make_inputs(n_src, n_dst, H, M, D, rot, seed=22)
    scale = dropout_scale(E, H, 0.4, seed=23) if scale_kind == "dropout" else \
        general_scale(E, H, seed=23)
    got, want = run_both(inputs, ei, build_csr(ei, n_src, n_dst), n_dst, use_abs, seed=24,
                         scale=scale)
    assert_all_close(got, want, **TOL32)
    assert torch.equal(got[0][0], torch.zeros_like(got[0][0]))


@pytest.mark.parametrize("kind", ["bipartite", "wide-rows"])
def test_edge_scale_on_other_graphs(kind):
    """A bipartite graph with isolated targets (dropout scale), and rows of
    several edge steps (the online softmax rescales the scaled sum)."""
    if kind == "bipartite":
        n_src, n_dst, H, M, E = 9, 5, 2, 2, 16
        ei = random_graph(n_src, n_dst, E, seed=25, isolated=(0, 3))
        scale = dropout_scale(E, H, 0.5, seed=26)
    else:
        n_src, n_dst, H, M, E = 6, 2, 1, 64, 40
        ei = random_graph(n_src, n_dst, E, seed=27, isolated=())
        scale = general_scale(E, H, seed=26)
    inputs = make_inputs(n_src, n_dst, H, M, 4, True, seed=28)
    got, want = run_both(inputs, ei, build_csr(ei, n_src, n_dst), n_dst, use_abs=False,
                         scale=scale)
    assert_all_close(got, want, **TOL32)


def test_edge_scale_of_ones_is_no_scale():
    n_src, n_dst, H, M, E = 7, 5, 2, 2, 15
    ei = random_graph(n_src, n_dst, E, seed=29)
    graph = build_csr(ei, n_src, n_dst)
    inputs = make_inputs(n_src, n_dst, H, M, 4, True, seed=30)
    ones, _ = run_both(inputs, ei, graph, n_dst, True, seed=31,
                       scale=torch.ones(E, H, dtype=torch.float64))
    none, _ = run_both(inputs, ei, graph, n_dst, True, seed=31)
    assert_all_close(ones, none, rtol=1e-6, atol=1e-6)


def test_opcheck_with_edge_scale_on_the_triton_path():
    n_src, n_dst, H, M = 4, 3, 2, 1
    ei = random_graph(n_src, n_dst, 8, seed=32)
    g = on_device(build_csr(ei, n_src, n_dst))
    v, qs, qd, ks, kd, beta = (t.float().to(DEVICE).requires_grad_()
                               for t in make_inputs(n_src, n_dst, H, M, 4, True, seed=33))
    scale = dropout_scale(8, H, 0.5, seed=34).float().to(DEVICE)
    calls = dict(tk.CALLS)
    torch.library.opcheck(attend, (v, qs, qd, ks, kd, beta, scale, v.new_empty(0),
                                   *op_graph(g), False, True))
    assert tk.CALLS["forward"] > calls["forward"] and tk.CALLS["backward"] > calls["backward"]


# ---------------------------------------------------------- the operator
def test_opcheck_on_the_triton_path():
    n_src, n_dst, H, M = 4, 3, 2, 1
    ei = random_graph(n_src, n_dst, 8, seed=11)
    g = on_device(build_csr(ei, n_src, n_dst))
    v, qs, qd, ks, kd, beta = (t.float().to(DEVICE).requires_grad_()
                               for t in make_inputs(n_src, n_dst, H, M, 4, True, seed=12))
    calls = tk.CALLS["forward"]
    torch.library.opcheck(attend, (v, qs, qd, ks, kd, beta, v.new_empty(0), v.new_empty(0),
                                   *op_graph(g), False, True))
    assert tk.CALLS["forward"] > calls


def test_compiled_layer_calls_the_operator_and_matches_eager():
    """QSVConv under torch.compile (aot_eager): one graph that calls the
    operator (CSR built inside it), forward and gradients as in eager."""
    import torch._dynamo
    from torch._dynamo.backends.registry import lookup_backend

    from qsv_pyg.nn import QSVConv
    torch._dynamo.reset()
    torch.manual_seed(13)
    n, H = 7, 2
    conv = QSVConv(8, 3, heads=H, check_finite=False).to(DEVICE)
    ei = random_graph(n, n, 18, seed=14).to(DEVICE)
    x = torch.randn(n, 8, device=DEVICE)
    quat = random_unit_quaternion(n, H, generator=gen(15)).to(DEVICE)
    targets = []

    def backend(gm, example_inputs):
        targets.extend(node.target for node in gm.graph.nodes)
        return lookup_backend("aot_eager")(gm, example_inputs)

    def step(module):
        out = module(x, ei, quat=quat)
        grads = torch.autograd.grad(out.pow(2).sum(), list(conv.parameters()),
                                    materialize_grads=True)
        return [out, *grads]

    eager = step(conv)
    calls = dict(tk.CALLS)
    compiled = step(torch.compile(conv, fullgraph=True, backend=backend))
    assert torch.ops.qsv_pyg.attend.default in targets
    assert tk.CALLS["forward"] > calls["forward"] and tk.CALLS["backward"] > calls["backward"]
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, **TOL32)


@pytest.mark.parametrize("edge_message", [True, "target"])
def test_layer_with_edge_features_on_the_triton_path(edge_message):
    """QSVConv with edge features in the logit and the message, the per-source
    term and geometric routing (all in the additive term) on the Triton kernels:
    output and the gradients of the features and edge features against the
    literal per-edge formula of nn/reference.py, float64 inputs cast to float32."""
    from qsv_pyg.nn import QSVConv, qsv_conv_reference
    torch.manual_seed(16)
    n = 6
    conv = QSVConv(8, 3, heads=2, edge_dim=2, edge_message=edge_message, source_logit=True,
                   routing="geometric", add_self_loops=True).double().eval()
    ei = random_graph(n, n, 12, seed=17, isolated=())
    ei = ei[:, ei[0] != ei[1]]
    x = torch.randn(n, 8, generator=gen(18), dtype=torch.float64)
    ea = torch.randn(ei.size(1), 2, generator=gen(19), dtype=torch.float64)
    pos = torch.randn(n, 3, generator=gen(20), dtype=torch.float64)
    ref_in = [t.clone().requires_grad_() for t in (x, ea)]
    ref, _ = qsv_conv_reference(conv, ref_in[0], ei, pos=pos, edge_attr=ref_in[1])
    want = [ref, *torch.autograd.grad(ref.pow(2).sum(), ref_in)]
    conv = conv.float().to(DEVICE)
    dev_in = [t.float().to(DEVICE).requires_grad_() for t in (x, ea)]
    calls = dict(tk.CALLS)
    out = conv(dev_in[0], ei.to(DEVICE), dev_in[1], pos=pos.float().to(DEVICE))
    got = [out, *torch.autograd.grad(out.pow(2).sum(), dev_in)]
    assert tk.CALLS["forward"] > calls["forward"] and tk.CALLS["backward"] > calls["backward"]
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double().cpu(), b, rtol=1e-4, atol=1e-4)


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
def test_kernels_compile_for_a_gpu():
    """The interpreter runs the kernels as Python; this compiles them to a
    Hopper (sm_90) binary, as on a GPU, without one: bfloat16 storage of the
    features (quaternions, keys, β and weights float32), int32 indices, every
    feature on, two rows per program (the other flag combinations compile too), the gradient sums of
    shared inputs, the unit-quaternion kernels, and the layer's fused kernels
    (float32, with the per-head projection)."""
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    k = tk._kernels(False)
    if type(k.forward_rows).__name__ == "InterpretedFunction":
        pytest.skip("TRITON_INTERPRET=1 was set when the kernels were imported")
    f, i, a = "*bf16", "*i32", "*fp32"
    dims = dict(H="i32", M="i32", D="i32")
    strides = dict(gz_sn="i32", gz_sh="i32")
    rows = dict(N="i32")  # the row count: programs own TARGETS rows each
    blocks = dict(ACC=tl.float32, BE=16, BH=2, BM=8, BD=4, TARGETS=2)
    layer_dims = dict(H="i32", M="i32", F="i32", N="i32")
    specs = [
        (k.rotate_rows, dict(v=f, q=f, out=f, R="i32", M="i32"),
         dict(TRANSPOSE=True, ACC=tl.float32, BR=32, BM=8)),
        (k.forward_rows, dict(src=f, qd=a, ks=a, kd=a, beta=a, scale=a, bias=a, rowptr=i,
                              col=i, y_out=f, z_out=f, alpha_out=a, dot_out=a, **dims,
                              **rows),
         dict(USE_ABS=True, ROTATE=True, HAS_KEYS=True, HAS_SCALE=True, HAS_BIAS=True,
              **blocks)),
        (k.backward_rows, dict(gz=f, galpha=a, src=f, qd=a, ks=a, kd=a, beta=a, scale=a,
                               rowptr=i, col=i, alpha=a, y=f, ga_buf=a, gd=a, glogit=a,
                               gbeta_part=a, gqd=a, gkd=a, **dims, **strides, **rows),
         dict(USE_ABS=True, ROTATE=True, HAS_KEYS=True, HAS_GALPHA=True, HAS_SCALE=True,
              NEED_Q=True, NEED_K=True, NEED_BIAS=True, **blocks)),
        (k.backward_cols, dict(gz=f, v=f, qs=a, qd=a, kd=a, alpha=a, scale=a, gd=a,
                               rowptr_t=i, perm_t=i, row_t=i, gv=f, gqs=a, gks=a, gqd=a,
                               gkd=a, **dims, **strides, **rows),
         dict(ROTATE=True, HAS_SCALE=True, NEED_U=True, NEED_V=True, NEED_Q=True,
              NEED_K=True, SUM_QD=True, SUM_KD=True, KEYS_INTO_Q=True, **blocks)),
        (k.unit_rows, dict(q=a, out=a, R="i32"), dict(EPS=1e-8, ACC=tl.float32, BR=256)),
        (k.unit_rows_backward, dict(q=a, g=a, out=a, R="i32"),
         dict(EPS=1e-8, ACC=tl.float32, BR=256)),
        # the layer's fused kernels (qsv_pyg.nn.fused_layer: float32 / float64 only)
        (k.layer_rotate_rows, dict(v=a, h_raw=a, bq=a, qn=a, nrm=a, u=a, R="i32", H="i32", M="i32",
                                   h_sn="i32"), dict(EPS=1e-8, ACC=tl.float32, BR=64, BM=4)),
        (k.layer_forward_rows, dict(src=a, qn=a, log_beta=a, scale=a, rowptr=i, col=i,
                                    y_out=a, z_out=a, alpha_out=a, dot_out=a, w=a, h_raw=a,
                                    h_sn="i32", root_off="i32", bias=a, out=a, **layer_dims),
         dict(HAS_SCALE=True, MEAN=True, BF=16, **blocks)),
        (k.layer_backward_rows, dict(g=a, galpha=a, w=a, src=a, qn=a, log_beta=a, scale=a,
                                     rowptr=i, col=i, alpha=a, y=a, ga_buf=a, gd=a, gz=a, gh=a,
                                     gh_sn="i32", root_off="i32", beta_off="i32", gqd=a,
                                     gkd=a, **layer_dims),
         dict(HAS_GALPHA=True, HAS_SCALE=True, MEAN=True, BF=16, **blocks)),
        (k.layer_backward_cols, dict(gz=a, v=a, qn=a, alpha=a, scale=a, gd=a, rowptr_t=i,
                                     perm_t=i, row_t=i, gv=a, gh=a, gh_sn="i32", gks=a,
                                     gqd=a, gkd=a,
                                     nrm=a, H="i32", M="i32", N="i32"),
         dict(NEED_V=True, HAS_SCALE=True, **blocks)),
    ]
    for fn, sig, consts in specs:
        sig = {**sig, **{name: "constexpr" for name in consts}}
        try:
            binary = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                                    target=GPUTarget("cuda", 90, 32))
        except Exception as exc:  # pragma: no cover - no ptxas in this triton build
            if "ptxas" in str(exc).lower():
                pytest.skip(f"no ptxas: {exc!s:.200}")
            raise
        assert binary.asm["cubin"], fn.__name__


# ------------------------------------------------------- choice and errors
def test_available_and_the_dispatch(monkeypatch):
    cpu = torch.zeros(1)
    monkeypatch.setenv("QSV_PYG_TRITON", "interpret")
    assert tk.available(cpu) and qsv_kernel.backend(cpu) == "triton"
    assert not tk.available(cpu.long())
    monkeypatch.setenv("QSV_PYG_TRITON", "0")
    assert not tk.available(cpu) and qsv_kernel.backend(cpu) != "triton"
    monkeypatch.setenv("QSV_PYG_TRITON", "1")  # the default: CUDA tensors only
    assert not tk.available(cpu)
    if CUDA:
        assert tk.available(cpu.cuda())


@pytest.mark.skipif(CUDA, reason="a device-side assert ends the CUDA context")
def test_malformed_graph_is_refused():
    """The kernels index unchecked; the launcher refuses a bad CSR (a graph
    built under torch.compile skips the Python range check)."""
    n = 5
    g = on_device(build_csr(random_graph(n, n, 10, seed=16), n, n))
    v, qs, qd, ks, kd, beta = (t.float().to(DEVICE)
                               for t in make_inputs(n, n, 1, 1, 4, True, seed=17))
    bad_col = g.col.clone()
    bad_col[2] = n
    with pytest.raises(RuntimeError, match="malformed CSR"):
        tk.forward(v, qs, qd, ks, kd, beta, v.new_empty(0), v.new_empty(0), g.rowptr, bad_col,
                   False, True)



# ------------------------------------- issue 32: half storage, fewer launches
def _literal_shared(q, v, beta, edge_index, n, use_abs, rotate_, keys):
    """The literal formula with one quaternion tensor ``q`` as the transport of
    both sides and (``keys``) the routing keys of both sides."""
    k = q if keys else q.new_empty(n, q.size(1), 0)
    return literal(v, q if rotate_ else None, q if rotate_ else None, k, k, beta,
                   edge_index, n, use_abs)


@pytest.mark.parametrize("case", ["all", "keys-only", "quats-only"])
def test_one_tensor_as_several_inputs_sums_its_gradient_in_the_kernel(case, monkeypatch):
    """The layer passes its unit quaternions as qs, qd, ks and kd (homogeneous
    graph, learned routing): backward_cols sums their four gradients (SUM_QD,
    SUM_KD, KEYS_INTO_Q) instead of three autograd adds. The gradient of the one
    tensor matches autograd of the literal formula, and the kernel got the bits."""
    rotate_, keys = {"all": (True, True), "keys-only": (False, True),
                     "quats-only": (True, False)}[case]
    n, H, M = 7, 2, 2
    ei = random_graph(n, n, 24, seed=50, isolated=())
    g = gen(51)
    v = torch.randn(n, H, M, 4, generator=g, dtype=torch.float64)
    q = random_unit_quaternion(n, H, generator=g, dtype=torch.float64)
    beta = 0.5 + torch.rand(H, generator=g, dtype=torch.float64)
    ref = [t.clone().requires_grad_() for t in (q, v, beta)]
    z_ref, a_ref = _literal_shared(ref[0], ref[1], ref[2], ei, n, False, rotate_, keys)
    gz = torch.randn(z_ref.shape, generator=g, dtype=torch.float64)
    ga = torch.randn(a_ref.shape, generator=g, dtype=torch.float64)
    want = torch.autograd.grad((z_ref * gz).sum() + (a_ref * ga).sum(), ref)
    seen = []
    backward = tk.backward

    def spy(*args, **kwargs):
        seen.append(args[-1])
        return backward(*args, **kwargs)

    monkeypatch.setattr(tk, "backward", spy)
    graph = on_device(build_csr(ei, n, n))
    dev = [t.float().to(DEVICE).requires_grad_() for t in (q, v, beta)]
    qq = dev[0]
    k = qq if keys else qq.new_empty(n, H, 0)
    z, alpha = qsv_attend(dev[1], qq if rotate_ else None, qq if rotate_ else None, k, k,
                          dev[2], graph)
    alpha_edges = torch.empty_like(alpha).index_copy_(0, graph.perm, alpha)
    loss = (z.double() * gz.to(DEVICE)).sum() + (alpha_edges.double() * ga.to(DEVICE)).sum()
    got = torch.autograd.grad(loss, dev)
    bits = {"all": tk.SHARED_Q | tk.SHARED_K | tk.KEYS_ARE_Q, "keys-only": tk.SHARED_K,
            "quats-only": tk.SHARED_Q}[case]
    assert seen == [bits]
    for name, a, b in zip(["q", "v", "beta"], got, want):
        torch.testing.assert_close(a.double().cpu(), b, **TOL32, msg=lambda m: f"{name}: {m}")


def test_strided_gz_is_read_as_it_is(monkeypatch):
    """A gradient of z that is the transpose of a contiguous [H, N, M, 4] (as the
    layer's per-head projection gives it) reaches the kernels uncopied, and the
    gradients match those from a contiguous copy of it."""
    n_src, n_dst, H, M = 6, 5, 3, 2
    ei = random_graph(n_src, n_dst, 16, seed=52)
    graph = on_device(build_csr(ei, n_src, n_dst))
    ins = [t.float().to(DEVICE).requires_grad_()
           for t in make_inputs(n_src, n_dst, H, M, 4, True, seed=53)]
    w = torch.randn(H, n_dst, M, 4, generator=gen(54)).to(DEVICE)
    seen = []
    backward = tk.backward

    def spy(gz, *args, **kwargs):
        seen.append(gz.is_contiguous())
        return backward(gz, *args, **kwargs)

    monkeypatch.setattr(tk, "backward", spy)
    z, _ = qsv_attend(*ins, graph)
    strided = torch.autograd.grad((z.transpose(0, 1) * w).sum(), ins)
    z, _ = qsv_attend(*ins, graph)
    plain = torch.autograd.grad((z * w.transpose(0, 1).contiguous()).sum(), ins)
    assert seen == [False, True]
    for a, b in zip(strided, plain):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("autocast", [False, True], ids=["plain", "autocast"])
def test_half_features_reach_the_kernel_uncopied(dtype, autocast, monkeypatch):
    """Issue 32 item 7: half-precision features are the kernels' storage: ``v``
    reaches the forward launch in its dtype (no float32 copy), the quaternions,
    keys and β in float32; z comes back in the features' dtype (also under
    autocast), the weights in float32 under autocast; values and the gradients
    within half tolerance of the float64 literal formula from the same rounded
    features."""
    n_src, n_dst, H, M = 8, 6, 2, 2
    ei = random_graph(n_src, n_dst, 20, seed=55)
    v, qs, qd, ks, kd, beta = make_inputs(n_src, n_dst, H, M, 4, True, seed=56)
    v = v.to(dtype)
    ref = [t.double().requires_grad_() for t in (v, qs, qd, ks, kd, beta)]
    z_ref, a_ref = literal(*ref, ei, n_dst, False)
    gz = torch.randn(z_ref.shape, generator=gen(57), dtype=torch.float64)
    want = [z_ref, a_ref, *torch.autograd.grad((z_ref * gz).sum(), ref)]
    launched = []
    forward = tk.forward

    def spy(*args, **kwargs):
        launched.append([t.dtype for t in args[:6]])
        return forward(*args, **kwargs)

    monkeypatch.setattr(tk, "forward", spy)
    graph = on_device(build_csr(ei, n_src, n_dst))
    dev = [v.to(DEVICE).requires_grad_()] + [t.float().to(DEVICE).requires_grad_()
                                             for t in (qs, qd, ks, kd, beta)]
    with torch.autocast(DEVICE.type, dtype=dtype, enabled=autocast):
        z, alpha = qsv_attend(*dev, graph)
    assert launched == [[dtype] + [torch.float32] * 5]
    assert z.dtype == dtype and alpha.dtype == (torch.float32 if autocast else dtype)
    alpha_edges = torch.empty_like(alpha).index_copy_(0, graph.perm, alpha)
    grads = torch.autograd.grad((z.double() * gz.to(DEVICE)).sum(), dev)
    assert grads[0].dtype == dtype and all(g.dtype == torch.float32 for g in grads[1:])
    got = [z, alpha_edges, *grads]
    for name, a, b in zip(["z", "alpha", "v", "qs", "qd", "ks", "kd", "beta"], got, want):
        torch.testing.assert_close(a.double().cpu(), b, **TOL_HALF[dtype],
                                   msg=lambda m: f"{name}: {m}")


def test_unit_quaternion_kernels_match_the_pytorch_formula(monkeypatch):
    """unit_quaternion on the Triton path (one launch each way): values and
    gradients as the PyTorch ops, zero and tiny quaternions the identity with a
    zero gradient, a NaN propagated; a double backward still exact (PyTorch
    formula)."""
    from qsv_pyg import quaternion as Q
    g = gen(58)
    q = torch.randn(40, 3, 4, generator=g, dtype=torch.float64)
    q[0, 0] = 0
    q[1, 1] = 1e-12
    q[2, 2, 1] = float("nan")
    grad = torch.randn(q.shape, generator=g, dtype=torch.float64)
    calls = []
    unit = tk.unit_quaternion

    def spy(*args):
        calls.append(1)
        return unit(*args)

    monkeypatch.setattr(tk, "unit_quaternion", spy)
    for dtype in (torch.float32, torch.float64):
        x = q.to(dtype).to(DEVICE).requires_grad_()
        u = Q.unit_quaternion(x)
        (gx, ) = torch.autograd.grad(u, x, grad.to(dtype).to(DEVICE))
        with monkeypatch.context() as m:
            m.setenv("QSV_PYG_TRITON", "0")
            x0 = q.to(dtype).to(DEVICE).requires_grad_()
            u0 = Q.unit_quaternion(x0)
            (g0, ) = torch.autograd.grad(u0, x0, grad.to(dtype).to(DEVICE))
        tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-12,
                                                                           atol=1e-12)
        torch.testing.assert_close(u, u0, equal_nan=True, **tol)
        torch.testing.assert_close(gx, g0, equal_nan=True, **tol)
        assert torch.equal(u[0, 0].cpu(), torch.tensor([1.0, 0, 0, 0], dtype=dtype))
        assert torch.equal(gx[0, 0].cpu(), torch.zeros(4, dtype=dtype))
        assert torch.isnan(u[2, 2]).all()
    assert len(calls) == 2
    x = q[3:].to(DEVICE).requires_grad_()  # double backward: the PyTorch formula
    assert torch.autograd.gradcheck(lambda t: Q.unit_quaternion(t), (x[:3], ))
    assert torch.autograd.gradgradcheck(lambda t: Q.unit_quaternion(t), (x[:3], ))
