"""Tiny real PEFT adapters for the synthetic base checkpoints.

Kinds (``ADAPTER_KINDS``):
- ``"dense"``: PEFT LoRA on the attention projections, the dense MLP / shared expert where the family
  has one, ``lm_head`` (``target_modules``), and the router weight (``target_parameters``:
  ``mlp.gate.weight``; gpt_oss ``mlp.router.weight``).
- ``"target_parameters"``: PEFT LoRA ``target_parameters`` on the 3D expert tensors
  ``<experts>.gate_up_proj`` / ``<experts>.down_proj`` (``FamilySpec.experts``: ``mlp.experts``, llama4 / jamba
  ``feed_forward.experts``, granitemoe ``block_sparse_moe.experts``) plus LoRA on the attention projections.
  PEFT stores ``lora_A`` [r·E, in] (rows expert-major) and ``lora_B`` [out, r·E] (columns rank-major).
- ``"legacy"``: what a PEFT adapter trained on a pre-fusion (transformers v4) model holds: per-expert
  keys ``base_model.model.model.layers.L.mlp.experts.N.{gate,up,down}_proj.lora_{A,B}.weight``
  (Mixtral ``block_sparse_moe.experts.N.w1/w3/w2``), plus attention and dense / shared-expert MLP
  projections of the family's expert leaf names (a v4 ``target_modules`` by leaf name hits those too:
  qwen2_moe shared expert, deepseek_v3 dense layer and shared experts). Written by hand (safetensors +
  ``LoraConfig.save_pretrained``) since the modules no longer exist in the fused model.

All LoRA factors are seeded random and non-zero (PEFT initialises ``lora_B`` to zero; it is
overwritten), different per module and per expert, std ``init_scale``. DoRA magnitudes are scaled by
``1 + init_scale·N``; ``modules_to_save`` copies and trainable token rows get ``init_scale·N`` added.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from sync_service.synthetic.families import FamilySpec, family_spec

ADAPTER_KINDS = ("dense", "target_parameters", "legacy")
NON_LORA_TYPES = ("ia3", "loha")
_PREFIX = "base_model.model."


def _default_targets(spec: FamilySpec, kind: str) -> tuple[list[str], list[str]]:
    """(target_modules, target_parameters) of ``kind`` for a family."""
    if kind == "dense":
        return [*spec.attention, *spec.dense_mlp, "lm_head"], [f"{spec.router}.weight"]
    if kind == "target_parameters":
        return list(spec.attention), [f"{spec.experts}.gate_up_proj", f"{spec.experts}.down_proj"]
    if kind == "legacy":
        assert spec.legacy_experts is not None
        leaves = dict.fromkeys([*spec.attention, *spec.legacy_experts[1]])
        return list(leaves), []
    raise ValueError(f"unknown adapter kind {kind!r}; use one of {ADAPTER_KINDS}")


@torch.no_grad()
def _randomize_adapter_(model: torch.nn.Module, *, seed: int, init_scale: float) -> int:
    """Overwrite trainable adapter state with seeded random values; returns how many tensors."""
    gen = torch.Generator().manual_seed(seed)
    count = 0
    for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        noise = torch.randn(param.shape, generator=gen, dtype=torch.float32) * init_scale
        if "lora_magnitude_vector" in name:
            param.mul_(1.0 + noise.to(param.dtype))
        elif "modules_to_save" in name or ".hada_" in name or "ia3_" in name or "trainable_tokens_delta" in name:
            param.add_(noise.to(param.dtype))
        elif any(part in name for part in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")):
            param.copy_(noise.to(param.dtype))
        else:
            continue
        count += 1
    return count


def _load_base(base_dir: Path):
    """The checkpoint in fp32, with the class its config names (``architectures``; a VL model is no causal LM)."""
    import transformers

    arch = json.loads((base_dir / "config.json").read_text()).get("architectures") or ["AutoModelForCausalLM"]
    return getattr(transformers, arch[0]).from_pretrained(str(base_dir), dtype=torch.float32)


def make_adapter(
    family: str,
    base_dir: str | Path,
    out_dir: str | Path,
    *,
    kind: str,
    r: int = 2,
    lora_alpha: float = 8,
    use_rslora: bool = False,
    rank_pattern: dict[str, int] | None = None,
    alpha_pattern: dict[str, float] | None = None,
    use_dora: bool = False,
    modules_to_save: Sequence[str] | None = None,
    target_modules: Sequence[str] | None = None,
    lora_bias: bool = False,
    save_embedding_layers: bool = False,
    trainable_token_indices: list[int] | dict[str, list[int]] | None = None,
    vocab_size: int | None = None,
    seed: int = 0,
    init_scale: float = 0.1,
) -> Path:
    """Write a PEFT LoRA adapter (``adapter_model.safetensors`` + ``adapter_config.json``) for the
    ``family`` checkpoint in ``base_dir`` to ``out_dir``; returns ``out_dir``.

    Args:
        kind: one of ``ADAPTER_KINDS`` (see the module docstring).
        r, lora_alpha, use_rslora, rank_pattern, alpha_pattern, use_dora, modules_to_save,
            lora_bias: as PEFT's ``LoraConfig``. Scaling s = lora_alpha / r (rsLoRA: / sqrt(r)).
        target_modules: replaces the kind's default ``target_modules`` (``target_parameters`` stay).
            With ``use_dora`` or ``lora_bias`` the router ``target_parameters`` of ``"dense"`` are
            dropped (PEFT has neither for parameter targets).
        save_embedding_layers: as PEFT's ``save_pretrained``; ``True`` also stores the (unchanged)
            ``lm_head`` / ``embed_tokens`` base weights when those are LoRA targets.
        trainable_token_indices: as PEFT's ``LoraConfig`` (saved rows get ``init_scale·N`` added).
        vocab_size: resize the base's embeddings to it before ``get_peft_model`` (``_load_resized``);
            save them with ``save_embedding_layers`` or ``modules_to_save``.
        seed, init_scale: factors are ``init_scale·N(0, 1)`` from a generator seeded with ``seed``.

    Raises:
        ValueError: unknown family or kind; ``"legacy"`` for a family whose experts are stored
            fused (gpt_oss), or with DoRA / modules_to_save / lora_bias (not written by hand).
    """
    spec = family_spec(family)
    base, out = Path(base_dir), Path(out_dir)
    if kind == "legacy":
        _check_legacy(spec, family, use_dora=use_dora, modules_to_save=modules_to_save, lora_bias=lora_bias)
    config = _lora_config(spec, kind, base, target_modules, r=r, lora_alpha=lora_alpha, use_rslora=use_rslora,
                          rank_pattern=dict(rank_pattern or {}), alpha_pattern=dict(alpha_pattern or {}),
                          use_dora=use_dora, modules_to_save=list(modules_to_save) if modules_to_save else None,
                          lora_bias=lora_bias, trainable_token_indices=trainable_token_indices)
    out.mkdir(parents=True, exist_ok=True)
    if kind == "legacy":
        _write_legacy(spec, base, out, config, seed=seed, init_scale=init_scale)
        return out
    from peft import get_peft_model

    peft_model = get_peft_model(_load_resized(base, vocab_size, seed), config)
    _randomize_adapter_(peft_model, seed=seed, init_scale=init_scale)
    peft_model.save_pretrained(str(out), save_embedding_layers=save_embedding_layers)
    return out


def _load_resized(base: Path, vocab_size: int | None, seed: int):
    """``_load_base``, with ``resize_token_embeddings(vocab_size)`` when given: the new rows from the model's
    own init (``mean_resizing=False``), reproducible from ``seed``, the caller's RNG untouched."""
    model = _load_base(base)
    if vocab_size is not None:
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model.resize_token_embeddings(vocab_size, mean_resizing=False)
    return model


