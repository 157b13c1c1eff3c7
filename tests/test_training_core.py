"""Optimiser backends, LR schedule and checkpointing (tiny CPU models only)."""
import copy
import os
import random
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qsv_pyg.models.base import ImageClassifier
from qsv_pyg.training.checkpoint import (
    CheckpointError,
    capture_rng_state,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
)
from qsv_pyg.training.optim import ProjectedAdamW, build_optimizer, optimizer_backend
from qsv_pyg.training.schedule import warmup_cosine, warmup_cosine_factor

# The optimiser back-ends but "auto" (which picks one of them).
CONCRETE_OPTIMIZER_BACKENDS = ["riemannian", "projected"]


def _needs(backend):
    if backend == "riemannian":
        pytest.importorskip("geoopt")


class ToyQuatNet(ImageClassifier):
    """Pooled colour → quaternion, scored against a [5, 4] field on S³, then classified."""

    def __init__(self, num_classes: int = 3):
        super().__init__()
        self.q = nn.Parameter(torch.randn(5, 4) * 3)  # off-sphere on purpose: the optimiser projects
        self.norm = nn.LayerNorm(5)
        self.head = nn.Linear(5, num_classes)

    def forward(self, images):
        x = F.pad(images.mean(dim=(2, 3)), (1, 0))  # [B, 3] -> [B, 4]
        return self.head(self.norm(x @ self.q.T))  # [B, 5] -> [B, C]

    def sphere_parameters(self):
        return [self.q]


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(16, 3, 4, 4, generator=g)
    labels = torch.randint(0, 3, (16,), generator=g)
    target = F.normalize(torch.randn(5, 4, generator=g), dim=-1)
    return images, labels, target


def _loss(model, images, labels, target):
    # Task loss plus a pull of the sphere field towards a target, so q must move.
    align = (1 - (model.q * target).sum(-1)).mean()
    return F.cross_entropy(model(images), labels) + align


def _train(model, opt, steps, data, sched=None):
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = _loss(model, *data)
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses


def _group_of(opt, p):
    return next(g for g in opt.param_groups if any(q is p for q in g["params"]))


# --------------------------------------------------------------------------- optimiser


@pytest.mark.parametrize("backend", CONCRETE_OPTIMIZER_BACKENDS)
def test_sphere_stays_unit_norm_and_loss_decreases(backend):
    _needs(backend)
    torch.manual_seed(0)
    model = ToyQuatNet()
    opt = build_optimizer(model, lr=0.05, weight_decay=0.1, backend=backend)
    assert optimizer_backend(opt) == backend
    data = _data()
    q0 = model.q.detach().clone()
    assert torch.allclose(q0.norm(dim=-1), torch.ones(5), atol=1e-5)  # projected at build time
    losses = []
    for _ in range(30):
        losses += _train(model, opt, 1, data)
        assert torch.allclose(model.q.norm(dim=-1), torch.ones(5), atol=1e-5)
    assert losses[-1] < 0.8 * losses[0]
    assert not torch.allclose(model.q, q0)


@pytest.mark.parametrize("backend", CONCRETE_OPTIMIZER_BACKENDS)
def test_no_weight_decay_on_sphere_bias_norm(backend):
    _needs(backend)
    model = ToyQuatNet()
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.1, backend=backend)
    sphere = model.sphere_parameters()[0]
    assert _group_of(opt, sphere)["weight_decay"] == 0.0 and _group_of(opt, sphere)["sphere"]
    for p in (model.head.bias, model.norm.weight, model.norm.bias):
        assert _group_of(opt, p)["weight_decay"] == 0.0
    assert _group_of(opt, model.head.weight)["weight_decay"] == 0.1
    n_in_opt = sum(len(g["params"]) for g in opt.param_groups)
    assert n_in_opt == len(list(model.parameters()))


def test_backends_apply_identical_decoupled_weight_decay():
    pytest.importorskip("geoopt")
    lr, wd = 0.1, 0.5
    results = {}
    for backend in CONCRETE_OPTIMIZER_BACKENDS:
        torch.manual_seed(0)
        model = ToyQuatNet()
        opt = build_optimizer(model, lr=lr, weight_decay=wd, backend=backend)
        w0, q0 = model.head.weight.detach().clone(), model.q.detach().clone()
        for p in model.parameters():
            p.grad = torch.zeros_like(p)  # zero gradient: only weight decay acts
        opt.step()
        assert torch.allclose(model.head.weight, w0 * (1 - lr * wd))
        assert torch.allclose(model.q, q0, atol=1e-6)
        results[backend] = model.head.weight.detach()
    assert torch.equal(results["riemannian"], results["projected"])


