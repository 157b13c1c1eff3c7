"""``QSV``'s size arguments (issue 23, item 10).

A bad ``heads``, ``hidden_channels``, ``num_layers`` or ``out_channels`` is named
in a ``ValueError`` (the first bad one in signature order), not a
``ZeroDivisionError``, as ``QSVConv`` does; numpy integers are integers.
"""
from __future__ import annotations

import numpy as np
import pytest

from qsv_pyg.nn.models import QSV


@pytest.mark.parametrize("args, kwargs, name", [
    ((7, 16, 2, 4), {"heads": 0}, "heads"),
    ((7, 16, 2, 4), {"heads": -2}, "heads"),
    ((7, 16, 2, 4), {"heads": 2.0}, "heads"),
    ((7, 16, 2, 4), {"heads": True}, "heads"),
    ((7, 0, 2, 4), {}, "hidden_channels"),
    ((7, 16.0, 2, 4), {}, "hidden_channels"),
    ((7, 16, 0, 4), {}, "num_layers"),
    ((7, 16, "2", 4), {}, "num_layers"),
    ((7, 16, 2, 0), {}, "out_channels"),
    ((7, 16, 2, 0), {"heads": 0}, "out_channels"),  # the first bad one in signature order
])
def test_qsv_names_a_bad_size_argument_in_a_value_error(args, kwargs, name):
    with pytest.raises(ValueError, match=rf"^{name} must be a positive integer, got "):
        QSV(*args, **kwargs)


def test_qsv_heads_zero_is_a_value_error_like_qsvconv():
    from qsv_pyg.nn import QSVConv
    with pytest.raises(ValueError, match="heads"):
        QSVConv(7, 16, heads=0)
    with pytest.raises(ValueError, match="heads") as info:
        QSV(7, 16, 2, 4, heads=0)
    assert not isinstance(info.value, ZeroDivisionError)
    assert QSV(7, 16, 2, 4, heads=np.int64(2)).convs[0].heads == 2  # numpy ints are ints
