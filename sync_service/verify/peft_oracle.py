"""The independent oracle: PEFT's own ``merge_and_unload`` of an adapter, in float64, cast once.

Nothing of weightsync's merge runs here: transformers loads the base checkpoint in float64, PEFT
applies the adapter (``PeftModel.from_pretrained``) and merges it (``merge_and_unload``), and every
parameter is cast once to the dtype the engines serve (the base's ``config.json`` dtype, or the engine's own
where it holds a tensor in another: ``peft_merged_state(..., dtypes=)``). What
``weightsync sync`` and ``weightsync demo`` call "verified" is equality with this model, so a merge
rule weightsync gets wrong (a tying, an orientation, a scaling) cannot verify itself.

Names are the transformers v5 in-memory ("hf-fused") parameter names, as the HF engine reports them;
tied parameters appear once (``named_parameters``), and a pair PEFT unties (modules_to_save on a tied
embedding) appears twice. Memory: the whole model in float64 (8 bytes per parameter) for the call.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from protocols.params import FLOAT_DTYPES
from sync_service.engines.hf import load_causal_lm
from sync_service.merge.export import COPIED_FILES

__all__ = ["StateCheck", "cast_", "checkpoint_state", "compare_state", "engine_dtype", "model_state", "peft_merged_model",
           "peft_merged_state", "plain_float64", "save_peft_merged", "values_match"]


def _serving_dtype(base_dir: Path) -> torch.dtype:
    """The dtype ``from_pretrained`` gives the base by default (``config.json`` ``dtype``; float32 if unset)."""
    from transformers import AutoConfig

    dtype = getattr(AutoConfig.from_pretrained(str(base_dir)), "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def peft_merged_model(base_dir: str | Path, adapter_dir: str | Path | None, *,
                      dtype: torch.dtype | None = None) -> torch.nn.Module:
    """The base with the adapter merged by PEFT in float64, then cast once to ``dtype`` (default: the serving
    dtype, the base's; pass the engines' dtype when they serve another one, ``torch.float64`` for no cast).

    ``adapter_dir=None``: the base itself (loaded in float64 and cast back: its exact values). A block-FP8 base
    is loaded with ``FineGrainedFP8Config(dequantize=True)`` (transformers' ``Fp8Dequantize``, fp8 × scale in
    float32), on any host, and copied into a plain float64 model (``plain_float64``): the merge is over the
    dequantized values, never the FP8 ones. The cast is ``cast_``'s: the rotary ``inv_freq`` stays in float32, as
    ``from_pretrained(dtype=...)`` loads it for an engine.
    Eval mode. Raises what transformers / PEFT raise for a base or adapter they cannot load.
    """
    base_dir = Path(base_dir)
    dequantize = _dequantize_config(base_dir)
    model = load_causal_lm(base_dir, dtype=torch.float64,  # the class the checkpoint names (a VL MoE is no causal LM)
                           quantization_config=dequantize)
    if dequantize is not None:
        model = plain_float64(model)
    if adapter_dir is not None:
        from peft import PeftModel

        _resize_to_adapter(model, Path(adapter_dir))
        model = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    return cast_(model, dtype or _serving_dtype(base_dir)).train(False)


def cast_(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``model`` (loaded by ``from_pretrained`` in float64) cast in place to ``dtype`` as ``from_pretrained(dtype=
    dtype)`` would hold it: parameters and floating buffers cast, except the non-persistent float32 buffers, which
    transformers computes in float32 whatever the load dtype (the rotary ``inv_freq`` / ``original_inv_freq``; a
    buffer made in the load's default dtype is float64 here, and is cast), which keep their values. A plain ``model.to(dtype)``
    rounds ``inv_freq`` to bfloat16, and then the oracle's forward is not the engine's: at an exact top-2 tie of
    bitwise-equal weights its greedy token differs. Returns ``model``."""
    kept = [(m, n, b) for m in model.modules() for n, b in m._buffers.items()
            if n in m._non_persistent_buffers_set and b is not None and b.dtype == torch.float32]
    model.to(dtype)
    for m, n, b in kept:
        m._buffers[n] = b
    return model


def _dequantize_config(base_dir: Path):
    """``FineGrainedFP8Config(dequantize=True)`` with a block-FP8 base's block and scale format; ``None`` for any
    other base. Explicit because transformers dequantizes a pre-quantized FP8 model by itself only without a GPU."""
    import json

    config = base_dir / "config.json"
    quant = (json.loads(config.read_text()).get("quantization_config") if config.is_file() else None) or {}
    if not isinstance(quant, dict) or quant.get("quant_method") != "fp8":
        return None
    from transformers import FineGrainedFP8Config

    return FineGrainedFP8Config(weight_block_size=quant.get("weight_block_size"), scale_fmt=quant.get("scale_fmt") or "float",
                                dequantize=True)


