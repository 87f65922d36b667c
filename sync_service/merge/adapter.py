"""Reading a PEFT LoRA adapter into low-rank terms in hf-fused coordinates (``terms.py``).

Every adapter format (dense PEFT LoRA, ``target_parameters`` on 3D experts, legacy per-expert LoRA, embeddings) reduces
to these terms, so the merge kernel (``source.py``) knows nothing of PEFT.

Sources: LoRA ΔW = (α/r)·B@A (Hu et al. 2021, arXiv:2106.09685); rsLoRA s = α/√r (Kalajdzievski
2023, arXiv:2312.03732); DoRA W' = m/‖W+ΔW‖_row · (W+ΔW) (Liu et al. 2024, arXiv:2402.09353; PEFT
``tuners/lora/dora.py``); key and packing rules from PEFT 0.21 (``tuners/lora/layer.py`` ParamWrapper).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace

import torch

from protocols.params import ParamMeta
from sync_service.merge.adapter_contract import check_config, check_config_keys
from sync_service.merge.adapter_keys import normalise
from sync_service.merge.errors import MergeError
from sync_service.merge.inputs import check_adapter_config, read_json_object, read_safetensors
from sync_service.merge.layouts import FamilyLayout
from sync_service.merge.terms import LoraAdapter
from sync_service.merge.vocab import check_vocabulary


def adapter_from_state_dict(
    peft_config,
    state_dict: Mapping[str, torch.Tensor],
    layout: FamilyLayout,
    base_metas: Sequence[ParamMeta],
    *,
    tied_aliases: Mapping[str, str] | None = None,
) -> LoraAdapter:
    """Normalise a PEFT LoRA state dict (as ``peft.get_peft_model_state_dict(model)`` returns it,
    or as ``adapter_model.safetensors`` holds it) against the base tensors ``base_metas``.

    Dense factors already in fp32 are referenced, not copied; packed expert factors are re-laid
    out per expert (a copy). Call ``snapshot()`` to detach from a live trainer.

    Raises:
        MergeError: non-LoRA adapter type, a config field the contract refuses
            (``adapter_contract.check_config``: lora_bias, aLoRA, layer_replication, a base-shifting
            init without conversion, ...), a key matching no base tensor, a shape or rank mismatch, a
            DoRA magnitude without use_dora, DoRA where PEFT has no DoRA (3D experts, embeddings), a
            vocabulary resized before training (``vocab.check_vocabulary``; ``weightsync merge`` passes
            ``base_metas`` already resized, ``vocab.plan_resize``).
    """
    tied = dict(tied_aliases or {})
    check_vocabulary({k: tuple(t.shape) for k, t in state_dict.items()}, base_metas, layout, tied)
    return normalise(peft_config, state_dict, layout, base_metas, tied)


def load_adapter(
    adapter_dir: str | Path,
    layout: FamilyLayout,
    base_metas: Sequence[ParamMeta],
    *,
    tied_aliases: Mapping[str, str] | None = None,
) -> LoraAdapter:
    """Read a PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``).

    Raises:
        MergeError: missing files, a pickled ``adapter_model.bin`` (never unpickled: convert it to
            safetensors), a corrupt or empty file, a key that is no field of PEFT's LoraConfig, a bad
            adapter_config field value, or anything ``adapter_from_state_dict`` rejects.
    """
    from peft import PeftConfig
    from safetensors.torch import load_file

    adapter_dir = Path(adapter_dir)
    config_path = adapter_dir / "adapter_config.json"
    if not config_path.is_file():
        raise MergeError(f"{adapter_dir}: no adapter_config.json; pass a directory written by PeftModel.save_pretrained")
    raw_config = read_json_object(config_path)
    peft_type = raw_config.get("peft_type")
    if peft_type != "LORA":
        raise MergeError(
            f"{config_path}: peft_type {peft_type!r} is not a LoRA adapter; only LoRA (incl. rsLoRA, DoRA) "
            f"adapters merge additively — merge it with PEFT's merge_and_unload instead"
        )
    check_config_keys(config_path, raw_config)
    check_adapter_config(config_path, raw_config)
    try:
        check_config(SimpleNamespace(**raw_config))  # before PEFT parses it: loftq etc. fail there otherwise
        peft_config = PeftConfig.from_pretrained(str(adapter_dir))
    except MergeError as exc:
        raise MergeError(f"{config_path}: {exc}") from None
    except (ValueError, TypeError, ImportError) as exc:
        raise MergeError(f"{config_path}: PEFT cannot read it ({exc}); fix the adapter_config") from None
    weights = adapter_dir / "adapter_model.safetensors"
    if not weights.is_file():
        hint = " (adapter_model.bin is pickled and is never loaded here)" if (adapter_dir / "adapter_model.bin").exists() else ""
        raise MergeError(f"{adapter_dir}: no adapter_model.safetensors{hint}; save the adapter with safe_serialization=True")
    state_dict = read_safetensors(weights, load_file)
    try:  # first: an empty file whose config selects nothing in the base is named for that
        adapter = adapter_from_state_dict(peft_config, state_dict, layout, base_metas, tied_aliases=tied_aliases)
    except MergeError as exc:
        raise MergeError(f"{adapter_dir}: {exc}") from None
    if not state_dict:
        raise MergeError(f"{weights}: holds no tensors, so there is nothing to merge; save the trained adapter "
                         f"again (PeftModel.save_pretrained) or sync without --adapter")
    return adapter
