"""Optimiser factory: Adam(W) on Euclidean parameters, sphere-aware on the quaternion field.

Models declare unit-quaternion parameters through
:meth:`qsv_pyg.models.base.ImageClassifier.sphere_parameters` (shape ``[..., 4]``,
unit norm along the last dim). Two backends keep them on S³:

* ``"riemannian"``: :class:`geoopt.optim.RiemannianAdam`. The Euclidean
  gradient is projected onto the tangent space, the moments are transported
  and the step is retracted onto the sphere. The step is geoopt's update
  computed with foreach ops (a few dozen ops per step instead of geoopt's
  per-parameter loop of ~19 ops per parameter); geoopt's loop stays available
  as ``step_per_parameter()``. geoopt recognises sphere
  parameters by type, so plain ``nn.Parameter`` sphere parameters are
  **replaced in place** inside the model by ``geoopt.ManifoldParameter`` objects
  on ``geoopt.Sphere()`` (same data, same ``state_dict`` key). Build the
  optimiser before taking other references to those parameters.
* ``"projected"``: :class:`ProjectedAdamW` – plain AdamW followed by
  renormalisation to unit norm after every step. No extra dependency.
* ``"auto"``: ``"riemannian"`` when geoopt is importable, else ``"projected"``.

Both backends use decoupled (AdamW-style) weight decay on Euclidean weight
matrices only: sphere parameters, biases, normalisation weights and every
parameter with ``ndim <= 1`` (e.g. per-head routing temperatures) get none.
Either way a single :class:`torch.optim.Optimizer` is returned, so LR
schedulers and ``state_dict()`` / ``load_state_dict()`` work unchanged.
"""
from __future__ import annotations

import functools
from types import ModuleType
from typing import Dict, Iterable, List, Tuple

import torch
from torch import nn

from ..utils import import_geoopt

#: Values of ``backend`` (``--optimizer``): the optimiser implementations (the kernel
#: implementations are :data:`qsv_pyg.nn.qsv_kernel.BACKENDS`).
OPTIMIZER_BACKENDS = ("auto", "riemannian", "projected")

# Modules whose (affine) weights are scales, not features: decaying them to 0 is harmful.
_NORM_TYPES: Tuple[type, ...] = tuple(
    t for t in (
        nn.modules.batchnorm._NormBase,  # BatchNorm*d, SyncBatchNorm, InstanceNorm*d
        nn.LayerNorm,
        nn.GroupNorm,
        getattr(nn, "RMSNorm", None),
    ) if t is not None)


@torch.no_grad()
def _normalise_(p: torch.Tensor, eps: float = 1e-12) -> None:
    """Project ``p`` onto the unit sphere along its last dim, in place."""
    p.div_(p.norm(dim=-1, keepdim=True).clamp_min(eps))


@torch.no_grad()
def _project_off_sphere_rows_(p: torch.Tensor, tol: float = 1e-6) -> None:
    """Normalise only the quaternions whose norm is off by more than ``tol``.

    Rows already on S³ are left bit-identical, so rebuilding an optimiser for a
    resumed model does not perturb it (re-normalising a unit vector can flip ulps).
    """
    norm = p.norm(dim=-1, keepdim=True)
    off = (norm - 1).abs() > tol
    if off.any():
        p.copy_(torch.where(off, p / norm.clamp_min(1e-12), p))


class ProjectedAdamW(torch.optim.AdamW):
    """AdamW that renormalises the parameters of ``sphere=True`` groups after each step.

    Projection (``q ← q / ‖q‖``) is the cheapest retraction onto S³; the radial
    part of the Adam update is simply discarded. Groups without a ``sphere``
    key behave exactly like :class:`torch.optim.AdamW`.
    """

    backend = "projected"

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        for group in self.param_groups:
            if group.get("sphere", False):
                for p in group["params"]:
                    _normalise_(p)
        return loss


