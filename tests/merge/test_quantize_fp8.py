"""``merge.quantize.quantize_blocks`` against transformers' own ``Fp8Quantize._quantize_one``, bit for bit,
on crafted tensors: random 2D / 3D, float64 input, zero blocks, one huge value, subnormal scales, ue8m0
rounding at and next to powers of two, and aligned boxes of a tensor."""

from __future__ import annotations

import pytest
import torch

from sync_service.merge.quantize import box_aligned, divides, quantize_blocks, scale_name, scale_shape
from sync_service.verify.fp8_oracle import transformers_quantize


def reference(values: torch.Tensor, block: tuple[int, int], scale_fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    out = transformers_quantize("x.weight", values, block, scale_fmt)
    return out["x.weight"], out["x.weight_scale_inv"]


def assert_bitwise(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, list(g.shape), w.dtype, list(w.shape))
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8)), f"{int((g.view(torch.uint8) != w.view(torch.uint8)).sum())} bytes differ"


FMTS = ("float", "ue8m0")


@pytest.mark.parametrize("scale_fmt", FMTS)
@pytest.mark.parametrize("shape", [(64, 96), (3, 32, 48)])
def test_random_tensors_match_transformers(shape, scale_fmt):
    torch.manual_seed(0)
    values = torch.randn(shape) * torch.logspace(-3, 3, shape[-1])  # blocks of very different magnitudes
    assert_bitwise(quantize_blocks(values, (16, 16), scale_fmt), reference(values, (16, 16), scale_fmt))


@pytest.mark.parametrize("scale_fmt", FMTS)
def test_float64_input_is_cast_to_float32_first(scale_fmt):
    torch.manual_seed(1)
    values = torch.randn(32, 32, dtype=torch.float64)
    assert_bitwise(quantize_blocks(values, (16, 16), scale_fmt), reference(values.to(torch.float32), (16, 16), scale_fmt))


@pytest.mark.parametrize("scale_fmt", FMTS)
def test_crafted_blocks(scale_fmt):
    """Block (0,0) zero (scale 1), (0,1) one huge value among tiny ones, (1,0) amax 2e-36 (scale_inv
    subnormal in float32), (1,1) amax exactly 448·2^-3 (ue8m0: an exact power of two), (2,0) just above it
    (the next power), (2,1) negative values and a -0."""
    torch.manual_seed(2)
    values = torch.randn(48, 32) * 1e-3
    values[0:16, 0:16] = 0
    values[0:16, 16:32] *= 1e-6
    values[3, 20] = 3e38
    values[16:32, 0:16] = torch.rand(16, 16) * 2e-36
    values[17, 3] = 2e-36
    values[16:32, 16:32] = torch.rand(16, 16) * 56
    values[20, 20] = 56.0
    values[32:48, 0:16] = torch.rand(16, 16) * 56
    values[33, 1] = torch.nextafter(torch.tensor(56.0), torch.tensor(100.0))
    values[32:48, 16:32] = -torch.rand(16, 16)
    values[40, 20] = -0.0
    got = quantize_blocks(values, (16, 16), scale_fmt)
    assert_bitwise(got, reference(values, (16, 16), scale_fmt))
    scales = got[1].to(torch.float32)
    assert scales[0, 0] == 1  # a zero block keeps scale 1
    if scale_fmt == "float":
        assert 0 < scales[1, 0] < torch.finfo(torch.float32).tiny  # subnormal scale_inv
    else:
        assert scales[1, 1] == 2.0**-3 and scales[2, 0] == 2.0**-2  # ue8m0 rounds the inverse scale up


def test_aligned_boxes_give_the_whole_tensors_values():
    torch.manual_seed(3)
    values = torch.randn(4, 64, 48)
    q, s = quantize_blocks(values, (16, 16))
    box = ((1, 3), (16, 48), (32, 48))
    assert box_aligned(box, (16, 16)) and not box_aligned(((0, 4), (8, 24), (0, 48)), (16, 16))
    bq, bs = quantize_blocks(values[1:3, 16:48, 32:48], (16, 16))
    assert torch.equal(bq.view(torch.uint8), q[1:3, 16:48, 32:48].view(torch.uint8))
    assert torch.equal(bs, s[1:3, 1:3, 2:3])


def test_shapes_the_block_does_not_divide_are_refused():
    assert not divides((16, 24), (16, 16)) and not divides((16,), (16, 16)) and divides((2, 32, 16), (16, 16))
    with pytest.raises(ValueError, match="K % 16 == 0"):
        quantize_blocks(torch.zeros(16, 24), (16, 16))
    assert transformers_quantize("x.weight", torch.zeros(16, 24), (16, 16), "float").keys() == {"x.weight"}  # passed through
    assert scale_shape((4, 64, 32), (16, 16)) == (4, 4, 2)
    assert scale_name("a.q_proj.weight") == "a.q_proj.weight_scale_inv"
    assert scale_name("a.experts.gate_up_proj") == "a.experts.gate_up_proj_scale_inv"


@pytest.mark.parametrize("shape", [(64, 96), (3, 32, 48)])
def test_dequantize_in_chunks_into_a_reused_buffer_is_transformers_dequantize(monkeypatch, shape):
    from sync_service.merge import quantize
    from sync_service.verify.fp8_oracle import transformers_dequantize

    q, scales = quantize_blocks(torch.randn(shape, generator=torch.Generator().manual_seed(3)) * 3, (16, 16))
    want = transformers_dequantize(q, scales, torch.bfloat16)
    monkeypatch.setattr(quantize, "DEQUANTIZE_CHUNK", 16 * 48)  # several steps per tensor
    out = torch.full(shape, 7.0, dtype=torch.bfloat16)
    got = quantize.dequantize_blocks(q, scales, torch.bfloat16, out=out)
    assert got is out and torch.equal(got.view(torch.int16), want.view(torch.int16))
