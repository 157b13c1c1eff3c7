"""Issue 32 item 8: the kernels' launch configuration, chosen in Python from the
tile sizes (pure functions: no kernel runs here; the results of every choice
are checked against the literal formula in test_triton_kernel.py)."""
from __future__ import annotations

import pytest

from qsv_pyg.nn import triton_kernel as tk
from qsv_pyg.nn import triton_tuning as tt


@pytest.mark.parametrize("tile,warps", [(0, 1), (1, 1), (16, 1), (64, 1), (128, 1),
                                        (129, 2), (256, 2), (257, 4), (512, 4), (1024, 8),
                                        (4096, 8), (10 ** 6, 8)])
def test_num_warps_for_tile(tile, warps):
    assert tt.num_warps_for(tile) == warps


def test_num_warps_is_a_power_of_two_growing_with_the_tile():
    last = 0
    for tile in range(0, 5000, 7):
        w = tt.num_warps_for(tile)
        assert w & (w - 1) == 0 and 1 <= w <= tt.MAX_WARPS
        assert w >= last
        last = w


# ------------------------------------------------- launch configurations (8c/d)
def _setup(H, M, D=4):
    import torch
    pytest.importorskip("triton")
    return tk._Setup(torch.zeros(1, H, M, 4), torch.zeros(1, H, D))


@pytest.mark.parametrize("H,M", [(1, 1), (4, 4), (16, 1), (4, 32), (2, 256)])
@pytest.mark.parametrize("degree", [1, 4, 8, 16, 32, 64, 256])
def test_candidates(H, M, degree):
    """The heuristic configuration first (one row per program, the setup's
    step and warps: what runs untuned); then at most four more, each a valid
    launch: steps no longer than the setup's nor (beyond one) the degree,
    several rows per program only for low degrees, warps a power of two."""
    s = _setup(H, M)
    cands = tt.candidates(s, degree)
    assert cands[0] == tt.Config(s.BE, 1, s.warps)
    assert len(cands) == len(set(cands)) <= 5
    for c in cands:
        assert 1 <= c.BE <= s.BE and c.BE & (c.BE - 1) == 0
        assert c.warps in (1, 2, 4, 8)
        assert c.TARGETS in (1, ) + tt.TARGETS_CHOICES
        if c.TARGETS > 1:
            assert degree <= tt.SHARED_ROWS_DEGREE and c.BE <= max(degree, 1)
    if degree <= tt.SHARED_ROWS_DEGREE:
        assert {c.TARGETS for c in cands} == {1, *tt.TARGETS_CHOICES}
    else:
        assert {c.TARGETS for c in cands} == {1}
    if degree < s.BE:
        assert any(c.BE == degree and c.TARGETS == 1 for c in cands)


@pytest.mark.parametrize("edges,rows,bucket", [(0, 0, 1), (0, 5, 1), (80, 10, 8),
                                               (79, 10, 8), (160, 10, 16), (130, 10, 16),
                                               (50, 10, 8), (1000, 10, 128)])
def test_degree_bucket(edges, rows, bucket):
    assert tt.degree_bucket(edges, rows) == bucket


class _Clock:
    """Stands for the timer: each configuration's time from a table."""

    def __init__(self, times):
        self.times, self.calls = times, []

    def __call__(self, run, device):
        self.calls.append(run)
        run()
        return self.times[self.launched[-1]]


def _tuner(monkeypatch, times):
    import torch
    clock = _Clock(times)
    launched = []
    clock.launched = launched
    monkeypatch.setattr(tt, "_seconds", clock)
    monkeypatch.setattr(tt, "TUNED", {})
    monkeypatch.setattr(tt, "TIMINGS", {})
    configs = list(times)
    return clock, launched, configs, torch.device("cpu")


def test_tuning_picks_the_fastest_once_per_key(monkeypatch):
    a, b, c = tt.Config(16, 1, 1), tt.Config(8, 2, 1), tt.Config(8, 4, 1)
    clock, launched, configs, cpu = _tuner(monkeypatch, {a: 3.0, b: 1.0, c: 2.0})
    import torch
    monkeypatch.setenv(tt.AUTOTUNE_ENV, "1")
    s = _setup(2, 1)
    key = tt.tuning_key("forward_rows", cpu, torch.float32, s, 8, {"ROTATE": True})
    assert tt.launch_tuned(key, configs, launched.append, cpu) == b
    assert launched == [a, b, c, b]  # every candidate timed, then the chosen one
    launched.clear()
    assert tt.launch_tuned(key, configs, launched.append, cpu) == b
    assert launched == [b] and len(clock.calls) == 3  # remembered: no timing
    other = tt.tuning_key("forward_rows", cpu, torch.float32, s, 16, {"ROTATE": True})
    assert tt.launch_tuned(other, configs, launched.append, cpu) == b
    assert len(clock.calls) == 6  # a new key (another degree) is timed
    row = tt.tuned()[0]
    assert (row["kernel"], row["H"], row["M"], row["D"], row["degree"]) == (
        "forward_rows", 2, 1, 4, 8)
    assert row["chosen"] == {"BE": 8, "TARGETS": 2, "warps": 1}
    assert [t["us"] for t in row["timings_us"]] == [3e6, 1e6, 2e6]


@pytest.mark.parametrize("how", ["off", "deterministic", "cpu-auto"])
def test_untuned_launch_is_the_heuristic_one(how, monkeypatch):
    """``QSV_PYG_AUTOTUNE=0``, deterministic mode (a rerun must sum in the same
    order, whatever was tuned before) and CPU tensors by default: the first
    candidate, nothing timed, nothing remembered."""
    import torch
    a, b = tt.Config(16, 1, 1), tt.Config(8, 2, 1)
    clock, launched, configs, cpu = _tuner(monkeypatch, {a: 3.0, b: 1.0})
    if how == "off":
        monkeypatch.setenv(tt.AUTOTUNE_ENV, "0")
    elif how == "deterministic":
        monkeypatch.setenv(tt.AUTOTUNE_ENV, "1")
        tt.TUNED[("k", 1)] = b  # even a remembered choice is not used
        old = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)
    else:
        monkeypatch.delenv(tt.AUTOTUNE_ENV, raising=False)
    try:
        assert tt.launch_tuned(("k", 1), configs, launched.append, cpu) == a
        assert tt.tuning_enabled(cpu) is False
    finally:
        if how == "deterministic":
            torch.use_deterministic_algorithms(old)
    assert launched == [a] and not clock.calls


def test_tuned_rows_are_json(monkeypatch):
    import json

    import torch
    a, b = tt.Config(16, 1, 1), tt.Config(8, 2, 1)
    clock, launched, configs, cpu = _tuner(monkeypatch, {a: 3.0, b: 1.0})
    monkeypatch.setenv(tt.AUTOTUNE_ENV, "1")
    key = tt.tuning_key("backward_cols", cpu, torch.bfloat16, _setup(4, 4), 16,
                        {"NEED_Q": True, "SUM_QD": False})
    tt.launch_tuned(key, configs, launched.append, cpu)
    rows = json.loads(json.dumps(tt.tuned()))
    assert rows[0]["flags"] == {"NEED_Q": True, "SUM_QD": False}
    assert rows[0]["dtype"] == "torch.bfloat16"