def plain_float64(model: torch.nn.Module) -> torch.nn.Module:
    """A new model of ``model``'s class and config holding its values in float64, without its quantizer. A model
    transformers loaded from an FP8 checkpoint with ``dequantize=True`` keeps the tensors it did not quantize in
    bfloat16 whatever the load dtype (PEFT then merges their LoRA in float32, not float64), and cannot be
    saved with ``save_pretrained``; the copy has neither problem. Its non-persistent buffers (rotary ``inv_freq``)
    are ``model``'s, in their dtypes (float32 where transformers computes them so: ``cast_``)."""
    plain = type(model)(model.config).to(torch.float64)
    plain.load_state_dict(model.state_dict(), strict=True)
    source = dict(model.named_modules())
    for name, module in plain.named_modules():
        for buffer in module._non_persistent_buffers_set:
            if module._buffers.get(buffer) is not None:
                module._buffers[buffer] = source[name]._buffers[buffer]
    return plain.train(False)


def _resize_to_adapter(model: torch.nn.Module, adapter_dir: Path) -> None:
    """PEFT's documented flow for an adapter trained on a grown vocabulary ("Fine-tuning with new
    tokens"): ``model.resize_token_embeddings(V')`` on the base, then load the adapter. V' is the row
    count of the adapter's saved input (or output) embedding (``save_embedding_layers=True`` /
    ``modules_to_save``), found by the module names transformers reports; no resize when it has none
    or it already fits. The new rows are then overwritten by the adapter's copy when PEFT loads it."""
    from safetensors import safe_open

    weights = adapter_dir / "adapter_model.safetensors"
    if not weights.is_file():
        return
    modules = [m for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None]
    names = {f"{n}.weight" for n, m in model.named_modules() if any(m is e for e in modules)}
    with safe_open(str(weights), "pt") as f:
        rows = {f.get_slice(k).get_shape()[0] for k in f.keys()
                if k.removeprefix("base_model.model.").replace(".base_layer.", ".") in names}
    current = model.get_input_embeddings().weight.shape[0]
    if len(rows) == 1 and rows != {current}:
        model.resize_token_embeddings(rows.pop(), mean_resizing=False)


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What an engine built on ``model`` serves: ``named_parameters`` plus the persistent buffers
    ``state_dict`` saves that alias no parameter (e.g. DeepSeek's ``mlp.gate.e_score_correction_bias``),
    the rule of ``engines.hf.HFEngine``'s table. Name → detached tensor (no copy)."""
    state = {n: p.detach() for n, p in model.named_parameters()}
    held = {t.data_ptr() for t in state.values()}  # a tied name aliases a parameter's storage
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name not in state and tensor.data_ptr() not in held:
            state[name] = tensor.detach()
    return state


def peft_merged_state(base_dir: str | Path, adapter_dir: str | Path | None, *,
                      dtypes: Mapping[str, str | torch.dtype] | None = None) -> dict[str, torch.Tensor]:
    """``model_state`` of ``peft_merged_model``: name → tensor in the serving dtype, or with ``dtypes`` (name →
    the dtype an engine serves it in, e.g. ``{m.name: m.dtype for m in engine.param_metas()}``) each floating
    tensor cast once from PEFT's float64 merge into its engine's dtype (names ``dtypes`` lacks: the serving
    dtype). An engine in another dtype than the trainers' base is judged against this, never against the
    base-dtype oracle cast again (two roundings)."""
    if dtypes is None:
        return model_state(peft_merged_model(base_dir, adapter_dir))
    serving = _serving_dtype(Path(base_dir))
    merged = model_state(peft_merged_model(base_dir, adapter_dir, dtype=torch.float64))
    return {n: t.to(_as_dtype(dtypes.get(n, serving))) if t.is_floating_point() else t for n, t in merged.items()}


def engine_dtype(table) -> torch.dtype | None:
    """The one floating dtype of an engine's parameter table (``ParamMeta``s), ``None`` when it holds several."""
    floats = {m.dtype for m in table if m.dtype in FLOAT_DTYPES}
    return _as_dtype(floats.pop()) if len(floats) == 1 else None


def _as_dtype(dtype: str | torch.dtype) -> torch.dtype:
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def checkpoint_state(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors checkpoint in hf-fused naming (``SafetensorsBase``: per-expert
    keys assembled into fused tensors), e.g. a ``weightsync merge`` output, for ``compare_state``."""
    from protocols.params import full_box
    from sync_service.merge.base import SafetensorsBase

    checkpoint = SafetensorsBase(model_dir)
    return {m.name: checkpoint.read(m.name, full_box(m.shape)) for m in checkpoint.metas()}


def save_peft_merged(base_dir: str | Path, adapter_dir: str | Path | None, out_dir: str | Path, *,
                     dtype: torch.dtype | None = None) -> Path:
    """``peft_merged_model`` (cast once to ``dtype``, default the base's) written with ``save_pretrained``
    (safetensors), plus the base's tokenizer and generation files, so an engine can start from it.
    Returns ``out_dir``."""
    base_dir, out_dir = Path(base_dir), Path(out_dir)
    peft_merged_model(base_dir, adapter_dir, dtype=dtype).save_pretrained(str(out_dir))
    for name in COPIED_FILES:
        if (base_dir / name).is_file() and not (out_dir / name).exists():
            shutil.copy2(base_dir / name, out_dir / name)
    return out_dir


def values_match(served: torch.Tensor, oracle: torch.Tensor, *, extra_atol: float = 0.0) -> tuple[bool, float]:
    """Whether served values equal the oracle's up to the rounding of an fp32-accumulated merge.

    Both tensors in the serving dtype, same shape. Allowed per element: ``8·eps32·(|oracle| +
    max|oracle|)`` (fp32 accumulation of W + s·B@A rounds relative to the terms, not to their sum),
    plus, for narrow dtypes (bf16, fp16), one unit in the last place of the oracle value (rounding
    from fp32 and from float64 may land on adjacent representables), plus ``extra_atol``. A merge
    rule gone wrong (orientation, scaling, a missing term) misses by orders of magnitude more.
    Returns ``(ok, max |Δ|)`` with ``max |Δ|`` in float64.
    """
    if served.shape != oracle.shape or served.dtype != oracle.dtype:
        return False, float("inf")
    diff = (served.double() - oracle.double()).abs()
    max_diff = float(diff.max()) if diff.numel() else 0.0
    if not served.is_floating_point():
        return bool(torch.equal(served, oracle)), max_diff
    scale = oracle.double().abs()
    bound = 8 * torch.finfo(torch.float32).eps * (scale + (scale.max() if scale.numel() else 0.0)) + extra_atol
    if torch.finfo(served.dtype).bits <= 16:
        bound = bound + _ulp(oracle)
    return bool((diff <= bound).all()), max_diff


def _ulp(values: torch.Tensor) -> torch.Tensor:
    """The spacing of representables just above ``|values|`` in their dtype, as float64 (normal range)."""
    finfo = torch.finfo(values.dtype)
    _, exponent = torch.frexp(values.double())  # |v| = m·2^e, m in [0.5, 1)
    ulp = torch.ldexp(torch.full_like(values, finfo.eps, dtype=torch.float64), exponent - 1)
    return torch.where(values == 0, torch.full_like(ulp, finfo.tiny), ulp)


@dataclass(frozen=True, slots=True)
class StateCheck:
    """An engine's served parameters against the oracle's.

    Attributes:
        ok: same names, and every tensor ``values_match`` the oracle's.
        max_abs_diff: largest ``|served − oracle|`` over the common names (float64; ``inf`` for a
            shape/dtype mismatch).
        mismatched: names that differ, are missing on the engine or unexpected there (sorted).
    """

    ok: bool
    max_abs_diff: float
    mismatched: tuple[str, ...]


def compare_state(served: Mapping[str, Any], oracle: Mapping[str, torch.Tensor], *, extra_atol: float = 0.0) -> StateCheck:
    """``served`` (name → tensor or numpy array, e.g. ``RolloutEngine.state()``; bf16 may come widened to
    fp32) against ``oracle`` (``peft_merged_state``): each served tensor is taken in the oracle's dtype."""
    bad = set(served) ^ set(oracle)
    worst = 0.0
    for name in set(served) & set(oracle):
        want = oracle[name]
        got = served[name] if torch.is_tensor(served[name]) else torch.from_numpy(np.array(served[name]))
        ok, diff = values_match(got.to(want.dtype) if got.shape == want.shape else got, want, extra_atol=extra_atol)
        worst = max(worst, diff)
        if not ok:
            bad.add(name)
    return StateCheck(ok=not bad, max_abs_diff=worst, mismatched=tuple(sorted(bad)))