def _foreach_adam_euclidean_(params: List[torch.Tensor], grads: List[torch.Tensor],
                             exp_avgs: List[torch.Tensor], exp_avg_sqs: List[torch.Tensor],
                             steps: List[int], lr: float, beta1: float, beta2: float,
                             eps: float) -> None:
    """geoopt's Adam update on Euclidean parameters, as a handful of foreach ops.

    Op for op what ``RiemannianAdam`` does per parameter with the Euclidean
    manifold: ``m ← β₁m + (1-β₁)g``, ``v ← β₂v + (1-β₂)g²``,
    ``p ← p - lr · (m / bc₁) / (√(v / bc₂) + ε)``.
    """
    torch._foreach_mul_(exp_avgs, beta1)
    torch._foreach_add_(exp_avgs, grads, alpha=1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_add_(exp_avg_sqs, torch._foreach_mul(grads, grads), alpha=1 - beta2)
    denom = torch._foreach_div(exp_avg_sqs, [1 - beta2 ** k for k in steps])
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, eps)
    direction = torch._foreach_div(exp_avgs, [1 - beta1 ** k for k in steps])
    torch._foreach_div_(direction, denom)
    torch._foreach_mul_(direction, -lr)
    torch._foreach_add_(params, direction)


def _flat_rows(tensors: List[torch.Tensor]) -> torch.Tensor:
    """The quaternions of ``tensors`` (each ``[..., 4]``) as one ``[M, 4]`` tensor."""
    return torch.cat([t.reshape(-1, 4) for t in tensors])


