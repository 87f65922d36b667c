"""The served check's per-piece work (``engines.landed``): finiteness by numpy on the bit pattern / a dot product,
and the bytes of a box as they lie in a staging buffer."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from sync_service.engines.landed import Landed, finite, span

FLOATS = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", FLOATS)
def test_finite_finds_every_nan_and_inf_and_no_more(dtype):
    values = torch.randn(3000, generator=torch.Generator().manual_seed(0)).to(dtype)
    assert finite(values)
    for bad, at in itertools.product((float("nan"), float("inf"), float("-inf")), (0, 1, 1777, 2999)):
        broken = values.clone()
        broken[at] = bad
        assert not finite(broken), (bad, at)
    extreme = torch.full((16,), torch.finfo(dtype).max, dtype=dtype)  # x·x overflows: the bits decide
    extreme[3] = -extreme[3]
    assert finite(extreme)
    assert finite(torch.full((5,), torch.finfo(dtype).tiny, dtype=dtype))


def test_finite_fp8_nan_codes_integers_and_large_tensors():
    for dtype, nan_codes in ((torch.float8_e4m3fn, (0x7F, 0xFF)), (torch.float8_e5m2, (0x7C, 0x7D, 0xFC, 0xFF)),
                             (torch.float8_e8m0fnu, (0xFF,))):
        values = torch.ones(64).to(dtype)
        assert finite(values)
        for code in nan_codes:
            broken = values.clone()
            broken.view(torch.uint8)[17] = code
            assert not finite(broken), (dtype, hex(code))
    assert finite(torch.arange(10)) and finite(torch.empty(0)) and finite(torch.tensor(2.0))
    large = torch.randn(3_000_000)  # more than one scratch of the bit test
    large[-1] = float("inf")
    assert not finite(large)


def test_span_and_bytes_of_a_box():
    x = torch.arange(4 * 5 * 6, dtype=torch.float32).view(4, 5, 6)
    flat = x.reshape(-1).view(torch.uint8).numpy()
    landed = Landed()
    assert span(((2, 3), (1, 4), (0, 6)), (4, 5, 6)) == (66, 84)
    assert span(((0, 4), (0, 5), (2, 3)), (4, 5, 6)) is None
    contiguous = 0
    for box in itertools.product(*[[(a, b) for a in range(n + 1) for b in range(a + 1, n + 1)] for n in x.shape]):
        view = x[tuple(slice(a, b) for a, b in box)]
        run = span(box, tuple(x.shape))
        if run is not None:
            contiguous += 1
            assert torch.equal(x.reshape(-1)[run[0]:run[1]], view.reshape(-1)), box
            got = landed.bytes(x, box, flat)
            assert np.shares_memory(got, flat)  # a slice of the buffer, no copy
        else:
            got = landed.bytes(x, box, flat)  # a copy into the scratch
        assert bytes(got) == view.contiguous().view(torch.uint8).numpy().tobytes(), box
    assert contiguous > 100
