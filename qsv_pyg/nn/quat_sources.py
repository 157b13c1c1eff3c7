"""The one vocabulary of ``quat_source``: where node quaternions come from.

Every layer and model that takes a ``quat_source`` accepts a subset of
:data:`QUAT_SOURCES`, named in :data:`QUAT_SOURCES_OF`, and resolves the value
with :func:`resolve_quat_source` (old spellings of :data:`QUAT_SOURCE_ALIASES`
are read there, with a :class:`DeprecationWarning`). :class:`~qsv_pyg.nn.QSVConv` turns a source into quaternions.
"""
from __future__ import annotations

import warnings

#: Every name of ``quat_source`` in the package. ``"auto"``: ``"given"`` when
#: ``quat`` is passed, else ``"features"``; ``"features"``: a learned linear
#: map of the features; ``"given"``: the ``quat`` argument; ``"field"``: a
#: learned per-node field that a model holds (its convs get it as
#: ``"given"``); ``"composed"``: the given quaternions or the field, composed
#: with the feature quaternions (``quat ⊗ q(x)``).
QUAT_SOURCES = ("auto", "features", "given", "field", "composed")
#: Old spellings, read (with a :class:`DeprecationWarning`) wherever a source is
#: given: ``"both"``, the image model's (and ``--quat-source``'s) old name of
#: ``"composed"``. (The test-time intervention that turns routing and transport
#: off is ``"both-off"``, :data:`qsv_pyg.analysis.INTERVENTIONS`.)
QUAT_SOURCE_ALIASES = {"both": "composed"}
#: The sources each layer and model accepts (subsets of :data:`QUAT_SOURCES`).
QUAT_SOURCES_OF = {
    "QSVConv": ("auto", "features", "given", "composed"),
    "QSV": ("features", "field", "given", "composed"),  # qsv_pyg.nn.models.QSV
    "GraphNet": ("field", "features", "composed"),  # qsv_pyg.models.GraphNet
}


def resolve_quat_source(value: str, owner: str) -> str:
    """The canonical name of ``value`` (an alias of :data:`QUAT_SOURCE_ALIASES`
    is read, with a :class:`DeprecationWarning`) if ``owner`` (a key of :data:`QUAT_SOURCES_OF`) accepts it;
    else a :class:`ValueError` that names the accepted sources."""
    name = value
    if isinstance(value, str) and value in QUAT_SOURCE_ALIASES:
        name = QUAT_SOURCE_ALIASES[value]
        warnings.warn(f"quat_source={value!r} is an old spelling of {name!r}",
                      DeprecationWarning, stacklevel=3)
    accepted = QUAT_SOURCES_OF[owner]
    if name not in accepted:
        raise ValueError(f"quat_source={value!r} is not supported; choose one of "
                         f"{', '.join(repr(c) for c in accepted)}")
    return name


def conv_quat_source(name: str) -> str:
    """The :class:`~qsv_pyg.nn.QSVConv` ``quat_source`` that a model's source
    ``name`` asks of its convs: a model's field reaches them as given
    quaternions (``name``: a canonical source, see :func:`resolve_quat_source`)."""
    return "given" if name == "field" else name