def _adam_sphere_(params: List[torch.Tensor], grads: List[torch.Tensor],
                  exp_avgs: List[torch.Tensor], exp_avg_sqs: List[torch.Tensor], step: int,
                  lr: float, beta1: float, beta2: float, eps: float) -> None:
    """geoopt's Riemannian Adam step on ``geoopt.Sphere()`` for several parameters at once.

    All quaternions (rows along the last dim) of all ``params`` are updated
    together as one ``[M, 4]`` block; every operation is row-wise, so this is
    per quaternion exactly what ``RiemannianAdam`` does per parameter:

    * Riemannian gradient: ``g ← g - ⟨x, g⟩ x`` (projection onto the tangent space);
    * moments: ``m ← β₁m + (1-β₁)g``, ``v ← β₂v + (1-β₂)‖g‖²`` (geoopt's
      ``component_inner`` on the sphere: one second moment per quaternion,
      broadcast over its 4 entries);
    * retraction: ``x ← y / ‖y‖`` with ``y = x - lr · (m / bc₁) / (√(v / bc₂) + ε)``;
    * transport of the first moment to the new point: ``m ← m - ⟨x, m⟩ x``.
    """
    x, g, m, v = (_flat_rows(t) for t in (params, grads, exp_avgs, exp_avg_sqs))
    g = g - (x * g).sum(dim=-1, keepdim=True) * x
    m.mul_(beta1).add_(g, alpha=1 - beta1)
    v.mul_(beta2).add_((g * g).sum(dim=-1, keepdim=True), alpha=1 - beta2)
    denom = v.div(1 - beta2 ** step).sqrt_().add_(eps)
    direction = m.div(1 - beta1 ** step) / denom
    y = x + -lr * direction
    y = y / y.norm(dim=-1, keepdim=True)
    m = m - (y * m).sum(dim=-1, keepdim=True) * y
    sizes = [t.numel() // 4 for t in params]
    for targets, flat in ((params, y), (exp_avgs, m), (exp_avg_sqs, v)):
        torch._foreach_copy_(targets, [piece.view(t.shape) for piece, t in
                                       zip(flat.split(sizes), targets)])


@functools.lru_cache(maxsize=None)
def _riemannian_adam_class(geoopt: ModuleType) -> type:
    """Build (once) the decoupled-weight-decay RiemannianAdam subclass.

    Defined lazily so this module imports without geoopt.
    """

    def manifold_kind(p: torch.Tensor) -> str:
        manifold = getattr(p, "manifold", None)
        if manifold is None or type(manifold) is geoopt.Euclidean:
            return "euclidean"
        if type(manifold) is geoopt.Sphere and manifold.projector is None and p.shape[-1] == 4:
            return "sphere"
        return "other"

    class DecoupledRiemannianAdam(geoopt.optim.RiemannianAdam):
        """RiemannianAdam with AdamW-style decoupled weight decay, in foreach ops.

        geoopt adds ``weight_decay * p`` to the gradient (L2, coupled through the
        Adam denominator). Applying ``p ← p (1 - lr·wd)`` before the update instead
        makes Euclidean parameters follow exactly the AdamW rule of the projected
        backend, so switching backends only changes how sphere parameters move.

        geoopt updates one parameter at a time (about 19 small ops each: 1,841
        per step for a 98-parameter model). :meth:`step` computes the same update
        with foreach ops over all Euclidean parameters and one row-wise block
        update over all unit-quaternion parameters (:func:`_adam_sphere_`);
        :meth:`step_per_parameter` is geoopt's own loop, kept as the reference (and
        used for AMSGrad and for manifolds other than Euclidean and ``Sphere()``).
        The state (``step`` as an int, ``exp_avg``, ``exp_avg_sq``) is geoopt's, so
        checkpoints of either implementation load into the other.
        """

        backend = "riemannian"

        def load_state_dict(self, state_dict: dict) -> None:
            super().load_state_dict(state_dict)
            # torch.optim.Adam casts "step" to a float32 tensor on load, while geoopt
            # keeps a Python int; restore the int so bias corrections after a resume
            # are computed exactly as in an uninterrupted run.
            for state in self.state.values():
                if torch.is_tensor(state.get("step")):
                    state["step"] = int(state["step"].item())

        def _decay_(self) -> None:
            """Decoupled weight decay ``p ← p (1 - lr·wd)`` of every parameter with a grad."""
            for group in self.param_groups:
                if group["weight_decay"] != 0:
                    params = [p for p in group["params"] if p.grad is not None]
                    if params:
                        torch._foreach_mul_(params, 1 - group["lr"] * group["weight_decay"])

        def step_per_parameter(self, closure=None):
            """geoopt's per-parameter loop with decoupled weight decay (the reference)."""
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            saved = [group["weight_decay"] for group in self.param_groups]
            with torch.no_grad():
                for group in self.param_groups:
                    if group["weight_decay"] != 0:
                        for p in group["params"]:
                            if p.grad is not None:
                                p.mul_(1 - group["lr"] * group["weight_decay"])
            try:
                # Zero geoopt's coupled L2 term for this step only; param_groups and
                # state_dict keep reporting the configured weight_decay.
                for group in self.param_groups:
                    group["weight_decay"] = 0.0
                super().step()
            finally:
                for group, wd in zip(self.param_groups, saved):
                    group["weight_decay"] = wd
            return loss

        def step(self, closure=None):
            if any(group["amsgrad"] for group in self.param_groups) or any(
                    manifold_kind(p) == "other" for group in self.param_groups
                    for p in group["params"]):
                return self.step_per_parameter(closure)
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            with torch.no_grad():
                self._decay_()
                for group in self.param_groups:
                    self._step_group(group)
            return loss

        def _step_group(self, group: dict) -> None:
            beta1, beta2 = group["betas"]
            lr, eps = group["lr"], group["eps"]
            # (device, dtype, kind[, step]) -> parameters updated together.
            buckets: Dict[tuple, List[torch.Tensor]] = {}
            stabilize = False
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("RiemannianAdam does not support sparse gradients, "
                                       "use SparseRiemannianAdam instead")
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                kind = manifold_kind(p)
                # Sphere blocks share one bias correction: group them by step too.
                key = (p.device, p.dtype, kind) + ((state["step"],) if kind == "sphere" else ())
                buckets.setdefault(key, []).append(p)
                if group["stabilize"] is not None and state["step"] % group["stabilize"] == 0:
                    stabilize = True
            for key, params in buckets.items():
                states = [self.state[p] for p in params]
                args = ([p.grad for p in params], [s["exp_avg"] for s in states],
                        [s["exp_avg_sq"] for s in states])
                if key[2] == "sphere":
                    _adam_sphere_(params, *args, key[3], lr, beta1, beta2, eps)
                else:
                    _foreach_adam_euclidean_(params, *args, [s["step"] for s in states], lr,
                                             beta1, beta2, eps)
            if stabilize:
                self.stabilize_group(group)

    DecoupledRiemannianAdam.__qualname__ = DecoupledRiemannianAdam.__name__
    return DecoupledRiemannianAdam


def _declared_sphere_parameters(model: nn.Module) -> List[nn.Parameter]:
    fn = getattr(model, "sphere_parameters", None)
    return list(fn()) if callable(fn) else []


def _check_sphere_shapes(params: Iterable[torch.Tensor]) -> None:
    for p in params:
        if p.ndim == 0 or p.shape[-1] != 4:
            raise ValueError(
                "sphere parameters hold unit quaternions along the last dim and must have "
                f"shape [..., 4]; got {tuple(p.shape)}")


def _to_manifold_parameters(model: nn.Module, geoopt: ModuleType) -> List[nn.Parameter]:
    """Replace plain sphere parameters by ``ManifoldParameter`` on ``geoopt.Sphere()``.

    Every registration of a parameter (also when shared between submodules) is
    swapped for the same new object, which shares the original storage.

    Returns:
        The model's sphere parameters after conversion.

    Raises:
        ValueError: a declared sphere parameter is not registered in the model.
        TypeError: a declared sphere parameter lives on a non-sphere manifold, or
            ``sphere_parameters()`` still returns the old objects after the swap.
    """
    declared = _declared_sphere_parameters(model)
    todo: Dict[int, nn.Parameter] = {}
    for p in declared:
        if isinstance(p, geoopt.ManifoldParameter):
            if not isinstance(p.manifold, geoopt.Sphere):
                raise TypeError(
                    f"sphere parameter of shape {tuple(p.shape)} is a ManifoldParameter on "
                    f"{type(p.manifold).__name__}, expected geoopt.Sphere")
        else:
            todo[id(p)] = p
    if not todo:
        return declared

    # Find every registration first, so an error leaves the model untouched.
    owners = [(module, name, p) for module in model.modules()
              for name, p in module.named_parameters(recurse=False) if id(p) in todo]
    missing = [tuple(p.shape) for key, p in todo.items()
               if all(id(owned) != key for _, _, owned in owners)]
    if missing:
        raise ValueError(
            f"sphere_parameters() returned tensors of shape {missing} that are not registered "
            "parameters of the model")

    sphere = geoopt.Sphere()
    new: Dict[int, nn.Parameter] = {}
    for module, name, p in owners:
        if id(p) not in new:
            new[id(p)] = geoopt.ManifoldParameter(p.data, manifold=sphere, requires_grad=p.requires_grad)
        setattr(module, name, new[id(p)])

    converted = _declared_sphere_parameters(model)
    stale = [tuple(p.shape) for p in converted if not isinstance(p, geoopt.ManifoldParameter)]
    if stale:
        raise TypeError(
            f"sphere_parameters() still returns plain tensors of shape {stale} after conversion "
            "to geoopt.ManifoldParameter; it must read the parameters from module attributes "
            "(not from a cached Python list)")
    return converted


def _param_groups(model: nn.Module, sphere: List[nn.Parameter], weight_decay: float,
                  lr: float, sphere_lr_scale: float) -> List[dict]:
    """Split trainable parameters into ``decay`` / ``no_decay`` / ``sphere`` groups."""
    sphere_ids = {id(p) for p in sphere}
    decay, no_decay, on_sphere, seen = [], [], [], set()
    for module in model.modules():
        is_norm = isinstance(module, _NORM_TYPES)
        for name, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue  # shared parameter: keep its first classification
            seen.add(id(p))
            if not p.requires_grad:
                continue
            if id(p) in sphere_ids:
                on_sphere.append(p)
            elif p.ndim <= 1 or is_norm or name == "bias":
                no_decay.append(p)
            else:
                decay.append(p)
    unregistered = sphere_ids - seen
    if unregistered:
        raise ValueError(f"{len(unregistered)} sphere parameter(s) are not parameters of the model")
    groups = [
        {"params": decay, "weight_decay": weight_decay, "sphere": False, "name": "decay",
         "lr": lr},
        {"params": no_decay, "weight_decay": 0.0, "sphere": False, "name": "no_decay", "lr": lr},
        {"params": on_sphere, "weight_decay": 0.0, "sphere": True, "name": "sphere",
         "lr": lr * sphere_lr_scale},
    ]
    groups = [g for g in groups if g["params"]]
    if not groups:
        raise ValueError("model has no trainable parameters")
    return groups


def build_optimizer(
    model: nn.Module,
    lr: float,
    weight_decay: float,
    betas: Tuple[float, float] = (0.9, 0.999),
    backend: str = "auto",
    sphere_lr_scale: float = 1.0,
) -> torch.optim.Optimizer:
    """Create the training optimiser for ``model``.

    Sphere parameters (``model.sphere_parameters()``, shape ``[..., 4]``) are first
    projected onto S³ in place (only quaternions off it by more than 1e-6, so a
    resumed model is not perturbed), then kept there by the chosen backend.

    Args:
        model: any ``nn.Module``; sphere parameters are read from its
            ``sphere_parameters()`` method when it has one.
        lr: peak learning rate (schedulers scale it per step).
        weight_decay: decoupled weight decay for weight matrices / conv kernels.
        betas: Adam moment coefficients.
        backend: ``"auto"``, ``"riemannian"`` or ``"projected"`` (see module docstring).
            With ``"riemannian"``, plain ``nn.Parameter`` sphere parameters are
            replaced in the model by ``geoopt.ManifoldParameter`` objects.
        sphere_lr_scale: learning rate of the sphere parameters relative to ``lr``
            (a separate step size for the quaternion fields; schedulers scale every
            group's own initial rate, so the ratio holds throughout).

    Returns:
        One optimiser with up to three param groups named ``decay``, ``no_decay``
        and ``sphere`` (each group carries ``name`` and ``sphere`` keys).

    Raises:
        ValueError: unknown backend, bad hyper-parameters, sphere parameters of the
            wrong shape or not registered in the model.
        ImportError: ``backend="riemannian"`` without geoopt installed.
    """
    if backend not in OPTIMIZER_BACKENDS:
        raise ValueError(f"backend must be one of {OPTIMIZER_BACKENDS}, got {backend!r}")
    if lr <= 0:
        raise ValueError(f"lr must be positive, got {lr}")
    if weight_decay < 0:
        raise ValueError(f"weight_decay must be non-negative, got {weight_decay}")
    if not (sphere_lr_scale > 0 and sphere_lr_scale < float("inf")):
        raise ValueError(f"sphere_lr_scale must be a positive finite number, got {sphere_lr_scale}")
    geoopt = import_geoopt() if backend != "projected" else None
    if backend == "auto":
        backend = "riemannian" if geoopt is not None else "projected"
    if backend == "riemannian" and geoopt is None:
        raise ImportError(
            "backend='riemannian' needs geoopt (pip install geoopt, or "
            "pip install 'qsv_pyg[riemannian]'); use backend='projected' otherwise")

    # Validate and project before touching the model any further.
    sphere = _declared_sphere_parameters(model)
    _check_sphere_shapes(sphere)
    for p in sphere:
        _project_off_sphere_rows_(p)

    if backend == "riemannian":
        sphere = _to_manifold_parameters(model, geoopt)
        groups = _param_groups(model, sphere, weight_decay, lr, sphere_lr_scale)
        return _riemannian_adam_class(geoopt)(groups, lr=lr, betas=betas)
    groups = _param_groups(model, sphere, weight_decay, lr, sphere_lr_scale)
    return ProjectedAdamW(groups, lr=lr, betas=betas)


def optimizer_backend(opt: torch.optim.Optimizer) -> str:
    """Name of the sphere backend of an optimiser: ``"riemannian"`` or ``"projected"``.

    Raises:
        TypeError: ``opt`` was not built by :func:`build_optimizer` (or is not a
            geoopt ``RiemannianAdam``).
    """
    backend = getattr(opt, "backend", None)
    if backend in ("riemannian", "projected"):
        return backend
    geoopt = import_geoopt()
    if geoopt is not None and isinstance(opt, geoopt.optim.RiemannianAdam):
        return "riemannian"
    raise TypeError(f"{type(opt).__name__} is not a sphere-aware optimiser from build_optimizer()")