def test_auto_prefers_riemannian_when_geoopt_importable():
    geoopt = pytest.importorskip("geoopt")
    model = ToyQuatNet()
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.0, backend="auto")
    assert optimizer_backend(opt) == "riemannian"
    assert isinstance(opt, geoopt.optim.RiemannianAdam)
    # the plain Parameter was swapped for a ManifoldParameter on the sphere, same state_dict key
    assert isinstance(model.q, geoopt.ManifoldParameter)
    assert isinstance(model.q.manifold, geoopt.Sphere)
    assert model.sphere_parameters()[0] is model.q
    assert _group_of(opt, model.q)["sphere"]
    assert set(model.state_dict()) == set(ToyQuatNet().state_dict())


def test_auto_falls_back_to_projected_without_geoopt(monkeypatch):
    monkeypatch.setitem(sys.modules, "geoopt", None)  # makes `import geoopt` raise ImportError
    model = ToyQuatNet()
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.0, backend="auto")
    assert optimizer_backend(opt) == "projected"
    assert isinstance(opt, ProjectedAdamW)
    assert type(model.q) is nn.Parameter
    with pytest.raises(ImportError, match="geoopt"):
        build_optimizer(ToyQuatNet(), lr=1e-3, weight_decay=0.0, backend="riemannian")


@pytest.mark.parametrize("backend", CONCRETE_OPTIMIZER_BACKENDS)
def test_optimizer_state_dict_round_trip(backend):
    _needs(backend)
    torch.manual_seed(0)
    data = _data()
    model_a = ToyQuatNet()
    model_b = copy.deepcopy(model_a)
    opt_a = build_optimizer(model_a, lr=0.05, weight_decay=0.1, backend=backend)
    _train(model_a, opt_a, 3, data)

    model_b.load_state_dict(model_a.state_dict())
    opt_b = build_optimizer(model_b, lr=0.05, weight_decay=0.1, backend=backend)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    assert [g["name"] for g in opt_b.param_groups] == [g["name"] for g in opt_a.param_groups]

    _train(model_a, opt_a, 3, data)
    _train(model_b, opt_b, 3, data)
    for (name, pa), pb in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.equal(pa, pb), name


def test_invalid_sphere_parameters_rejected():
    model = ToyQuatNet()
    model.q = nn.Parameter(torch.randn(5, 3))
    with pytest.raises(ValueError, match=r"\[\.\.\., 4\]"):
        build_optimizer(model, lr=1e-3, weight_decay=0.0, backend="projected")

    class Stray(ToyQuatNet):
        def sphere_parameters(self):
            return [nn.Parameter(torch.randn(2, 4))]  # not registered in the module

    for backend in CONCRETE_OPTIMIZER_BACKENDS:
        _needs(backend)
        with pytest.raises(ValueError, match="not .*parameters of the model"):
            build_optimizer(Stray(), lr=1e-3, weight_decay=0.0, backend=backend)
    with pytest.raises(ValueError, match="backend"):
        build_optimizer(ToyQuatNet(), lr=1e-3, weight_decay=0.0, backend="sgd")


# --------------------------------------------------------------------------- schedule


def _lrs(warmup, total, min_ratio, n):
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=2.0)
    sched = warmup_cosine(opt, warmup, total, min_ratio)
    lrs = []
    for _ in range(n):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


def test_warmup_rises_linearly():
    lrs = _lrs(warmup=4, total=20, min_ratio=0.1, n=5)
    assert lrs[:4] == pytest.approx([0.5, 1.0, 1.5, 2.0])
    assert lrs[4] == pytest.approx(2.0)


def test_cosine_reaches_min_at_end():
    lrs = _lrs(warmup=4, total=20, min_ratio=0.1, n=26)
    decay = lrs[4:21]
    assert all(a >= b for a, b in zip(decay, decay[1:]))
    assert lrs[12] == pytest.approx(2.0 * (0.1 + 0.9 * 0.5))  # halfway through the cosine
    assert lrs[20] == pytest.approx(0.2)  # min_lr_ratio * base lr after total_steps
    assert lrs[25] == pytest.approx(0.2)  # held afterwards
    assert warmup_cosine_factor(10, 0, 10) == pytest.approx(0.0)
    assert warmup_cosine_factor(0, 0, 10) == pytest.approx(1.0)


def test_schedule_validates_arguments():
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError):
        warmup_cosine(opt, warmup_steps=11, total_steps=10)
    with pytest.raises(ValueError):
        warmup_cosine(opt, warmup_steps=0, total_steps=10, min_lr_ratio=1.5)


# --------------------------------------------------------------------------- checkpoint