def _check_legacy(spec: FamilySpec, family: str, *, use_dora: bool, modules_to_save, lora_bias: bool) -> None:
    """Raises ValueError unless ``family`` has per-expert keys on disk and no option the hand-written
    legacy layout lacks is asked for."""
    if spec.legacy_experts is None:
        raise ValueError(f"{family} stores experts fused on disk; no per-expert (legacy) adapter layout exists")
    if use_dora or modules_to_save or lora_bias:
        raise ValueError("legacy adapters are written by hand without DoRA, modules_to_save or lora_bias")


def _lora_config(spec: FamilySpec, kind: str, base: Path, target_modules: Sequence[str] | None, **lora):
    """PEFT ``LoraConfig`` of ``kind`` for a family: its default targets (``target_modules`` replaces the
    modules), the ``lora`` options (``r``, ``lora_alpha``, ``use_dora``, ...) as ``LoraConfig`` takes them."""
    from peft import LoraConfig

    default_modules, target_parameters = _default_targets(spec, kind)
    modules = list(target_modules) if target_modules is not None else default_modules
    if (lora["use_dora"] or lora["lora_bias"]) and kind == "dense":
        target_parameters = []
    return LoraConfig(target_modules=modules, target_parameters=target_parameters or None, task_type="CAUSAL_LM",
                      base_model_name_or_path=str(base), **lora)


