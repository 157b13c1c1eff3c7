"""Self-describing configuration fields: help text, flag, accepted values and roles.

:func:`option` declares a dataclass field whose metadata says everything the
rest of the code needs to know about it, so :class:`~qsv_pyg.training.config.TrainConfig`
is the one list of options: the command-line parser, the checks, the
resume rules and the experiment runner's rules are all read from it.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Dict, List, Mapping, Optional, Tuple

__all__ = ["ConfigError", "RESUME", "ROW", "SHARED", "TABLE", "all_finite", "check_value",
           "field_kind", "flag_of", "is_number", "option", "to_argv"]

#: Role: may differ when resuming (where and how fast a run goes, not what it computes).
RESUME = "resume"
#: Role: set per run by the experiment runner (``reproduce.py --train-args`` refuses it).
TABLE = "table"
#: Role: should be equal across the runs of one table for a fair comparison.
SHARED = "shared"
#: Role: a table row may switch it, like an ablation (the runner then sets it per run).
ROW = "row"

# ``from __future__ import annotations`` leaves the annotations as text.
_KINDS = {"str": str, "bool": bool, "int": int, "float": float, "Dict[str, Any]": dict,
          "List[float]": list}


class ConfigError(ValueError):
    """An invalid or inconsistent training configuration (a user error)."""


def option(default: Any = None, help: str = "", *, group: Optional[str],
           roles: Tuple[str, ...] = (), choices: Optional[tuple] = None,
           lo: Optional[float] = None, hi: Optional[float] = None, lo_open: bool = False,
           hi_open: bool = False, model_key: Optional[str] = None, negate: bool = False,
           metavar: Optional[str] = None, factory=None, aliases: Tuple[str, ...] = (),
           value_aliases: Optional[Mapping[str, str]] = None) -> Any:
    """A configuration field with its description as metadata.

    Args:
        default: default value (``factory`` for mutable ones).
        help: help text of the command-line flag (``--name-with-dashes``).
        group: command-line group; ``None`` for a field without a flag.
        roles: any of :data:`RESUME`, :data:`TABLE`, :data:`SHARED`, :data:`ROW`.
        choices: accepted values.
        lo, hi, lo_open, hi_open: accepted range of a number.
        model_key: the model keyword an ablation switch sets (``None`` unless the
            field is a QSV ablation; ablations are set per run by the runner). It is
            the field's own name: one word for the flag, the model keyword and the
            table-row key.
        negate: the model keyword is the negation (``frozen_beta`` -> ``learn_beta``),
            the one field whose model keyword is another word.
        metavar: name of the value in ``--help``.
        aliases: old names of the field, still accepted: as flags (``--old-name``),
            as keys of a stored configuration and of a table row.
        value_aliases: old spellings of values, still accepted (old -> value).
    """
    meta = dict(help=help, group=group, roles=frozenset(roles), choices=choices, lo=lo, hi=hi,
                lo_open=lo_open, hi_open=hi_open, model_key=model_key, negate=negate,
                metavar=metavar, aliases=tuple(aliases), value_aliases=dict(value_aliases or {}))
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def field_kind(f: dataclasses.Field) -> Tuple[type, bool]:
    """``(type, optional)`` of a field, e.g. ``(float, True)`` for ``Optional[float]``."""
    text = str(f.type)
    optional = text.startswith("Optional[")
    return _KINDS[text[len("Optional["):-1] if optional else text], optional


def flag_of(name: str) -> str:
    """The command-line flag of a field: ``--name-with-dashes``."""
    return "--" + name.replace("_", "-")


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def check_value(f: dataclasses.Field, value: Any) -> None:
    """Type, choice and range of one field's value, as its metadata declares them.

    Raises:
        ConfigError: naming the flag, what it accepts and the value.
    """
    kind, optional = field_kind(f)
    meta, flag = f.metadata, flag_of(f.name)
    if value is None and optional:
        return
    if kind is bool:
        _need(isinstance(value, bool), f"{flag} must be true/false; got {value!r}")
    elif kind in (int, float):
        integer = kind is int
        _need(isinstance(value, int if integer else (int, float)) and not isinstance(value, bool),
              f"{flag} must be {'an integer' if integer else 'a number'}; got {value!r}")
        _need(integer or math.isfinite(value), f"{flag} must be finite; got {value!r}")
        lo, hi = meta["lo"], meta["hi"]
        lo_ok = lo is None or (value > lo if meta["lo_open"] else value >= lo)
        hi_ok = hi is None or (value < hi if meta["hi_open"] else value <= hi)
        if hi is None:
            bound = f"{'>' if meta['lo_open'] else '>='} {lo}"
        else:
            bound = (f"in {'(' if meta['lo_open'] else '['}{lo}, {hi}"
                     f"{')' if meta['hi_open'] else ']'}")
        _need(lo_ok and hi_ok, f"{flag} must be {bound}; got {value!r}")
    elif kind is str:
        _need(isinstance(value, str), f"{flag} must be a string; got {value!r}")
        if meta["choices"] is not None:
            _need(value in meta["choices"], f"{flag} must be one of "
                                            f"{', '.join(meta['choices'])}; got {value!r}")


def to_argv(fields: Mapping[str, dataclasses.Field], values: Mapping[str, Any]) -> List[str]:
    """Command-line flags that set ``values`` (field name -> value; ``None`` is skipped).

    Raises:
        ConfigError: a name that is not a field with a flag.
    """
    out: List[str] = []
    for name, value in values.items():
        if value is None:
            continue
        if name not in fields or fields[name].metadata["group"] is None:
            raise ConfigError(f"{name!r} is not a command-line option")
        flag = flag_of(name)
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])  # BooleanOptionalAction
        elif isinstance(value, dict):  # model_args: one --model-arg KEY=JSON each
            for key, arg in value.items():
                out += ["--model-arg", f"{key}={json.dumps(arg)}"]
        elif isinstance(value, (list, tuple)):
            if value:
                out += [flag, *(_text(v) for v in value)]
        else:
            out += [flag, _text(value)]
    return out


def _text(value: Any) -> str:
    # repr keeps floats exact through the command line.
    return repr(value) if isinstance(value, float) else str(value)


def all_finite(value: Any) -> bool:
    """Whether every number in a (nested) JSON-like value is finite."""
    if isinstance(value, (list, tuple)):
        return all(all_finite(v) for v in value)
    if isinstance(value, dict):
        return all(all_finite(v) for v in value.values())
    return not isinstance(value, float) or math.isfinite(value)


def is_number(value: Any) -> bool:
    """An int or float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)
