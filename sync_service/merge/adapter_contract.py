"""The adapter contract: what each field of PEFT's ``LoraConfig`` means to a merge, as one table.

Every field of the installed PEFT's ``LoraConfig`` (``dataclasses.fields``) has one row in ``FIELDS``
(``tests/merge/test_adapter_contract.py`` fails when PEFT adds a field the table does not name). A row's
``kind`` says what weightsync does with the field:

- ``metadata``: describes the adapter (names, versions, task); no effect on the weights.
- ``training``: changes only how the adapter trains (dropout, a custom backward); merged as the tensors say.
- ``selects``: chooses which modules carry LoRA / trained copies; merged as the file's tensors say.
- ``init``: chooses the initial values; merged as the tensors say — except the initialisations under
  which PEFT shifts the *base* weights when it loads the adapter (``BASE_SHIFTING_INITS``), refused.
- ``merged``: part of the merge formula, merged exactly as PEFT merges it (``adapter_keys.py``).
- ``refused``: accepted only at PEFT's default; any other value is refused naming the field and the fix.

Sources: PEFT 0.21 ``tuners/lora/config.py`` (field meanings), ``tuners/lora/layer.py`` ``update_layer``
(which initialisations write the base weight: PiSSA, CorDA, OLoRA, LoftQ, LoRA-GA, KaSA),
``peft_model.py`` ``save_pretrained(path_initial_model_for_weight_conversion=...)`` (the conversion that
turns a base-shifting adapter into a plain LoRA of rank 2r with ``init_lora_weights=True``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from sync_service.merge.errors import MergeError

__all__ = ["BASE_SHIFTING_INITS", "FIELDS", "Field", "check_config", "check_config_keys"]

_CONVERT = ("save the adapter with PEFT's save_pretrained(..., path_initial_model_for_weight_conversion=<the "
            "initial adapter's directory>), which writes the equivalent plain LoRA (rank 2r, init_lora_weights=true)")


@dataclass(frozen=True, slots=True)
class Field:
    """One row of the contract: ``kind`` (see the module docstring) and, for ``refused``, the fix."""

    kind: str
    why: str


FIELDS: dict[str, Field] = {
    # metadata
    "task_type": Field("metadata", "the head the adapter was trained for"),
    "peft_type": Field("metadata", "checked to be LORA by the reader"),
    "auto_mapping": Field("metadata", "the base class PEFT recorded"),
    "peft_version": Field("metadata", "the PEFT that wrote the file"),
    "base_model_name_or_path": Field("metadata", "where the base came from (the user passes the base)"),
    "revision": Field("metadata", "the base's hub revision"),
    "inference_mode": Field("metadata", "set true by save_pretrained"),
    "runtime_config": Field("metadata", "runtime options, never saved"),
    "megatron_core": Field("metadata", "the module megatron_config names; read only with megatron_config"),
    # training only
    "lora_dropout": Field("training", "dropout on the LoRA input while training"),
    "velora_config": Field("training", "VeLoRA: a compressed backward pass; the forward and merge are LoRA's"),
    # module selection
    "target_modules": Field("selects", "the modules with LoRA factors"),
    "exclude_modules": Field("selects", "modules kept out of target_modules"),
    "layers_to_transform": Field("selects", "the layer indices with LoRA factors"),
    "layers_pattern": Field("selects", "the layer-list name for layers_to_transform"),
    "target_parameters": Field("selects", "the parameters (3D experts) with LoRA factors"),
    "modules_to_save": Field("selects", "trained copies that replace their base tensor"),
    "bias": Field("selects", "trained biases, saved as tensors that replace the base's"),
    # initialisation
    "init_lora_weights": Field("init", "initial values; base-shifting ones refused (BASE_SHIFTING_INITS)"),
    "loftq_config": Field("init", "LoftQ's options; init_lora_weights='loftq' is refused"),
    "eva_config": Field("init", "EVA's options (initialises A only; the base is unchanged)"),
    "corda_config": Field("init", "CorDA's options; init_lora_weights='corda' needs the conversion"),
    "lora_ga_config": Field("init", "LoRA-GA's options; init_lora_weights='lora_ga' needs the conversion"),
    # the merge formula
    "r": Field("merged", "rank; s = lora_alpha / r"),
    "lora_alpha": Field("merged", "scaling numerator"),
    "use_rslora": Field("merged", "s = lora_alpha / sqrt(r)"),
    "rank_pattern": Field("merged", "per-module r"),
    "alpha_pattern": Field("merged", "per-module lora_alpha"),
    "use_dora": Field("merged", "DoRA: W' = m / ||W + dW||_row * (W + dW)"),
    "fan_in_fan_out": Field("merged", "ignored on nn.Linear as PEFT ignores it; refused on target_parameters"),
    "trainable_token_indices": Field("merged", "rows of the embedding replaced by the saved ones"),
    "ensure_weight_tying": Field("merged", "keeps tied copies tied; refused where it touches a tied tensor"),
    # refused unless at PEFT's default
    "lora_bias": Field("refused", "a bias on lora_B is not merged here; retrain with lora_bias=false"),
    "megatron_config": Field("refused", "Megatron-parallel LoRA layers are not read; export the adapter from "
                                        "the unsharded PEFT model"),
    "alora_invocation_tokens": Field("refused", "aLoRA applies the adapter only after its invocation tokens, so "
                                                "PEFT cannot merge it either; serve it unmerged as an aLoRA adapter"),
    "use_qalora": Field("refused", "QA-LoRA pools the input in groups (GPTQ bases); merge it with PEFT"),
    "qalora_group_size": Field("refused", "read only with use_qalora; remove it or set it to PEFT's default"),
    "monteclora_config": Field("refused", "MonteCLoRA samples its factors; merge it with PEFT"),
    "layer_replication": Field("refused", "PEFT stacks replicated layers, so the merged model has another "
                                          "layer count than the base; merge with PEFT and sync that checkpoint "
                                          "as the base"),
    "use_bdlora": Field("refused", "BD-LoRA's block-diagonal factors are not read; merge it with PEFT"),
    "arrow_config": Field("refused", "Arrow routes between several adapters per token; no single merge exists"),
    "kasa_config": Field("refused", "KaSA truncates the base's singular values and adds a learned diagonal; "
                                    "merge it with PEFT"),
}

# init_lora_weights values (a prefix of the string) under which PEFT's loader writes the base weight
# (tuners/lora/layer.py update_layer), with what to do instead.
BASE_SHIFTING_INITS: dict[str, str] = {
    "pissa": _CONVERT,
    "corda": _CONVERT,
    "olora": _CONVERT,
    "lora_ga": _CONVERT,
    "loftq": "LoftQ replaces the base with its quantized residual; merge it with PEFT onto that base",
}


def _defaults() -> dict[str, object]:
    from peft import LoraConfig

    return {f.name: getattr(LoraConfig(), f.name) for f in dataclasses.fields(LoraConfig)}


def _at_default(value, default) -> bool:
    if value == default:
        return True
    return not value and not default  # None, {}, [], False: PEFT treats them alike


def check_config_keys(path: Path, raw: dict) -> None:
    """Every key of an ``adapter_config.json`` must be a field of the installed PEFT's ``LoraConfig``.

    Raises:
        MergeError: naming the first unknown key (a newer PEFT's field, a typo, another method's key).
    """
    unknown = sorted(k for k in raw if k not in FIELDS)
    if unknown:
        import peft

        raise MergeError(
            f"{path}: key {unknown[0]!r} is not a field of PEFT {peft.__version__}'s LoraConfig"
            f"{f' (and {len(unknown) - 1} more)' if len(unknown) > 1 else ''}; a newer PEFT wrote it or it is a "
            f"typo — upgrade peft, or remove the key if it is at its default"
        )


def check_config(config) -> None:
    """Refuse, naming the field and the fix, any ``LoraConfig`` field whose meaning weightsync cannot
    merge exactly (``FIELDS`` rows of kind ``refused`` off their default; base-shifting initialisations).

    Args:
        config: a ``peft.LoraConfig`` (read from a file or a live ``PeftModel``).

    Raises:
        MergeError: naming the field, its value and what to do.
    """
    defaults = _defaults()
    for name, row in FIELDS.items():
        if row.kind != "refused" or name not in defaults:
            continue
        value = getattr(config, name, defaults[name])
        if name == "qalora_group_size" and not getattr(config, "use_qalora", False):
            continue  # read only with use_qalora
        if not _at_default(value, defaults[name]):
            raise MergeError(f"adapter_config {name}={value!r} is not supported: {row.why}")
    init = getattr(config, "init_lora_weights", True)
    if isinstance(init, str):
        fix = next((v for k, v in BASE_SHIFTING_INITS.items() if init.lower().startswith(k)), None)
        if fix is not None:
            raise MergeError(
                f"adapter_config init_lora_weights={init!r} without conversion: PEFT shifts the base weights "
                f"when it loads this adapter, so merging onto the base would serve wrong weights; {fix}"
            )
