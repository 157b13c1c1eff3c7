import pytest
import torch

from qsv_pyg.quaternion import (
    conjugate,
    hamilton_product,
    identity_quaternion,
    normalize,
    quaternion_to_matrix,
    random_unit_quaternion,
    rotate,
    rotate_blocks,
)

DTYPES = [torch.float32, torch.float64]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5),
       torch.float64: dict(rtol=1e-12, atol=1e-12)}


def rand(*shape, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype)


def runit(*shape, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return random_unit_quaternion(*shape, generator=g, dtype=dtype)


def close(a, b, dtype):
    torch.testing.assert_close(a, b, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_hamilton_basis_table(dtype):
    one, i, j, k = torch.eye(4, dtype=dtype)
    close(hamilton_product(i, j), k, dtype)
    close(hamilton_product(j, k), i, dtype)
    close(hamilton_product(k, i), j, dtype)
    close(hamilton_product(j, i), -k, dtype)
    for u in (i, j, k):
        close(hamilton_product(u, u), -one, dtype)
        close(hamilton_product(one, u), u, dtype)
    close(hamilton_product(hamilton_product(i, j), k), -one, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_associativity(dtype):
    a, b, c = (rand(20, 4, dtype=dtype, seed=s) for s in range(3))
    close(hamilton_product(hamilton_product(a, b), c),
          hamilton_product(a, hamilton_product(b, c)), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_is_multiplicative(dtype):
    a, b = rand(20, 4, dtype=dtype, seed=1), rand(20, 4, dtype=dtype, seed=2)
    close(hamilton_product(a, b).norm(dim=-1), a.norm(dim=-1) * b.norm(dim=-1), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_conjugate_of_product(dtype):
    a, b = rand(20, 4, dtype=dtype, seed=3), rand(20, 4, dtype=dtype, seed=4)
    close(conjugate(hamilton_product(a, b)),
          hamilton_product(conjugate(b), conjugate(a)), dtype)
    close(conjugate(conjugate(a)), a, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_product_with_conjugate_is_squared_norm(dtype):
    q = rand(20, 4, dtype=dtype, seed=5)
    n2 = q.pow(2).sum(-1, keepdim=True)
    expected = n2 * identity_quaternion(20, dtype=dtype)
    close(hamilton_product(q, conjugate(q)), expected, dtype)
    close(hamilton_product(conjugate(q), q), expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_matrix_is_rotation(dtype):
    R = quaternion_to_matrix(runit(30, dtype=dtype, seed=6))
    assert R.shape == (30, 3, 3) and R.dtype == dtype
    eye = torch.eye(3, dtype=dtype).expand(30, 3, 3)
    close(R @ R.transpose(-1, -2), eye, dtype)
    close(R.transpose(-1, -2) @ R, eye, dtype)
    close(torch.linalg.det(R), torch.ones(30, dtype=dtype), dtype)
    # Identity and antipodal quaternions.
    close(quaternion_to_matrix(identity_quaternion(dtype=dtype)), torch.eye(3, dtype=dtype),
          dtype)
    q = runit(5, dtype=dtype, seed=7)
    close(quaternion_to_matrix(-q), quaternion_to_matrix(q), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotate_matches_matrix_and_keeps_real_part(dtype):
    q = runit(25, dtype=dtype, seed=8)
    x = rand(25, 4, dtype=dtype, seed=9)
    y = rotate(q, x)
    close(y[..., 0], x[..., 0], dtype)
    close(y[..., 1:], (quaternion_to_matrix(q) @ x[..., 1:].unsqueeze(-1)).squeeze(-1),
          dtype)
    close(y.norm(dim=-1), x.norm(dim=-1), dtype)
    # Known rotation: 90 degrees about z sends e_x to e_y.
    c = torch.tensor(0.5, dtype=dtype).sqrt()
    qz = torch.stack([c, 0 * c, 0 * c, c])
    ex = torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=dtype)
    close(rotate(qz, ex), torch.tensor([0.0, 0.0, 1.0, 0.0], dtype=dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotate_blocks_equals_rotate_per_block(dtype):
    q = runit(6, 2, dtype=dtype, seed=10)
    x = rand(6, 2, 5, 4, dtype=dtype, seed=11)
    y = rotate_blocks(q, x)
    assert y.shape == x.shape
    close(y, rotate(q.unsqueeze(-2), x), dtype)
    for b in range(5):
        close(y[..., b, :], rotate(q, x[..., b, :]), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotation_composition(dtype):
    a, b = runit(15, dtype=dtype, seed=12), runit(15, dtype=dtype, seed=13)
    x = rand(15, 4, dtype=dtype, seed=14)
    close(rotate(a, rotate(b, x)), rotate(hamilton_product(a, b), x), dtype)
    close(quaternion_to_matrix(a) @ quaternion_to_matrix(b),
          quaternion_to_matrix(hamilton_product(a, b)), dtype)
    xb = rand(15, 3, 4, dtype=dtype, seed=15)
    close(rotate_blocks(a, rotate_blocks(b, xb)), rotate_blocks(hamilton_product(a, b), xb),
          dtype)
    # Rotating by q then by q* is the identity.
    close(rotate(conjugate(a), rotate(a, x)), x, dtype)


def test_broadcasting_shapes():
    a = rand(5, 1, 4, seed=16)
    b = rand(1, 3, 4, seed=17)
    ab = hamilton_product(a, b)
    assert ab.shape == (5, 3, 4)
    torch.testing.assert_close(ab, hamilton_product(a.expand(5, 3, 4), b.expand(5, 3, 4)))
    assert hamilton_product(rand(4, seed=18), b).shape == (1, 3, 4)
    assert rotate(rand(2, 1, 4, seed=19), rand(7, 4, seed=20)).shape == (2, 7, 4)
    assert quaternion_to_matrix(rand(2, 3, 4, seed=21)).shape == (2, 3, 3, 3)
    assert conjugate(rand(2, 3, 4)).shape == (2, 3, 4)
    assert normalize(rand(2, 3, 4)).shape == (2, 3, 4)
    q = runit(4, 1, seed=22)
    assert rotate_blocks(q, rand(4, 1, 6, 4, seed=23)).shape == (4, 1, 6, 4)
    assert rotate_blocks(q.squeeze(1), rand(4, 6, 4, seed=24)).shape == (4, 6, 4)
    assert identity_quaternion(2, 3).shape == (2, 3, 4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dtype_and_device_preserved(dtype):
    dev = torch.device("cpu")
    a = rand(3, 4, dtype=dtype).to(dev)
    b = rand(3, 4, dtype=dtype, seed=1).to(dev)
    outs = [hamilton_product(a, b), conjugate(a), normalize(a), quaternion_to_matrix(a),
            rotate(a, b), rotate_blocks(normalize(a), b.view(3, 1, 4)),
            random_unit_quaternion(3, dtype=dtype, device=dev),
            identity_quaternion(3, dtype=dtype, device=dev)]
    for out in outs:
        assert out.dtype == dtype and out.device == dev


@pytest.mark.parametrize("dtype", DTYPES)
def test_random_unit_quaternion(dtype):
    q = random_unit_quaternion(100, dtype=dtype)
    assert q.shape == (100, 4) and q.dtype == dtype
    close(q.norm(dim=-1), torch.ones(100, dtype=dtype), dtype)
    # Reproducible with a generator.
    q1 = random_unit_quaternion(4, 2, generator=torch.Generator().manual_seed(3), dtype=dtype)
    q2 = random_unit_quaternion(4, 2, generator=torch.Generator().manual_seed(3), dtype=dtype)
    q3 = random_unit_quaternion(4, 2, generator=torch.Generator().manual_seed(4), dtype=dtype)
    assert torch.equal(q1, q2) and not torch.equal(q1, q3)
    # A shape tuple (or torch.Size) is accepted like varargs.
    q4 = random_unit_quaternion((4, 2), generator=torch.Generator().manual_seed(3),
                                dtype=dtype)
    assert torch.equal(q1, q4)
    assert random_unit_quaternion(torch.Size([2, 3])).shape == (2, 3, 4)
    assert random_unit_quaternion().shape == (4, )


def test_random_unit_quaternion_default_dtype():
    assert random_unit_quaternion(2).dtype == torch.get_default_dtype()


@pytest.mark.parametrize("dtype", DTYPES)
def test_normalize(dtype):
    q = rand(10, 4, dtype=dtype, seed=25) * 3
    close(normalize(q).norm(dim=-1), torch.ones(10, dtype=dtype), dtype)
    z = normalize(torch.zeros(2, 4, dtype=dtype))
    assert torch.isfinite(z).all()


def _gc(fn, *inputs):
    inputs = tuple(t.detach().requires_grad_() for t in inputs)
    assert torch.autograd.gradcheck(fn, inputs)


def test_gradcheck_hamilton_product():
    _gc(hamilton_product, rand(3, 4, seed=26), rand(3, 4, seed=27))


def test_gradcheck_quaternion_to_matrix():
    _gc(quaternion_to_matrix, rand(3, 4, seed=28))


def test_gradcheck_rotate():
    _gc(rotate, rand(3, 4, seed=29), rand(3, 4, seed=30))
    _gc(rotate_blocks, runit(2, seed=31), rand(2, 3, 4, seed=32))


def test_gradcheck_normalize():
    _gc(normalize, rand(3, 4, seed=33))


def test_gradcheck_conjugate():
    _gc(conjugate, rand(3, 4, seed=34))


@pytest.mark.parametrize("fn,args", [
    (hamilton_product, ((3, 3), (3, 4))),
    (hamilton_product, ((3, 4), (3, 5))),
    (conjugate, ((3, 3), )),
    (normalize, ((2, 2), )),
    (quaternion_to_matrix, ((3, ), )),
    (rotate, ((3, 4), (3, 3))),
    (rotate, ((3, 3), (3, 4))),
    (rotate_blocks, ((3, 4), (3, 2, 3))),
    (rotate_blocks, ((3, 3), (3, 2, 4))),
])
def test_shape_errors(fn, args):
    with pytest.raises(ValueError, match="last dimension of size 4"):
        fn(*(torch.zeros(*s) for s in args))
