"""GraphNet: the QSV image classifier, its attention controls and the lattice control.

Pipeline (one class for every variant; only the conv and the geometry change)::

    images [B, 3, H, W]
      └─ Lambert patch embedding ─────────────→ level 0   [B, N_0, w_0]
      └─ CrossBlock, level s → s+1 (kNN)     ─→ level s+1 [B, N_{s+1}, w_{s+1}]
         (level s+1 starts from a learned per-node embedding)
      └─ within_rounds × WithinBlock on the innermost level's kNN graph
      └─ mean over nodes → LayerNorm → Linear ─→ logits   [B, num_classes]

With ``conv="qsv"`` every level carries a :class:`QuaternionField` (unless the
quaternions come from the features only) that every QSVConv touching the level
reads, so routing and transport between two levels are set by the two fields.
"""
from __future__ import annotations

import inspect
import math
from typing import Any, Dict, List, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from ..geometry import (
    Hierarchy,
    LatticeSpec,
    ShellSpec,
    build_lattice_hierarchy,
    build_shell_hierarchy,
    dense_neighbors,
    knn_within,
)
from ..geometry.hierarchy import KINDS as HIERARCHY_KINDS
from ..nn import QSVConv
from ..nn.csr import GraphCSR, attach_static_csr, build_csr, check_range
from ..nn.quat_sources import QUAT_SOURCES_OF, conv_quat_source, resolve_quat_source
from ..utils import is_positive_int
from .base import ImageClassifier, format_count
from .blocks import CONV_KINDS, CrossBlock, WithinBlock
from .embedding import LambertPatchEmbedding
from .field import QuaternionField

#: Values of ``geometry``: the kinds of :class:`~qsv_pyg.geometry.Hierarchy`.
GEOMETRIES = HIERARCHY_KINDS
#: GraphNet's values of ``quat_source`` (and ``--quat-source``):
#: ``QUAT_SOURCES_OF["GraphNet"]`` of :mod:`qsv_pyg.nn.quat_sources` (whose
#: ``QUAT_SOURCES`` are every source of the package). The old spelling ``"both"``
#: of ``"composed"`` (``QUAT_SOURCE_ALIASES``) is read with a
#: :class:`DeprecationWarning` and is none of these.
GRAPHNET_QUAT_SOURCES = QUAT_SOURCES_OF["GraphNet"]
#: Each of :data:`GRAPHNET_QUAT_SOURCES` with the QSVConv ``quat_source`` it selects.
QUAT_SOURCE_TO_CONV = {s: conv_quat_source(s) for s in GRAPHNET_QUAT_SOURCES}
#: Options of the quaternion field, which ``quat_source="features"`` does not have.
FIELD_OPTIONS = ("frozen_field", "field_init", "field_per_head", "repulsion_k",
                 "repulsion_weight")

#: The paper's model: 16 heads per shell, one quaternion per node and head. At
#: width 64 each head reads one 4-channel block; the widths give ≈0.57M parameters.
DEFAULT_HEADS = 16
DEFAULT_WIDTHS = (64, 128, 128, 128, 128)
#: Centre of the log-temperature prior: the fixed point β ≈ 0.79 the paper states.
#: It does not follow ``beta_init``, so a warm start (β₀ = 5) decays back to it.
BETA_PRIOR_CENTRE = 0.79

#: QSV-only arguments that every QSVConv of a GraphNet takes as given: their
#: defaults are QSVConv's own, read from its signature (one place per value).
CONV_KEYWORDS = ("routing", "transport", "beta_init", "learn_beta", "root_weight")
_CONV_DEFAULTS = {name: inspect.signature(QSVConv.__init__).parameters[name].default
                  for name in CONV_KEYWORDS}

# Defaults of the QSV-only arguments. GraphNet takes them as ``None`` so that a
# control (conv != "qsv") given any of them fails loudly instead of ignoring it.
# Those of CONV_KEYWORDS are QSVConv's; the others are GraphNet's own (its
# quat_source "field" is not QSVConv's "auto": the field is the model's).
QSV_DEFAULTS = dict(
    routing=_CONV_DEFAULTS["routing"],
    transport=_CONV_DEFAULTS["transport"],
    quat_source="field",
    frozen_field=False,
    field_init="uniform",
    field_per_head=True,
    beta_init=_CONV_DEFAULTS["beta_init"],
    learn_beta=_CONV_DEFAULTS["learn_beta"],
    beta_prior_centre=BETA_PRIOR_CENTRE,
    beta_prior_weight=0.01,
    repulsion_k=8,
    repulsion_weight=0.01,
    root_weight=_CONV_DEFAULTS["root_weight"],
)


