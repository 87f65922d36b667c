"""Reading a live PEFT LoRA model in place: which parameter is which base tensor or LoRA factor.

A training rank holds a ``peft.PeftModel`` (possibly wrapped by ``DistributedDataParallel``, or
sharded in place by FSDP2 ``fully_shard``). Its parameters are named as PEFT registers them:

- base: ``base_model.model.<hf-fused name with .base_layer segments>`` (``…q_proj.base_layer.weight``,
  ``…mlp.experts.base_layer.base_layer.gate_up_proj`` for ``target_parameters``);
- factors: ``base_model.model.<module>.lora_A.<adapter>.weight`` — the PEFT state-dict key
  (``get_peft_model_state_dict``) is the same name without ``.<adapter>``;
- modules_to_save: the trained copy ``<module>.modules_to_save.<adapter>.<param>`` is a factor under
  PEFT's key ``base_model.model.<module>.<param>`` (it replaces that base tensor in the merge); the
  frozen ``<module>.original_module.<param>`` is the base tensor.

Each parameter is a plain tensor (single process, DDP replica, or an expert-parallel rank's own
expert block) or a ``DTensor`` on any mesh (FSDP2, HSDP, FSDP2 × TP; ``placement.py``). Nothing is copied
here: ``LiveParam.local()`` is a view of the storage the optimizer updates in place.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from sync_service.merge.errors import MergeError

__all__ = ["LiveParam", "LiveModel", "read_live_model", "unwrap_peft"]

_PREFIX = "base_model.model."
_FACTOR = re.compile(r"\.(lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)\.([^.]+)(\.weight)?$")
_NOT_SUPPORTED = ("trainable_tokens",)
_SAVED = re.compile(r"\.modules_to_save\.([^.]+)\.")


@dataclass(frozen=True, slots=True)
class LiveParam:
    """One parameter of the live model.

    Attributes:
        name: hf-fused base name (base tensors) or PEFT state-dict key (factors).
        param: the ``nn.Parameter`` itself (a ``DTensor`` under FSDP2).
        global_shape: the whole tensor's shape (the DTensor's; for a plain tensor its own shape).
    """

    name: str
    param: torch.Tensor
    global_shape: tuple[int, ...]

    @property
    def sharded(self) -> bool:
        """Whether the parameter is a DTensor (FSDP2 / a DeviceMesh)."""
        return _is_dtensor(self.param)

    def local(self) -> torch.Tensor:
        """This rank's values, a view of the live storage (never written here)."""
        return (self.param.to_local() if self.sharded else self.param).detach()


@dataclass(frozen=True, slots=True)
class LiveModel:
    """The parts of a live PEFT LoRA model weightsync reads.

    Attributes:
        base: hf-fused name → base parameter, in registration (layer) order.
        factors: PEFT state-dict key (``base_model.model.`` prefix kept) → LoRA parameter.
        tied_aliases: a tied alias (``lm_head.weight``) → the base name it shares storage with.
        peft_config: the adapter's ``peft.LoraConfig``.
        config: the transformers model config (family layout, expert count).
        adapter_name: the PEFT adapter read.
    """

    base: dict[str, LiveParam]
    factors: dict[str, LiveParam]
    tied_aliases: dict[str, str]
    peft_config: object
    config: object
    adapter_name: str


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def unwrap_peft(model):
    """The ``PeftModel`` inside ``model`` (``DistributedDataParallel`` / ``.module`` wrappers removed).

    Raises:
        TypeError: no ``peft.PeftModel`` found — pass the model ``peft.get_peft_model`` returned.
    """
    from peft import PeftModel

    seen = model
    for _ in range(4):
        if isinstance(seen, PeftModel):
            return seen
        seen = getattr(seen, "module", None)
        if seen is None:
            break
    raise TypeError(f"attach_trainer: model is a {type(model).__name__}, not a peft.PeftModel; pass the model "
                    f"peft.get_peft_model(...) returned (optionally wrapped by DistributedDataParallel or fully_shard)")


