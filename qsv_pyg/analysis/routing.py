r"""What a trained QSV model routes and rotates: entropy, angles, interventions.

Three measurements of every :class:`~qsv_pyg.nn.QSVConv` in a model:

* :func:`routing_statistics`: how far each head's attention is from uniform.
  The entropy :math:`H_i = -\sum_j \alpha_{ij} \log \alpha_{ij}` of a target's
  routing over its :math:`k` incoming edges is divided by :math:`\log k` (1 means
  uniform, 0 a single source), and :math:`\mathrm{KL}(\alpha_i \Vert
  \mathcal{U}_k) = \log k - H_i` is reported in nats.
* :func:`rotation_angles`: the angle of every relative rotation
  :math:`r_{ij} = q_i^* \otimes q_j`, :math:`2 \arccos |\mathrm{Re}\, r_{ij}|`
  in degrees (``|·|`` because ``r`` and ``-r`` are the same rotation).
* :func:`intervention_accuracy`: test accuracy with every layer's routing made
  uniform and/or its transport made the identity at test time (:func:`intervene`).

The layer inputs are captured with forward hooks during one ordinary forward
pass, so the statistics are those of the model exactly as it classifies.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from ..nn import QSVConv

__all__ = [
    "INTERVENTIONS",
    "INTERVENTION_ALIASES",
    "NotQSVModelError",
    "intervention_name",
    "interventions_of",
    "qsv_layers",
    "capture_layer_inputs",
    "routing_statistics",
    "rotation_angles",
    "intervene",
    "intervention_accuracy",
    "summarize_angles",
]

#: Test-time switches: mode -> QSVConv attributes to set on every layer. ``"both-off"``
#: is the trained ablation's name too (``qsv_pyg.experiments.tables``: row ``both-off``).
INTERVENTIONS: Dict[str, Dict[str, str]] = {
    "none": {},
    "uniform-routing": {"routing": "uniform"},
    "identity-transport": {"transport": "identity"},
    "both-off": {"routing": "uniform", "transport": "identity"},
}
#: Old spellings of :data:`INTERVENTIONS`, read with a :class:`DeprecationWarning`
#: (``"both"`` is also an old ``quat_source`` spelling, of ``"composed"``; as an
#: intervention it was both switches off). ``analysis.json`` files written before
#: the rename key the intervention ``"both"``; :func:`intervention_name` reads them.
INTERVENTION_ALIASES: Dict[str, str] = {"both": "both-off"}

Images = Union[Tensor, Iterable[Tensor]]


class NotQSVModelError(ValueError):
    """The model has no QSVConv layers (ResNet-20, an attention control, ...)."""


# ============================================================================ layers


def qsv_layers(model: nn.Module) -> Dict[str, QSVConv]:
    """Every QSVConv of ``model`` by name, in forward order.

    Uses ``model.qsv_convs()`` when the model has it (GraphNet's names
    ``cross0``, ..., ``within0``, ...), else the module names.

    Raises:
        NotQSVModelError: the model has no QSVConv.
    """
    getter = getattr(model, "qsv_convs", None)
    layers = dict(getter()) if callable(getter) else {
        name: m for name, m in model.named_modules() if isinstance(m, QSVConv)}
    if not layers:
        kind = getattr(model, "conv_kind", None)
        what = type(model).__name__ + (f" with conv={kind!r}" if kind else "")
        raise NotQSVModelError(
            f"the analysis needs a QSV model (a GraphNet with QSVConv layers, e.g. 'qsv' or "
            f"'lattice'); got {what}, which has no quaternion routing to analyse")
    return layers


def _as_batches(images: Images) -> List[Tensor]:
    batches = [images] if isinstance(images, Tensor) else list(images)
    if not batches:
        raise ValueError("no images given")
    for b in batches:
        if not isinstance(b, Tensor) or b.dim() != 4:
            raise ValueError(f"images must be [B, C, H, W] tensors; got "
                             f"{tuple(b.shape) if isinstance(b, Tensor) else type(b).__name__}")
    return batches


@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


Captured = Tuple[Tuple[Any, ...], Dict[str, Any]]


class _InputRecorder:
    """Forward pre-hooks that record each QSVConv's call arguments.

    While :meth:`paused` is active the hooks record nothing, so replaying a
    captured call through the same (still hooked) layer cannot overwrite the
    capture it replays; a conv called from inside another hooked conv's
    forward is likewise ignored (only the outermost call is the layer's input).
    """

    def __init__(self, layers: Dict[str, QSVConv]):
        self.layers = layers
        self.captured: Dict[str, Captured] = {}
        self._paused = False
        self._depth = 0
        self._handles: List[Any] = []

    def __enter__(self) -> "_InputRecorder":
        for name, conv in self.layers.items():
            self._handles.append(conv.register_forward_pre_hook(
                self._pre_hook(name), with_kwargs=True))
            self._handles.append(conv.register_forward_hook(self._post_hook))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _pre_hook(self, name: str):
        def hook(module, args, kwargs):
            if not self._paused and self._depth == 0:
                self.captured[name] = (tuple(args), dict(kwargs))
            self._depth += 1
            return None
        return hook

    def _post_hook(self, module, args, output):
        self._depth -= 1
        return None

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def record(self, model: nn.Module, images: Tensor) -> Dict[str, Captured]:
        """Run ``model(images)`` in eval mode; returns layer name -> ``(args, kwargs)``."""
        self.captured = {}
        self._depth = 0  # a forward that raised may have left it raised
        with _eval_mode(model):
            model(images)
        missing = [name for name in self.layers if name not in self.captured]
        if missing:
            raise RuntimeError(f"QSV layer(s) {missing} were not called in the forward pass")
        return self.captured


@torch.no_grad()
def capture_layer_inputs(model: nn.Module, images: Tensor) -> Dict[str, Captured]:
    """Run ``model(images)`` once and record every QSVConv's call arguments.

    Args:
        model: a model with QSVConv layers (run in eval mode for the call).
        images: one ``[B, C, H, W]`` batch on the model's device.

    Returns:
        layer name -> ``(args, kwargs)`` of its (last) call, ready to replay with
        ``conv(*args, **kwargs)``. The hooks are removed before returning.
    """
    with _InputRecorder(qsv_layers(model)) as recorder:
        return recorder.record(model, images)


def _replay_attention(conv: QSVConv, call: Captured) -> Tuple[Tensor, Tensor]:
    """``(edge_index [2, E], alpha [B, E, H])`` of one captured call."""
    args, kwargs = call
    kwargs = dict(kwargs)
    kwargs["return_attention_weights"] = True
    with _eval_mode(conv):
        _, (edge_index, alpha) = conv(*args, **kwargs)
    if not isinstance(edge_index, Tensor) or edge_index.is_sparse:
        raise ValueError("routing statistics need a plain [2, E] edge_index")
    if type(edge_index) is not Tensor:  # EdgeIndex and other subclasses
        edge_index = edge_index.as_subclass(Tensor)
    return edge_index, alpha if alpha.dim() == 3 else alpha.unsqueeze(0)


def _split_x(x: Any) -> Tuple[Tensor, Optional[Tensor]]:
    if isinstance(x, Tensor):
        return x, x
    return x[0], x[1]


# ============================================================================ statistics


@torch.no_grad()
def routing_statistics(model: nn.Module, images: Images) -> List[Dict[str, Any]]:
    r"""Per layer and head: routing entropy relative to uniform and KL from uniform.

    For every target :math:`i` with :math:`k_i \ge 2` incoming edges, the ratio
    :math:`H_i / \log k_i` and :math:`\log k_i - H_i` are averaged over targets
    and images (targets with one edge have no choice to make and are skipped).

    Args:
        model: a QSV model.
        images: a ``[B, C, H, W]`` batch, or an iterable of batches (averaged
            image-weighted), already normalised and on the model's device.

    Returns:
        One dict per layer, in forward order: ``layer``, ``routing``,
        ``transport``, ``heads``, ``degree`` (mean incoming edges per target),
        ``num_targets``, ``images``, ``beta`` (``[H]``), ``entropy_ratio``
        (``[H]``, in ``[0, 1]``) and ``kl`` (``[H]``, nats, ``>= 0``).

    Raises:
        NotQSVModelError: the model has no QSVConv.
    """
    layers = qsv_layers(model)
    sums: Dict[str, Dict[str, Any]] = {}
    with _InputRecorder(layers) as recorder:
        for batch in _as_batches(images):
            captured = recorder.record(model, batch)
            with recorder.paused():  # the replays go through the hooked layers
                for name, conv in layers.items():
                    edge_index, alpha = _replay_attention(conv, captured[name])
                    ratio, kl, degree, n_targets = _entropy_terms(edge_index, alpha)
                    s = sums.setdefault(name, {"ratio": 0.0, "kl": 0.0, "images": 0,
                                               "degree": degree, "num_targets": n_targets})
                    b = alpha.size(0)
                    s["ratio"] = s["ratio"] + ratio * b
                    s["kl"] = s["kl"] + kl * b
                    s["images"] += b
    out = []
    for name, conv in layers.items():
        s = sums[name]
        n = max(s["images"], 1)
        out.append({
            "layer": name,
            "routing": conv.routing,
            "transport": conv.transport,
            "heads": conv.heads,
            "degree": s["degree"],
            "num_targets": s["num_targets"],
            "images": s["images"],
            "beta": [float(v) for v in conv.beta.detach().cpu()],
            # Rounding can push a uniform ratio a hair past 1 (or KL below 0).
            "entropy_ratio": [min(max(float(v), 0.0), 1.0) for v in s["ratio"] / n],
            "kl": [max(float(v), 0.0) for v in s["kl"] / n],
        })
    return out


def _entropy_terms(edge_index: Tensor, alpha: Tensor) -> Tuple[Tensor, Tensor, float, int]:
    """Per-head mean over the batch items and targets of ``H/log k`` and ``log k - H``.

    Args:
        edge_index: ``[2, E]``.
        alpha: ``[B, E, H]``.

    Returns:
        ``(ratio [H], kl [H], mean degree, number of targets with k >= 2)``,
        the first two as float64 CPU tensors averaged over the batch.
    """
    dst = edge_index[1].to(alpha.device)
    num_dst = int(dst.max()) + 1 if dst.numel() else 0
    # float64: a uniform routing must come out at ratio 1 to rounding, not 1 ± 1e-7.
    a = alpha.double()
    plogp = torch.special.xlogy(a, a)  # 0 log 0 = 0
    ent = -a.new_zeros(a.size(0), num_dst, a.size(2)).index_add_(1, dst, plogp)
    deg = torch.bincount(dst, minlength=num_dst).double()
    keep = deg >= 2
    if not bool(keep.any()):
        h = alpha.size(2)
        return torch.ones(h, dtype=torch.float64), torch.zeros(h, dtype=torch.float64), \
            float(deg.mean()) if num_dst else 0.0, 0
    log_k = deg[keep].log().view(1, -1, 1)
    ent = ent[:, keep]
    ratio = (ent / log_k).mean(dim=(0, 1)).cpu()
    kl = (log_k - ent).mean(dim=(0, 1)).cpu()
    return ratio, kl, float(deg.mean()), int(keep.sum())


@torch.no_grad()
def rotation_angles(model: nn.Module, images: Tensor) -> Dict[str, Tensor]:
    r"""Relative rotation angle of every edge and head, in degrees.

    The angle of :math:`r_{ij} = q_i^* \otimes q_j` is
    :math:`2 \arccos |\langle q_i, q_j \rangle|` for the unit quaternions the
    layer actually uses (field, feature map or both). When they depend on the
    features, batch item 0 is reported.

    Args:
        model: a QSV model.
        images: ``[B, C, H, W]`` batch on the model's device (only item 0 matters
            for feature quaternions; a field ignores the images).

    Returns:
        layer name -> ``[E, H]`` float CPU tensor with values in ``[0, 180]``,
        edges in the layer's ``edge_index`` order.

    Raises:
        NotQSVModelError: the model has no QSVConv.
        ValueError: a layer has no target quaternions.
    """
    layers = qsv_layers(model)
    captured = capture_layer_inputs(model, _as_batches(images)[0][:1])
    out: Dict[str, Tensor] = {}
    for name, conv in layers.items():
        args, kwargs = captured[name]
        x = args[0] if args else kwargs["x"]
        edge_index = args[1] if len(args) > 1 else kwargs["edge_index"]
        quat = args[2] if len(args) > 2 else kwargs.get("quat")
        size = args[4] if len(args) > 4 else kwargs.get("size")
        if not isinstance(edge_index, Tensor) or edge_index.is_sparse:
            raise ValueError(f"layer {name}: rotation angles need a plain [2, E] edge_index")
        edge_index = edge_index.as_subclass(Tensor) if type(edge_index) is not Tensor \
            else edge_index
        x_src, x_dst = _split_x(x)
        num_dst = conv._num_dst(x_src, x_dst, quat, edge_index, size)
        q_src, q_dst = conv._node_quaternions(x_src, x_dst, quat, num_dst)
        if q_dst is None:
            raise ValueError(f"layer {name}: the target quaternions are not defined "
                             f"(no target features or quaternions were passed)")
        if q_src.dim() == 4:  # feature quaternions: one set per image
            q_src = q_src[0]
        if q_dst.dim() == 4:
            q_dst = q_dst[0]
        src, dst = edge_index[0].to(q_src.device), edge_index[1].to(q_src.device)
        re_r = (q_dst[dst].double() * q_src[src].double()).sum(dim=-1)  # [E, H]
        out[name] = torch.rad2deg(2.0 * torch.acos(re_r.abs().clamp(max=1.0))).float().cpu()
    return out


# ============================================================================ interventions


def intervention_name(mode: str) -> str:
    """The name in :data:`INTERVENTIONS` of ``mode``: an old spelling
    (:data:`INTERVENTION_ALIASES`, e.g. a key of an old ``analysis.json`` or an old
    command line) becomes today's, with a :class:`DeprecationWarning`.

    Raises:
        ValueError: unknown ``mode``.
    """
    if mode in INTERVENTION_ALIASES:
        new = INTERVENTION_ALIASES[mode]
        warnings.warn(f"intervention {mode!r} is now called {new!r}", DeprecationWarning,
                      stacklevel=3)
        return new
    if mode not in INTERVENTIONS:
        raise ValueError(f"unknown intervention {mode!r}; choose one of "
                         f"{', '.join(INTERVENTIONS)}")
    return mode


def interventions_of(report: Dict[str, Any]) -> Dict[str, Any]:
    """The ``"interventions"`` of an ``analysis.json`` report (``examples/analyze.py``)
    keyed by today's names: a report written before the rename keys ``"both-off"``
    as ``"both"`` (read with a :class:`DeprecationWarning`)."""
    return {intervention_name(mode): r for mode, r in report["interventions"].items()}


@contextlib.contextmanager
def intervene(model: nn.Module, mode: str) -> Iterator[Dict[str, QSVConv]]:
    r"""Switch every QSVConv of ``model`` to ``mode`` for the ``with`` block.

    Args:
        model: a QSV model.
        mode: one of :data:`INTERVENTIONS`: ``"none"``, ``"uniform-routing"``
            (:math:`\alpha = 1/k`), ``"identity-transport"`` (messages are not
            rotated) or ``"both-off"`` (both; its old spelling ``"both"`` is read
            with a :class:`DeprecationWarning`).

    Yields:
        The layers by name. Their original ``routing``/``transport`` are
        restored on exit, also when the block raises.

    Raises:
        ValueError: unknown ``mode``.
        NotQSVModelError: the model has no QSVConv.
    """
    mode = intervention_name(mode)
    layers = qsv_layers(model)
    saved = {name: (conv.routing, conv.transport) for name, conv in layers.items()}
    try:
        for conv in layers.values():
            for attr, value in INTERVENTIONS[mode].items():
                setattr(conv, attr, value)
        yield layers
    finally:
        for name, conv in layers.items():
            conv.routing, conv.transport = saved[name]


@torch.no_grad()
def intervention_accuracy(model: nn.Module, loader: Any, mode: str) -> float:
    """Accuracy over ``loader.epoch(0)`` with every QSV layer switched to ``mode``.

    Args:
        model: a QSV model (evaluated in eval mode; its mode is restored).
        loader: a :class:`~qsv_pyg.data.DeviceLoader` (anything whose
            ``epoch(0)`` yields ``(images, labels)`` on the model's device).
        mode: see :func:`intervene`.

    Returns:
        The fraction of correctly classified images.

    Raises:
        ValueError: unknown ``mode`` or an empty loader.
        NotQSVModelError: the model has no QSVConv.
    """
    correct = seen = 0
    with intervene(model, mode), _eval_mode(model):
        for images, labels in loader.epoch(0):
            logits = model(images)
            correct += int((logits.argmax(dim=1) == labels).sum())
            seen += labels.numel()
    if seen == 0:
        raise ValueError("the loader yielded no images")
    return correct / seen


def summarize_angles(angles: Tensor, bins: Sequence[float] = tuple(range(0, 181, 10))
                     ) -> Dict[str, Any]:
    """Per-head median, mean and histogram of an ``[E, H]`` angle tensor."""
    edges = torch.tensor(list(bins), dtype=torch.float64)
    counts = []
    for h in range(angles.size(1)):
        c = torch.histogram(angles[:, h].double(), bins=edges).hist
        counts.append([int(v) for v in c])
    return {
        "median": [float(v) for v in angles.median(dim=0).values],
        "mean": [float(v) for v in angles.double().mean(dim=0)],
        "bins": [float(v) for v in edges],
        "counts": counts,
    }