class GraphNet(ImageClassifier):
    r"""Hierarchical graph classifier on concentric shells or a flat lattice.

    Args:
        num_classes: classifier outputs.
        hierarchy: a prebuilt :class:`~qsv_pyg.geometry.Hierarchy`; when given,
            ``geometry``, ``spec``, ``k_cross`` and ``k_inner`` must be left at
            their defaults.
        geometry: ``"shells"`` (Fibonacci shells) or ``"lattice"`` (square grids).
        spec: :class:`~qsv_pyg.geometry.ShellSpec` or
            :class:`~qsv_pyg.geometry.LatticeSpec` (default: the geometry's
            default spec, 256-144-64-36-16 nodes).
        k_cross: sources per target between levels.
        k_inner: neighbours per node within the innermost level.
        conv: ``"qsv"``, ``"gat"``, ``"gatv2"`` or ``"transformer"``.
        widths: feature size of every level, outer first. For QSV each must be a
            multiple of ``4 * heads``; otherwise of ``heads``.
        heads: attention heads (quaternions per node for QSV).
        patch_size: side in pixels of the patch each outer node samples.
        image_size: side of the square input images.
        in_ch: image channels.
        mlp_ratio: MLP hidden size relative to the level width; ``0`` removes
            every block's MLP (and its LayerNorm and residual branch).
        within_rounds: WithinBlocks on the innermost level.
        check_finite: let QSVConv check its inputs for NaN/inf (a host sync per
            layer; off by default, the training loop checks the loss).

    QSV-only arguments (``None`` means the default in brackets; a control
    rejects any of them with :class:`ValueError`):

    Args:
        routing: QSVConv routing (``"learned"``), ``"abs"``, ``"uniform"`` or
            ``"geometric"`` (positions: unit directions on shells, raw 2-D
            coordinates on the lattice).
        transport: ``"sandwich"`` (default) or ``"identity"``.
        quat_source: ``"field"`` (default; the level's learned field),
            ``"features"`` (a linear map of the features) or ``"composed"`` (the
            field composed with the feature quaternion; its old spelling
            ``"both"`` is read with a :class:`DeprecationWarning`).
        frozen_field: keep the fields at their random initialisation (``False``).
        field_init: ``"uniform"`` (default) or ``"identity"``, see
            :class:`QuaternionField`.
        field_per_head: one field quaternion per node and head (``True``), or one
            per node shared by all heads (``False``).
        beta_init: initial routing temperature (``1.0``).
        learn_beta: learn the temperatures (``True``).
        beta_prior_centre: centre of the log-temperature prior (``0.79``, the
            paper's fixed point; independent of ``beta_init``).
        beta_prior_weight: weight of
            :math:`\sum (\log\beta - \log\beta_{prior})^2` over all layers and
            heads (``0.01``).
        repulsion_k: same-level neighbours in the field repulsion (``8``).
        repulsion_weight: weight of the field repulsion, averaged over levels
            (``0.01``).
        root_weight: every QSVConv adds :math:`\mathbf{W}_r \mathbf{x}_i`
            (``True``); ``False`` leaves the target's own features to the
            residual only (with ``mlp_ratio=0``: the "kernel-only" block).

    Shapes:
        - **input:** ``[B, in_ch, image_size, image_size]``
        - **output:** ``[B, num_classes]``
    """

    def __init__(
        self,
        num_classes: int = 10,
        *,
        hierarchy: Optional[Hierarchy] = None,
        geometry: str = "shells",
        spec: Union[ShellSpec, LatticeSpec, None] = None,
        k_cross: int = 8,
        k_inner: int = 8,
        conv: str = "qsv",
        widths: Sequence[int] = DEFAULT_WIDTHS,
        heads: int = DEFAULT_HEADS,
        patch_size: int = 4,
        image_size: int = 32,
        in_ch: int = 3,
        mlp_ratio: float = 2.0,
        within_rounds: int = 2,
        check_finite: bool = False,
        routing: Optional[str] = None,
        transport: Optional[str] = None,
        quat_source: Optional[str] = None,
        frozen_field: Optional[bool] = None,
        field_init: Optional[str] = None,
        field_per_head: Optional[bool] = None,
        beta_init: Optional[float] = None,
        learn_beta: Optional[bool] = None,
        beta_prior_centre: Optional[float] = None,
        beta_prior_weight: Optional[float] = None,
        repulsion_k: Optional[int] = None,
        repulsion_weight: Optional[float] = None,
        root_weight: Optional[bool] = None,
    ):
        # The QSV-only arguments, by the names QSV_DEFAULTS lists (taken before any
        # other local exists, so only parameters can match).
        given = {name: value for name, value in locals().items() if name in QSV_DEFAULTS}
        super().__init__()
        opts = self._resolve_qsv_options(conv, given)
        hierarchy = self._resolve_hierarchy(hierarchy, geometry, spec, k_cross, k_inner)
        widths = self._check_widths(widths, hierarchy.num_levels, conv, heads)
        if isinstance(within_rounds, bool) or not isinstance(within_rounds, int) \
                or within_rounds < 0:
            raise ValueError(f"within_rounds must be a non-negative int, got {within_rounds!r}")
        if isinstance(mlp_ratio, bool) or not isinstance(mlp_ratio, (int, float)) \
                or not (math.isfinite(mlp_ratio) and mlp_ratio >= 0):
            raise ValueError(f"mlp_ratio must be a non-negative number, got {mlp_ratio!r}")

        self.num_classes = num_classes
        self.geometry = hierarchy.kind
        self.sizes = hierarchy.sizes
        self.conv_kind = conv
        self.widths = widths
        self.heads = heads
        self.within_rounds = within_rounds
        self.mlp_ratio = float(mlp_ratio)
        self.is_qsv = conv == "qsv"
        self.qsv_options = opts if self.is_qsv else {}

        # Graph tensors are buffers: built once, saved with the model, moved by .to().
        for s, edges in enumerate(hierarchy.cross_edges):
            self.register_buffer(f"cross_edges_{s}", edges.detach().clone().long())
        self.register_buffer("inner_edges", hierarchy.inner_edges.detach().clone().long())
        # Their CSRs too (not saved: rebuilt from the edges), so that a compiled
        # step reads them instead of sorting the graphs again on every call.
        self._build_static_csrs()
        self.register_load_state_dict_post_hook(_rebuild_static_csrs)

        self.embed = LambertPatchEmbedding(hierarchy.image_coords, patch_size=patch_size,
                                           image_size=image_size, in_ch=in_ch, dim=widths[0])
        # Levels 1..L-1 start from a learned per-node state that gathers from below.
        self.level_embed = nn.ParameterList(
            [nn.Parameter(torch.randn(n, w) * 0.02) for n, w in zip(self.sizes[1:], widths[1:])])

        self.fields: Optional[nn.ModuleList] = None
        self.routing_pos = False
        qsv_kwargs = self._setup_qsv(hierarchy, check_finite) if self.is_qsv else {}
        self.cross = nn.ModuleList([
            CrossBlock(conv, widths[s], widths[s + 1], heads, mlp_ratio, **qsv_kwargs)
            for s in range(hierarchy.num_levels - 1)])
        self.within = nn.ModuleList([
            WithinBlock(conv, widths[-1], heads, mlp_ratio, **qsv_kwargs)
            for _ in range(within_rounds)])
        self.norm = nn.LayerNorm(widths[-1])
        self.head = nn.Linear(widths[-1], num_classes)

    # ----------------------------------------------------------------- setup
    @staticmethod
    def _resolve_hierarchy(hierarchy: Optional[Hierarchy], geometry: str,
                           spec: Union[ShellSpec, LatticeSpec, None], k_cross: int,
                           k_inner: int) -> Hierarchy:
        if hierarchy is not None:
            if geometry != "shells" or spec is not None or k_cross != 8 or k_inner != 8:
                raise ValueError("pass either a hierarchy or geometry/spec/k_cross/k_inner, "
                                 "not both")
            return hierarchy
        if geometry not in GEOMETRIES:
            raise ValueError(f"geometry={geometry!r} is not supported; choose one of "
                             f"{GEOMETRIES}")
        if geometry == "shells":
            spec = ShellSpec() if spec is None else spec
            if not isinstance(spec, ShellSpec):
                raise ValueError(f"geometry='shells' needs a ShellSpec, got {type(spec).__name__}")
            return build_shell_hierarchy(spec, k_cross=k_cross, k_inner=k_inner)
        spec = LatticeSpec() if spec is None else spec
        if not isinstance(spec, LatticeSpec):
            raise ValueError(f"geometry='lattice' needs a LatticeSpec, got {type(spec).__name__}")
        return build_lattice_hierarchy(spec, k_cross=k_cross, k_inner=k_inner)

    @staticmethod
    def _resolve_qsv_options(conv: str, given: Dict[str, object]) -> Dict[str, object]:
        """Fill the QSV-only arguments left at ``None`` with :data:`QSV_DEFAULTS`;
        a control given any of them is an error."""
        if conv not in CONV_KINDS:
            raise ValueError(f"conv={conv!r} is not supported; choose one of {CONV_KINDS}")
        if conv != "qsv":
            extra = sorted(k for k, v in given.items() if v is not None)
            if extra:
                raise ValueError(f"{extra} only apply to conv='qsv', not conv={conv!r}")
        opts = {k: (default if given[k] is None else given[k])
                for k, default in QSV_DEFAULTS.items()}
        # One of GRAPHNET_QUAT_SOURCES from here on (an old spelling warns).
        opts["quat_source"] = resolve_quat_source(opts["quat_source"], "GraphNet")
        ignored = [k for k in FIELD_OPTIONS if given[k] is not None]
        if opts["quat_source"] == "features" and ignored:
            raise ValueError(f"{', '.join(map(repr, ignored))} configure the quaternion field, "
                             "which quat_source='features' does not have")
        return opts

    @staticmethod
    def _check_widths(widths: Sequence[int], num_levels: int, conv: str,
                      heads: int) -> tuple:
        if not is_positive_int(heads):
            raise ValueError(f"heads must be a positive int, got {heads!r}")
        widths = tuple(int(w) for w in widths)
        if len(widths) != num_levels:
            raise ValueError(f"widths has {len(widths)} entries but the hierarchy has "
                             f"{num_levels} levels")
        multiple = 4 * heads if conv == "qsv" else heads
        bad = [w for w in widths if w <= 0 or w % multiple]
        if bad:
            raise ValueError(f"widths {bad} are not positive multiples of {multiple} "
                             f"({'4 * heads' if conv == 'qsv' else 'heads'}, heads={heads})")
        return widths

    def _setup_qsv(self, hierarchy: Hierarchy, check_finite: bool) -> Dict[str, object]:
        """Build the quaternion fields, the routing positions and the regularisers;
        return the QSVConv arguments every block gets."""
        opts = self.qsv_options
        if opts["quat_source"] != "features":
            self.fields = nn.ModuleList(
                [QuaternionField(n, self.heads if opts["field_per_head"] else 1,
                                 frozen=opts["frozen_field"], init=opts["field_init"])
                 for n in self.sizes])
        if opts["routing"] == "geometric":
            # Unit directions on shells (shells of different radii are compared
            # by angle), raw coordinates on the flat lattice.
            self.routing_pos = True
            for s, p in enumerate(hierarchy.pos):
                p = p.detach().clone().float()
                if self.geometry == "shells":
                    p = p / p.norm(dim=-1, keepdim=True)
                self.register_buffer(f"pos_{s}", p)
        self._setup_regularisers(hierarchy)
        return dict(routing=opts["routing"], transport=opts["transport"],
                    quat_source=QUAT_SOURCE_TO_CONV[opts["quat_source"]],
                    beta_init=opts["beta_init"], learn_beta=opts["learn_beta"],
                    root_weight=bool(opts["root_weight"]), check_finite=check_finite)

    def _setup_regularisers(self, hierarchy: Hierarchy) -> None:
        opts = self.qsv_options
        for name in ("beta_prior_weight", "repulsion_weight"):
            if not (opts[name] >= 0 and math.isfinite(opts[name])):
                raise ValueError(f"{name} must be a non-negative number, got {opts[name]!r}")
        prior = opts["beta_prior_centre"]
        if not (prior > 0 and math.isfinite(prior)):
            raise ValueError(f"beta_prior_centre must be a positive number, got {prior!r}")
        self.log_beta_prior_centre = math.log(prior)

        # Repulsion needs a learnable field and same-level neighbours to repel.
        self.repulsion_levels: List[int] = []
        if self.fields is None or opts["frozen_field"] or opts["repulsion_weight"] == 0:
            return
        if not is_positive_int(opts["repulsion_k"]):
            raise ValueError(f"repulsion_k must be a positive int, got {opts['repulsion_k']!r}")
        for s, p in enumerate(hierarchy.pos):
            k = min(opts["repulsion_k"], p.size(0) - 1)  # small levels: all other nodes
            if k < 1:
                continue
            nbr = dense_neighbors(knn_within(p.detach().double(), k), p.size(0))
            self.register_buffer(f"repulsion_nbrs_{s}", nbr.clone())
            self.repulsion_levels.append(s)

    # ------------------------------------------------------------ static CSRs
    def _graph_sizes(self) -> Dict[str, tuple]:
        """``buffer name -> (num_src, num_dst)`` of every graph."""
        out = {f"cross_edges_{s}": (self.sizes[s], self.sizes[s + 1])
               for s in range(len(self.sizes) - 1)}
        out["inner_edges"] = (self.sizes[-1], self.sizes[-1])
        return out

    def _build_static_csrs(self) -> None:
        """Build every graph's CSR (:func:`~qsv_pyg.nn.csr.build_csr`, after a
        range check) into non-persistent buffers ``<graph>_csr_<field>`` and
        attach them to the edge buffers (:func:`~qsv_pyg.nn.csr.attach_static_csr`).
        Called at construction and after ``load_state_dict`` (new edges)."""
        for name, (n_src, n_dst) in self._graph_sizes().items():
            edges = getattr(self, name)
            check_range(edges, n_src, n_dst)
            with torch.no_grad():
                csr = build_csr(edges, n_src, n_dst)
            for field, t in zip(GraphCSR._fields, csr):
                self.register_buffer(f"{name}_csr_{field}", t, persistent=False)
        self._attach_static_csrs()

    def _attach_static_csrs(self) -> None:
        for name, (n_src, n_dst) in self._graph_sizes().items():
            csr = GraphCSR(*(getattr(self, f"{name}_csr_{f}") for f in GraphCSR._fields))
            attach_static_csr(getattr(self, name), n_src, n_dst, csr)

    def _apply(self, fn, *args, **kwargs):
        # .to() / .cuda() / .half() make new buffer tensors: attach the new CSRs
        # to the new edge tensors.
        out = super()._apply(fn, *args, **kwargs)
        if hasattr(self, "inner_edges_csr_col"):
            self._attach_static_csrs()
        return out

    # ------------------------------------------------------------- accessors
    def cross_edges(self, s: int) -> Tensor:
        """Edges from level ``s`` to level ``s + 1`` (``[2, N_{s+1} * k_cross]``)."""
        return getattr(self, f"cross_edges_{s}")

    def graph_buffers(self) -> Dict[str, Tensor]:
        """Every edge tensor the blocks use, by buffer name."""
        out = {f"cross_edges_{s}": self.cross_edges(s) for s in range(len(self.cross))}
        out["inner_edges"] = self.inner_edges
        return out

    def qsv_convs(self) -> Dict[str, QSVConv]:
        """Every QSVConv by name (``cross0``, ..., ``within0``, ...); empty for controls."""
        if not self.is_qsv:
            return {}
        out = {f"cross{s}": b.conv.conv for s, b in enumerate(self.cross)}
        out.update({f"within{r}": b.conv.conv for r, b in enumerate(self.within)})
        return out

    def _quat(self, s: int) -> Optional[Tensor]:
        if self.fields is None:
            return None
        q = self.fields[s]()  # [N, heads or 1, 4]
        # One quaternion per node shared by the heads (field_per_head=False):
        # the heads then differ only in their temperature and channel slice.
        return q if q.size(1) == self.heads else q.expand(-1, self.heads, -1)

    def _pos(self, s: int) -> Optional[Tensor]:
        return getattr(self, f"pos_{s}") if self.routing_pos else None

    # --------------------------------------------------------------- forward
    def forward(self, images: Tensor) -> Tensor:
        B = images.size(0)
        x = self.embed(images)  # [B, N_0, w_0]
        quats = [self._quat(s) for s in range(len(self.sizes))]
        for s, block in enumerate(self.cross):
            dst = self.level_embed[s].unsqueeze(0).expand(B, -1, -1)
            pair_q = None if quats[s] is None else (quats[s], quats[s + 1])
            pair_p = None if not self.routing_pos else (self._pos(s), self._pos(s + 1))
            x = block(x, dst, self.cross_edges(s), quat=pair_q, pos=pair_p)
        for block in self.within:
            x = block(x, self.inner_edges, quat=quats[-1], pos=self._pos(len(self.sizes) - 1))
        return self.head(self.norm(x.mean(dim=1)))

    # ----------------------------------------------------- ImageClassifier hooks
    def auxiliary_loss(self) -> Tensor:
        """Field repulsion (mean over levels) plus the log-temperature prior."""
        loss = super().auxiliary_loss()
        if not self.is_qsv:
            return loss
        opts = self.qsv_options
        if self.repulsion_levels:
            assert self.fields is not None
            rep = torch.stack([self.fields[s].repulsion(getattr(self, f"repulsion_nbrs_{s}"))
                               for s in self.repulsion_levels]).mean()
            loss = loss + opts["repulsion_weight"] * rep
        if opts["beta_prior_weight"] > 0 and opts["learn_beta"]:
            prior = sum((conv.log_beta - self.log_beta_prior_centre).pow(2).sum()
                        for conv in self.qsv_convs().values())
            loss = loss + opts["beta_prior_weight"] * prior
        return loss

    def betas(self) -> Dict[str, Tensor]:
        """Per-head temperatures ``[heads]`` of every QSV layer (detached)."""
        return {name: conv.beta.detach() for name, conv in self.qsv_convs().items()}

    def sphere_parameters(self) -> List[nn.Parameter]:
        """The learnable quaternion fields (read from the modules on every call)."""
        if self.fields is None:
            return []
        return [f.quaternions for f in self.fields if not f.frozen]

    def describe(self) -> str:
        """Short configuration string, e.g. ``"qsv on shells 256-144-64-36-16, ..."``."""
        text = (f"{self.conv_kind} on {self.geometry} {'-'.join(map(str, self.sizes))}, "
                f"widths {'-'.join(map(str, self.widths))}, heads {self.heads}")
        if self.mlp_ratio == 0:
            text += ", no MLP"
        if self.is_qsv:
            o = self.qsv_options
            text += (f", routing {o['routing']}, transport {o['transport']}, "
                     f"quat {o['quat_source']}{' (frozen)' if o['frozen_field'] else ''}")
            if not o["root_weight"]:
                text += ", no root weight"
        return text

    def summary(self) -> str:
        """Parameter count and configuration, e.g. ``"GraphNet: 0.570M parameters
        (570,000), ... [qsv on shells ...]"``."""
        return f"{super().summary()} [{self.describe()}]"

    def extra_repr(self) -> str:
        return f"{self.describe()}, {format_count(self.num_parameters())} parameters"


def _rebuild_static_csrs(module: "GraphNet", incompatible_keys) -> None:
    """``load_state_dict`` post-hook: the loaded edges get their CSRs (a module-level
    function, so that a GraphNet still pickles)."""
    module._build_static_csrs()


def graph_net_default(name: str) -> Any:
    """GraphNet's default for keyword ``name``, where every other module reads it.

    The QSV-only keywords default to ``None`` in the signature (a control rejects
    them), so theirs come from :data:`QSV_DEFAULTS` (which reads those of
    :data:`CONV_KEYWORDS` from QSVConv's signature); the others from the signature.

    Example:
        >>> graph_net_default("heads"), graph_net_default("beta_prior_weight")
        (16, 0.01)
    """
    if name in QSV_DEFAULTS:
        return QSV_DEFAULTS[name]
    return inspect.signature(GraphNet).parameters[name].default
