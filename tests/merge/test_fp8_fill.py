"""``MergedSource``'s block-FP8 fill in cache-sized bands (``merge.fp8_fill``) against transformers' own
``Fp8Quantize._quantize_one`` of the whole tensor, bit for bit: bands grouping whole experts, bands of block rows,
a block row cut into groups of blocks; boxes cut inside a block row (the reused region buffer), scales from the
kept regions and scales alone (merged again); a float64 base cast once to float32, both scale formats."""

from __future__ import annotations

import pytest
import torch

from protocols.params import ParamMeta, box_shape
from sync_service.fp8 import scale_name
from sync_service.merge.base import TensorDictBase
from sync_service.merge.source import MergeConfig, MergedSource
from sync_service.verify.fp8_oracle import transformers_quantize

BLOCK = (16, 16)
SHAPES = {"e.experts.gate_up_proj": ((4, 64, 48), torch.float32), "d.weight": ((64, 80), torch.float64)}
TILES = {  # tile_bytes -> the bands it makes of the [4, 64, 48] tensor
    "experts": 4 * 64 * 48 * 2,  # two whole experts per band
    "block-rows": 4 * 16 * 48 * 2,  # two block rows
    "blocks": 4 * 16 * 16 * 2,  # a block row (768 elements) cut into groups of two blocks
}
SCALE_WIRE = {"float": "float32", "ue8m0": "float8_e8m0fnu"}


def _source(tile_bytes: int, scale_fmt: str) -> tuple[MergedSource, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(4)
    tensors = {n: (torch.randn(shape, generator=gen, dtype=dtype) * torch.logspace(-2, 2, shape[-1], dtype=dtype))
               for n, (shape, dtype) in SHAPES.items()}
    out_dtypes = {**{n: "float8_e4m3fn" for n in SHAPES}, **{scale_name(n): SCALE_WIRE[scale_fmt] for n in SHAPES}}
    config = MergeConfig(out_dtypes=out_dtypes, fp8_blocks={n: BLOCK for n in SHAPES}, tile_bytes=tile_bytes)
    return MergedSource(TensorDictBase(tensors), None, config=config), tensors


def _fill(source: MergedSource, name: str, box) -> torch.Tensor:
    out = torch.full(box_shape(box), 7.0).to(source.out_dtype(name))
    source.fill(name, box, out)
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("scale_fmt", ["float", "ue8m0"])
@pytest.mark.parametrize("tile", list(TILES))
def test_bands_and_cut_boxes_are_transformers_quantize_of_the_whole_tensor(tile, scale_fmt):
    source, tensors = _source(TILES[tile], scale_fmt)
    for name, values in tensors.items():
        want = transformers_quantize(name, values.to(torch.float32), BLOCK, scale_fmt)
        *lead, rows, cols = values.shape
        full = tuple((0, n) for n in values.shape)
        cut = rows // 2 + 3  # inside a block row: both pieces widen to it
        pieces = [(*full[:-2], (0, cut), (0, cols)), (*full[:-2], (cut, rows), (0, cols))]
        got = torch.cat([_bytes(_fill(source, name, box)) for box in pieces], dim=-2)
        assert torch.equal(got, _bytes(want[name])), f"{name}: {int((got != _bytes(want[name])).sum())} bytes differ"
        grid = tuple((0, n) for n in want[scale_name(name)].shape)
        assert torch.equal(_bytes(_fill(source, scale_name(name), grid)), _bytes(want[scale_name(name)]))
        assert torch.equal(_bytes(_fill(source, name, full)), _bytes(want[name]))  # straight into the bucket

    alone, _ = _source(TILES[tile], scale_fmt)  # scales whose values another rank sent: merged again
    for name, values in tensors.items():
        want = transformers_quantize(name, values.to(torch.float32), BLOCK, scale_fmt)[scale_name(name)]
        half = (*((0, n) for n in want.shape[:-1]), (1, want.shape[-1]))
        assert torch.equal(_bytes(_fill(alone, scale_name(name), half)), _bytes(want[..., 1:]))


def test_owned_boxes_of_an_expert_shard():
    """An EP shard's box (experts 2..4) quantized in bands equals that box of the whole tensor's quantization."""
    name = "e.experts.gate_up_proj"
    box = ((2, 4), (0, 64), (0, 48))
    gen = torch.Generator().manual_seed(5)
    values = torch.randn(4, 64, 48, generator=gen)
    config = MergeConfig(out_dtypes={name: "float8_e4m3fn", scale_name(name): "float32"}, fp8_blocks={name: BLOCK},
                         tile_bytes=TILES["blocks"])
    source = MergedSource(TensorDictBase({name: values}), None, config=config, owned=[ParamMeta(name, "float32", (4, 64, 48), box=box)])
    want = transformers_quantize(name, values, BLOCK)
    assert torch.equal(_bytes(_fill(source, name, box)), _bytes(want[name][2:4]))
    assert torch.equal(_fill(source, scale_name(name), ((2, 4), (0, 4), (0, 3))), want[scale_name(name)][2:4])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_engines_dequantizer_is_transformers_dequantize_on_every_fp8_byte(dtype):
    """Every FP8 byte (NaN, -0, subnormals, ±448) in blocks of float32 and e8m0 scales, through one reused
    ``Dequantizer`` (its table lookup and work buffers), bitwise transformers' ``Fp8Dequantize``."""
    from sync_service.merge.quantize import Dequantizer
    from sync_service.verify.fp8_oracle import transformers_dequantize

    q = torch.arange(256 * 4, dtype=torch.int32).remainder(256).to(torch.uint8).view(torch.float8_e4m3fn).view(2, 32, 16)
    dequantize = Dequantizer()
    for scales in (torch.tensor([[[0.5], [3.0e-3]], [[7.0], [1e-40]]]), torch.tensor([[[0.25], [2.0]], [[8.0], [1.0]]]).to(torch.float8_e8m0fnu)):
        out = torch.empty(q.shape, dtype=dtype)
        for _ in range(2):  # the second call reuses the buffers
            got = dequantize(q, scales, dtype, out=out)
            want = transformers_dequantize(q, scales, dtype)
            assert got is out and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
