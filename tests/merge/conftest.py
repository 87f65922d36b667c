"""Oracles and comparisons for the merge-core tests.

Two oracles, both computing in float64 and casting once to the base dtype:
- ``peft_oracle``: transformers loads the base in float64, PEFT applies the adapter
  (``PeftModel.from_pretrained``), ``merge_and_unload()``; the result is written with
  ``save_pretrained`` and read back, so names are exactly what ``save_pretrained`` writes ("hf").
- ``hand_oracle``: W' = W + s·B@A per adapter module whose ``<module>.weight`` is an on-disk base
  tensor (dense modules, legacy per-expert keys). Needed for legacy adapters: PEFT 0.21 loads a
  per-expert adapter onto a fused model by concatenating A and block-diagonalising B with rank 2r
  and alpha 2α, which keeps α/r but not rsLoRA's α/√r, and it does not remap legacy keys of every
  family (qwen2_moe); so PEFT cannot be the oracle there. Ranks and alphas are resolved with
  PEFT's own pattern rule (``peft.utils.other.get_pattern_key``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sync_service.synthetic import make_base

_ADAPTER_PREFIX = "base_model.model."


def read_checkpoint(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors checkpoint directory (single file or shards)."""
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        part = load_file(str(file))
        assert not (part.keys() & tensors.keys()), f"duplicate keys across shards in {model_dir}"
        tensors.update(part)
    assert tensors, f"no safetensors in {model_dir}"
    return tensors


def base_dtype(base_dir: str | Path) -> torch.dtype:
    config = json.loads((Path(base_dir) / "config.json").read_text())
    return getattr(torch, config.get("dtype") or config["torch_dtype"])


def peft_merged_model(base_dir: str | Path, adapter_dir: str | Path):
    """The base in float64 with the adapter merged by PEFT (``merge_and_unload``), still float64."""
    import transformers
    from peft import PeftModel

    arch = json.loads((Path(base_dir) / "config.json").read_text()).get("architectures") or ["AutoModelForCausalLM"]
    model = getattr(transformers, arch[0]).from_pretrained(str(base_dir), dtype=torch.float64)
    peft_model = PeftModel.from_pretrained(model, str(adapter_dir))
    # modules transformers keeps in fp32 whatever the load dtype (ernie4_5_moe's router) merge in fp32 in PEFT too
    fp32_kept = tuple(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    lora_dtypes = {p.dtype for n, p in peft_model.named_parameters()
                   if "lora_" in n and not (n.split(".lora_")[0] + ".weight").endswith(fp32_kept)}
    assert lora_dtypes <= {torch.float64}, f"PEFT kept adapter params in {lora_dtypes}: oracle not float64"
    return peft_model.merge_and_unload()


def peft_oracle(base_dir: str | Path, adapter_dir: str | Path, tmp_dir: Path) -> dict[str, torch.Tensor]:
    """PEFT-merged weights in the base dtype, named as ``save_pretrained`` writes them."""
    merged = peft_merged_model(base_dir, adapter_dir).to(base_dtype(base_dir))
    merged.save_pretrained(str(tmp_dir))
    return read_checkpoint(tmp_dir)


def hand_oracle(base_dir: str | Path, adapter_dir: str | Path) -> dict[str, torch.Tensor]:
    """W + s·B@A in float64, cast once, for adapters whose modules are on-disk base names."""
    from peft.utils.other import get_pattern_key

    base = read_checkpoint(base_dir)
    config = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    adapter = load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    out = dict(base)
    for key in adapter:
        if not key.endswith(".lora_A.weight"):
            continue
        module = key.removeprefix(_ADAPTER_PREFIX).removesuffix(".lora_A.weight")
        a = adapter[key].double()
        b = adapter[f"{_ADAPTER_PREFIX}{module}.lora_B.weight"].double()
        r = rank_pattern.get(get_pattern_key(rank_pattern.keys(), module), config["r"])
        alpha = alpha_pattern.get(get_pattern_key(alpha_pattern.keys(), module), config["lora_alpha"])
        assert a.shape[0] == r, (module, a.shape, r)
        scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        w = base[f"{module}.weight"]
        out[f"{module}.weight"] = (w.double() + scaling * (b @ a)).to(w.dtype)
    return out


def _bf16_bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16).to(torch.int32)


def assert_matches(
    got: dict[str, torch.Tensor],
    want: dict[str, torch.Tensor],
    *,
    base: dict[str, torch.Tensor] | None = None,
    rtol: float = 1e-5,
    atol: float = 1e-7,
    min_bitwise_equal: float = 0.99,
    bf16_atol: float = 2.0**-20,
) -> None:
    """Same key set; every tensor same shape and dtype; values within tolerance.

    float32: ``allclose(rtol, atol)``. bfloat16: every element within one bf16 ulp (adjacent bit
    patterns) or ``bf16_atol`` (a merged value near zero after cancellation: fp32 accumulation of O(0.1)
    terms is off by ~1e-8 there, more than the ulp of a tiny result), and at least ``min_bitwise_equal`` of the elements of the tensors the adapter changed
    (those differing from ``base`` when given, else all) bitwise equal.
    """
    missing, unexpected = sorted(want.keys() - got.keys()), sorted(got.keys() - want.keys())
    assert not missing and not unexpected, f"missing {missing[:8]} unexpected {unexpected[:8]}"
    equal = total = 0
    for name, w in want.items():
        g = got[name]
        assert g.shape == w.shape and g.dtype == w.dtype, f"{name}: got {g.dtype}{list(g.shape)}, want {w.dtype}{list(w.shape)}"
        if w.dtype == torch.bfloat16:
            gb, wb = _bf16_bits(g), _bf16_bits(w)
            close = ((gb - wb).abs() <= 1) | ((g.float() - w.float()).abs() <= bf16_atol)
            assert bool(close.all()), f"{name}: {int((~close).sum())} elements more than 1 bf16 ulp off"
            if base is None or not torch.equal(base[name], w):
                equal += int((gb == wb).sum())
                total += w.numel()
        else:
            torch.testing.assert_close(g, w, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
    if total:
        assert equal / total >= min_bitwise_equal, f"only {equal}/{total} bf16 elements bitwise equal"


@pytest.fixture(scope="session")
def base_factory(tmp_path_factory):
    """``base_factory(family, dtype, **sizes) -> Path``: a synthetic base, built once per session."""
    cache: dict[tuple, Path] = {}

    def build(family: str, dtype: str = "float32", **kwargs) -> Path:
        key = (family, dtype, tuple(sorted(kwargs.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"base-{family}-{dtype}")
            cache[key] = make_base(family, out, dtype=dtype, **kwargs)
        return cache[key]

    return build
