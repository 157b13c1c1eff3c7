"""The Triton kernel variants that ``benchmarks/run_gpu.sh`` launches compile
for Hopper (sm_90) without a GPU: a representative subset here (every kernel of
bench_conv's QSV layers, and the CIFAR model's batch-as-channels tiles in the
slow test); ``python3 benchmarks/gpu_warmup.py --compile-sm90`` compiles all."""
from __future__ import annotations


import pytest

pytest.importorskip("triton")
from conftest import load_benchmark  # noqa: E402

gpu_warmup = load_benchmark("gpu_warmup")


def _compile_all(variants):
    try:
        sizes = {gpu_warmup.describe(v): gpu_warmup.compile_sm90(v) for v in variants}
    except RuntimeError as exc:
        if "TRITON_INTERPRET" in str(exc) or "ptxas" in str(exc).lower():
            pytest.skip(f"cannot compile for sm_90 here: {exc!s:.200}")
        raise
    assert all(size > 0 for size in sizes.values()), sizes
    return sizes


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
def test_conv_benchmark_variants_compile_for_sm90():
    variants = gpu_warmup.record_variants(["conv"], precisions=gpu_warmup.PRECISIONS)
    kernels = {v[0] for v in variants}
    assert kernels == set(gpu_warmup.KERNELS), kernels  # all four, with and without dq/dk
    assert len(variants) >= 6
    # issue 32 item 8b: the warps are chosen per tile, recorded with the variant
    # (a compile option, not a constexpr: compile_sm90 passes it as one)
    assert all(dict(v[2]).get("num_warps") in (1, 2, 4, 8) for v in variants), variants
    one_each = {}
    for v in variants:  # one variant of each kernel: the feature-quaternion layer's
        if v[0] not in one_each or dict(v[2]).get("NEED_Q"):
            one_each[v[0]] = v
    _compile_all(one_each.values())


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
def test_blocks_of_four_are_read_as_vectors():
    """Issue 32 item 8a: a block of four channels (and a quaternion) is loaded as
    one ``[..., 4]`` tile, so with aligned tensors (Triton specialises pointers on
    16-byte alignment at launch) the features, gradients and quaternions are read
    with 16-byte vector loads (``ld.global.v4``) rather than four scalar ones."""
    import re
    variants = gpu_warmup.record_variants(["conv qsv k8 ", "conv qsv-field k8 "],
                                          precisions=("fp32", ))
    one_each = {}
    for v in variants:
        one_each.setdefault(v[0], v)
    for name in ("rotate_rows", "forward_rows", "backward_rows", "backward_cols",
                 "unit_rows", "layer_rotate_rows", "layer_forward_rows",
                 "layer_backward_rows", "layer_backward_cols"):
        try:
            ptx = gpu_warmup.build_sm90(one_each[name], aligned=True).asm["ptx"]
        except RuntimeError as exc:
            if "TRITON_INTERPRET" in str(exc) or "ptxas" in str(exc).lower():
                pytest.skip(f"cannot compile for sm_90 here: {exc!s:.200}")
            raise
        assert re.search(r"ld\.global(\.[a-z0-9]+)*\.v4\.b32", ptx), name


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
def test_cifar_model_variants_compile_for_sm90():
    variants = gpu_warmup.record_variants([f"train qsv b{gpu_warmup.TRAIN_BATCH} fp32"])
    # (the CIFAR model's convs take a given field: the composed path's kernels)
    assert {v[0] for v in variants} == {k for k in gpu_warmup.KERNELS
                                        if not k.startswith("layer_")}
    _compile_all(variants)


@pytest.mark.parametrize("device", ["foo", "cuda"])
def test_warmup_refuses_a_device_it_cannot_use(device, capsys):
    import torch
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("there is a CUDA device here")
    assert gpu_warmup.main(["--device", device]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