def test_checkpoint_round_trip(tmp_path):
    path = tmp_path / "sub" / "ckpt.pt"
    save_checkpoint(path, {"w": torch.arange(3.0), "step": 7, "name": "run"})
    state = load_checkpoint(path)
    assert torch.equal(state["w"], torch.arange(3.0)) and state["step"] == 7
    assert os.listdir(path.parent) == ["ckpt.pt"]


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_checkpoint_write_is_atomic(tmp_path, monkeypatch, exc):
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, {"step": 1, "w": torch.ones(4)})

    def crashing_save(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 half a checkpoint")  # some bytes reach the temp file
        f.flush()
        raise exc("simulated crash mid-write")

    monkeypatch.setattr(torch, "save", crashing_save)
    with pytest.raises(exc, match="simulated crash"):
        save_checkpoint(path, {"step": 2, "w": torch.zeros(4)})
    monkeypatch.undo()

    assert os.listdir(tmp_path) == ["ckpt.pt"]  # no temp file left behind
    state = load_checkpoint(path)
    assert state["step"] == 1 and torch.equal(state["w"], torch.ones(4))


def test_truncated_checkpoint_raises_checkpoint_error(tmp_path):
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, {"w": torch.randn(64, 64)})
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="not a valid checkpoint") as info:
        load_checkpoint(path)
    assert str(path) in str(info.value)
    assert isinstance(info.value, RuntimeError)

    path.write_bytes(b"definitely not a checkpoint")
    with pytest.raises(CheckpointError, match="not a valid checkpoint"):
        load_checkpoint(path)


def test_missing_checkpoint_raises_file_not_found(tmp_path):
    path = tmp_path / "nope.pt"
    with pytest.raises(FileNotFoundError, match="nope.pt"):
        load_checkpoint(path)


def test_checkpoint_format_version_checked(tmp_path):
    path = tmp_path / "ckpt.pt"
    torch.save({"format_version": 99, "state": {}}, path)
    with pytest.raises(CheckpointError, match="version 99"):
        load_checkpoint(path)
    torch.save({"model": {}}, path)  # a raw torch.save file, not ours
    with pytest.raises(CheckpointError, match="format_version"):
        load_checkpoint(path)


def _draw():
    return torch.rand(5), random.random(), np.random.rand(3), np.random.randn(1)


def test_rng_capture_restore_reproduces_numbers(tmp_path):
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    np.random.randn(1)  # leaves a cached Gaussian in numpy's state
    state = capture_rng_state()
    first = _draw()
    # survives a weights_only save/load round trip
    save_checkpoint(tmp_path / "rng.pt", {"rng": state})
    restore_rng_state(load_checkpoint(tmp_path / "rng.pt")["rng"])
    second = _draw()
    assert torch.equal(first[0], second[0])
    assert first[1] == second[1]
    assert np.array_equal(first[2], second[2]) and np.array_equal(first[3], second[3])


@pytest.mark.parametrize("backend", CONCRETE_OPTIMIZER_BACKENDS)
def test_resume_from_checkpoint_is_bit_identical(tmp_path, backend):
    _needs(backend)

    def run(model, opt, sched, steps):
        for _ in range(steps):
            # fresh random data each step, so resumption depends on the RNG state too
            data = (torch.randn(8, 3, 4, 4), torch.randint(0, 3, (8,)),
                    F.normalize(torch.randn(5, 4), dim=-1))
            _train(model, opt, 1, data, sched)

    def fresh():
        torch.manual_seed(0)
        model = ToyQuatNet()
        opt = build_optimizer(model, lr=0.05, weight_decay=0.1, backend=backend)
        return model, opt, warmup_cosine(opt, warmup_steps=2, total_steps=6)

    straight = fresh()
    run(*straight, 6)

    model, opt, sched = fresh()
    run(model, opt, sched, 3)
    save_checkpoint(tmp_path / "ckpt.pt", {
        "model": model.state_dict(), "optim": opt.state_dict(),
        "sched": sched.state_dict(), "rng": capture_rng_state()})
    torch.manual_seed(123)  # clobber the RNG: the restore must undo this

    model, opt, sched = fresh()
    state = load_checkpoint(tmp_path / "ckpt.pt")
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    sched.load_state_dict(state["sched"])
    restore_rng_state(state["rng"])
    run(model, opt, sched, 3)

    for (name, pa), pb in zip(straight[0].named_parameters(), model.parameters()):
        assert torch.equal(pa, pb), name


def test_cleanup_distributed_waits_for_the_ranks_before_destroying_the_group(monkeypatch):
    """A two-process CPU run hung at exit in 2 of 7 tries: the group's destructor
    joined gloo's worker thread while holding the GIL, and that thread waited for
    the GIL to free the last all_gather's tensors. cleanup_distributed now passes a
    barrier and a pause (both without the GIL) before destroying the group."""
    from qsv_pyg.training import distributed as D
    calls = []
    monkeypatch.setattr(D.dist, "is_available", lambda: True)
    monkeypatch.setattr(D.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(D.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(D.dist, "barrier", lambda: calls.append("barrier"))
    monkeypatch.setattr(D.time, "sleep", lambda s: calls.append(("sleep", s)))
    monkeypatch.setattr(D.dist, "destroy_process_group", lambda: calls.append("destroy"))
    D.cleanup_distributed()
    assert calls[0] == "barrier" and calls[-1] == "destroy" and calls[1][0] == "sleep"
    calls.clear()
    monkeypatch.setattr(D.dist, "get_world_size", lambda: 1)
    D.cleanup_distributed()
    assert calls == ["destroy"]  # one process: nothing to wait for