def base_tensor_shapes(base_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """On-disk tensor name → shape of a safetensors checkpoint (single file or sharded with index)."""
    from safetensors import safe_open

    base = Path(base_dir)
    index = base / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    shapes: dict[str, tuple[int, ...]] = {}
    for fname in files:
        with safe_open(str(base / fname), "pt") as f:
            for key in f.keys():
                shapes[key] = tuple(f.get_slice(key).get_shape())
    return shapes


def _write_legacy(spec: FamilySpec, base: Path, out: Path, config, *, seed: int, init_scale: float) -> None:
    """Per-expert (pre-fusion) LoRA factors for every on-disk 2D ``<module>.weight`` whose leaf name is
    in ``config.target_modules``, ranks / alphas resolved with PEFT's own pattern rule."""
    from peft.utils.other import get_pattern_key
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    leaves = set(config.target_modules)
    tensors: dict[str, torch.Tensor] = {}
    for key, shape in sorted(base_tensor_shapes(base).items()):
        module, _, leaf = key.removesuffix(".weight").rpartition(".")
        if not key.endswith(".weight") or leaf not in leaves or len(shape) != 2:
            continue
        module = f"{module}.{leaf}"
        rank = config.rank_pattern.get(get_pattern_key(config.rank_pattern.keys(), module), config.r)
        out_features, in_features = shape
        tensors[f"{_PREFIX}{module}.lora_A.weight"] = torch.randn(rank, in_features, generator=gen) * init_scale
        tensors[f"{_PREFIX}{module}.lora_B.weight"] = torch.randn(out_features, rank, generator=gen) * init_scale
    if not tensors:
        raise ValueError(f"no on-disk tensor of {base} matches target_modules={sorted(leaves)}")
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(out))


def make_non_lora_adapter(
    family: str, base_dir: str | Path, out_dir: str | Path, *, peft_type: str, seed: int = 0
) -> Path:
    """A PEFT adapter of a non-LoRA type (``"ia3"`` or ``"loha"``) on the attention projections,
    randomised, saved with ``save_pretrained``; for testing that a LoRA-only consumer rejects it.

    Raises:
        ValueError: unknown family or ``peft_type``.
    """
    from peft import IA3Config, LoHaConfig, get_peft_model

    spec = family_spec(family)
    attention = list(spec.attention)
    configs = {
        "ia3": lambda: IA3Config(target_modules=attention, feedforward_modules=[], task_type="CAUSAL_LM"),
        "loha": lambda: LoHaConfig(r=2, alpha=4, target_modules=attention, task_type="CAUSAL_LM"),
    }
    if peft_type not in configs:
        raise ValueError(f"unknown peft_type {peft_type!r}; use one of {NON_LORA_TYPES}")
    peft_model = get_peft_model(_load_base(Path(base_dir)), configs[peft_type]())
    _randomize_adapter_(peft_model, seed=seed, init_scale=0.1)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    peft_model.save_pretrained(str(out))
    return out
