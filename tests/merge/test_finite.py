"""``all_finite`` agrees with ``torch.isfinite(t).all()`` across dtypes, shapes and positions."""

from __future__ import annotations

import pytest
import torch

from sync_service.merge.finite import all_finite


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.float8_e5m2])
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", [0, 7, -1])
def test_agrees_with_isfinite(dtype, bad, where):
    t = torch.linspace(-3, 3, 40).reshape(5, 8).to(dtype)
    if bad is not None:
        t.view(-1)[where] = bad
    view = t.t()  # non-contiguous
    assert all_finite(view) == bool(torch.isfinite(view.float()).all()) == (bad is None)


def test_empty_is_finite():
    assert all_finite(torch.empty(0, 3))