def read_live_model(model, *, adapter_name: str | None = None) -> LiveModel:
    """Classify every parameter of a live PEFT LoRA model (no copy, no collective).

    Args:
        model: a ``peft.PeftModel`` (or a DDP wrapper of one); FSDP2 ``fully_shard`` may have run.
        adapter_name: the adapter to read; ``None``: the model's active adapter.

    Raises:
        TypeError: not a PEFT model. ValueError: the adapter does not exist, is not LoRA, has no
            factors, uses trainable tokens (not read from a live model), or the parameters sit on several devices.
    """
    peft_model = unwrap_peft(model)
    name = adapter_name if adapter_name is not None else peft_model.active_adapter
    configs = peft_model.peft_config
    if name not in configs:
        raise ValueError(f"attach_trainer: adapter_name={name!r} is not an adapter of this model; it has "
                         f"{sorted(configs)} (PeftModel.peft_config keys)")
    peft_config = configs[name]
    if str(getattr(peft_config.peft_type, "value", peft_config.peft_type)) != "LORA":
        raise ValueError(f"attach_trainer: adapter {name!r} is {peft_config.peft_type}, not LoRA; only LoRA "
                         f"adapters merge additively into the engines' weights")
    base, factors = {}, {}
    for pname, param in peft_model.named_parameters():
        if any(f".{part}." in pname for part in _NOT_SUPPORTED):
            raise ValueError(f"attach_trainer: {pname} belongs to trainable tokens, which a live endpoint does not "
                             f"read; train the embedding as a LoRA target or a modules_to_save module instead")
        saved = _SAVED.search(pname)
        if saved is not None:
            if saved.group(1) == name:
                key = pname[:saved.start()] + "." + pname[saved.end():]  # PEFT's key: the module's own name
                factors[key] = LiveParam(key, param, tuple(param.shape))
            continue
        m = _FACTOR.search(pname)
        if m is not None:
            if m.group(2) == name:
                suffix = "" if m.group(1) == "lora_magnitude_vector" else (m.group(3) or "")  # PEFT's key rule
                key = pname[:m.start()] + f".{m.group(1)}" + suffix
                factors[key] = LiveParam(key, param, tuple(param.shape))
            continue
        hf = _hf_name(pname)
        base[hf] = LiveParam(hf, param, tuple(param.shape))
    if not factors:
        raise ValueError(f"attach_trainer: adapter {name!r} has no LoRA factors in this model")
    _check_one_device({**base, **factors})
    inner = peft_model.get_base_model()
    return LiveModel(base=base, factors=factors, tied_aliases=_tied_aliases(peft_model, base), peft_config=peft_config,
                     config=inner.config, adapter_name=name)


def _check_one_device(params: dict[str, LiveParam]) -> None:
    """Every parameter on one device: the merge runs where the base lives and the gathers on one group's device.

    Raises:
        ValueError: two devices, naming a parameter on each and the fix.
    """
    by_device: dict[torch.device, str] = {}
    for name, p in params.items():
        by_device.setdefault(p.local().device, name)
    if len(by_device) > 1:
        (d0, n0), (d1, n1) = list(by_device.items())[:2]
        raise ValueError(f"attach_trainer: the model's parameters are on {len(by_device)} devices ({n0} on {d0}, "
                         f"{n1} on {d1}); weightsync reads a rank's model on one device — move it whole "
                         f"(model.to(device)) before attaching")


def _hf_name(pname: str) -> str:
    """The hf-fused base name of a PEFT base parameter (wrapper segments removed)."""
    return pname.removeprefix(_PREFIX).replace(".base_layer", "").replace(".original_module", "")


def _tied_aliases(peft_model, base: dict[str, LiveParam]) -> dict[str, str]:
    """Parameters registered under two names (tied embeddings): the unlisted name → the listed one."""
    by_id = {id(p.param): n for n, p in base.items()}
    out = {}
    for pname, param in peft_model.named_parameters(remove_duplicate=False):
        hf = _hf_name(pname)
        if id(param) in by_id and hf not in base:
            out[hf] = by_id[id(param)]
    return out


def check_keys_match_peft(live: LiveModel, model) -> None:
    """The factor keys read here are exactly PEFT's own state-dict keys (``get_peft_model_state_dict``).

    Raises:
        MergeError: the two key sets differ (a PEFT naming this reader does not know).
    """
    from peft import get_peft_model_state_dict

    peft_keys = set(get_peft_model_state_dict(unwrap_peft(model), adapter_name=live.adapter_name))
    if peft_keys != set(live.factors):
        diff = sorted(peft_keys ^ set(live.factors))[:4]
        raise MergeError(f"attach_trainer: LoRA keys read from the live model differ from PEFT's state dict, e.g. "
                         f"{diff}; this PEFT naming is not supported")
