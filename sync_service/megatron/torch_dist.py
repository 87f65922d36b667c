"""A Megatron-Core ``torch_dist`` checkpoint with Megatron-Bridge LoRA → the HF base and PEFT adapter it means.

Megatron-Core's ``dist_checkpointing.save`` (``torch_dist`` backend; ``metadata.json`` says
``{"sharded_backend": "torch_dist"}``) writes a torch.distributed.checkpoint whose keys are global and the
same at every TP / EP / PP: per layer stacked on dim 0 (``decoder.layers.self_attention.linear_qkv.weight``
[L, (nh+2ng)·d, H]), experts stacked on dim 1 (``decoder.layers.mlp.experts.experts.linear_fc1.weight``
[L, E, 2I, H]), the Bridge LoRA beside its base (``<module>.adapter.linear_in.weight`` [.., dim, in],
``.adapter.linear_out.weight`` [.., out, dim]). It is read here without unpickling
(``sync_service/merge/dcp.read_dcp_state``, with Megatron's additions to the metadata:
``torch_dist_metadata.py``); its ``_extra_state`` / ``common_state`` entries are left unread.

``hf_dirs`` writes what the rest of ``weightsync merge`` reads:

- the base: the checkpoint's own base tensors mapped to the HF on-disk names (``layouts.py``) in the dtype they
  hold, with the HF model's ``config.json`` (and its other non-weight files); where the checkpoint holds only
  the adapters (a Megatron-Bridge PEFT checkpoint), the HF model directory itself is the base;
- the adapter: a PEFT LoRA adapter with one ``lora_A`` / ``lora_B`` pair per HF projection: Bridge's
  ``linear_in`` is the ``lora_A`` of every projection its module fuses (``q_proj``, ``k_proj``, ``v_proj``
  share it; ``gate_proj`` and ``up_proj`` share it), ``linear_out`` split like the base rows is each
  ``lora_B``; ``r`` = dim (from the shapes), ``lora_alpha`` = Bridge's alpha, so PEFT's scaling alpha/r is
  Bridge's alpha/dim and the merge is W + (alpha/dim)·linear_out @ linear_in, per projection.

Alpha is not in the checkpoint: it comes from Megatron-Bridge's ``run_config.yaml`` inside it (``peft.alpha``,
``peft.dim``), else the caller's ``alpha``; neither is an error. Memory: the checkpoint's tensors once.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from sync_service.merge.errors import MergeError
from sync_service.megatron.layouts import EXPERT_ROWS, LAYER_ROWS, TOP_ROWS, Row, split

__all__ = ["is_torch_dist_dir", "lora_alpha", "hf_dirs"]

RUN_CONFIG = "run_config.yaml"
_LAYERS, _EXPERTS = "decoder.layers.", "decoder.layers.mlp.experts.experts."
_ADAPTER_IN, _ADAPTER_OUT = ".adapter.linear_in.weight", ".adapter.linear_out.weight"
_PREFIX = "base_model.model."


def is_torch_dist_dir(path: str | Path) -> bool:
    """``path`` is a Megatron-Core ``torch_dist`` checkpoint (its ``metadata.json`` names that backend)."""
    meta = Path(path) / "metadata.json"
    try:
        return meta.is_file() and json.loads(meta.read_text()).get("sharded_backend") == "torch_dist"
    except (OSError, ValueError, AttributeError):
        return False


def lora_alpha(path: str | Path, given: float | None) -> tuple[float, str]:
    """(alpha, where it came from): ``peft.alpha`` of Megatron-Bridge's ``run_config.yaml`` in ``path``, else
    ``given``. A run config and a ``given`` that differ is an error, as is neither.

    Raises:
        MergeError: no alpha anywhere, or two different ones, or a run config that is not YAML."""
    run_config = Path(path) / RUN_CONFIG
    found = None
    if run_config.is_file():
        import yaml

        try:
            peft = (yaml.safe_load(run_config.read_text()) or {}).get("peft") or {}
        except yaml.YAMLError as exc:
            raise MergeError(f"{run_config}: not YAML ({' '.join(str(exc).split())[:200]})") from None
        found = peft.get("alpha") if isinstance(peft, dict) else None
        if found is not None and not _finite(found):
            raise MergeError(f"{run_config}: peft.alpha {found!r} is not a finite number; fix it to the Megatron-Bridge "
                             f"LoRA(alpha=...) the run used")
    if given is not None and not _finite(given):
        raise MergeError(f"--lora-alpha {given}: not a finite number; give the Megatron-Bridge LoRA(alpha=...) it was "
                         f"trained with")
    if found is not None and given is not None and float(found) != float(given):
        raise MergeError(f"--lora-alpha {given} differs from peft.alpha {found} in {run_config}; drop the flag")
    if found is not None:
        return float(found), str(run_config)
    if given is None:
        raise MergeError(f"{path}: LoRA alpha is not in a torch_dist checkpoint and there is no {RUN_CONFIG} "
                         f"beside it; give --lora-alpha (the Megatron-Bridge LoRA(alpha=...) it was trained with)")
    return float(given), "--lora-alpha"


def _finite(value) -> bool:
    """``value`` is a real, finite number (YAML may hold a string, a bool or ``.nan``)."""
    import math

    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _geometry(hf_dir: Path) -> dict[str, int]:
    """heads, key/value groups, head_dim and hidden size of ``hf_dir``'s ``config.json``.

    Raises:
        MergeError: the file is not JSON or lacks the attention geometry."""
    try:
        config = json.loads((hf_dir / "config.json").read_text())
        heads = int(config["num_attention_heads"])
        groups = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
        hidden = int(config["hidden_size"])
    except (ValueError, KeyError, TypeError, AttributeError, ZeroDivisionError) as exc:
        raise MergeError(f"--hf-config {hf_dir}: config.json is not an HF model config with num_attention_heads / "
                         f"hidden_size ({type(exc).__name__}: {' '.join(str(exc).split())[:120]}); give the HF model "
                         f"directory the Megatron model was converted from") from None
    return {"heads": heads, "groups": groups, "head_dim": head_dim, "hidden": hidden,
            "tie": bool(config.get("tie_word_embeddings"))}


def _check_attention(state: dict[str, torch.Tensor], geometry: dict[str, int], ckpt: Path, hf_dir: Path) -> None:
    """The checkpoint's attention shapes are those of ``geometry``: ``linear_proj`` [L, hidden, heads·head_dim]
    fixes the heads, ``linear_qkv`` [L, (heads + 2·groups)·head_dim, hidden] the groups (the rows alone could
    split another model's way: 4 heads / 2 groups and 6 / 1 both give 8 head_dims).

    Raises:
        MergeError: naming the shapes and both directories."""
    heads, groups, head_dim, hidden = (geometry[k] for k in ("heads", "groups", "head_dim", "hidden"))
    want = {"self_attention.linear_proj.weight": (hidden, heads * head_dim),
            "self_attention.linear_qkv.weight": ((heads + 2 * groups) * head_dim, hidden)}
    for name, shape in want.items():
        tensor = state.get(_LAYERS + name)
        if tensor is not None and tuple(tensor.shape[-2:]) != shape:
            raise MergeError(f"{ckpt}: {_LAYERS}{name} is {list(tensor.shape)}, --hf-config {hf_dir} (heads {heads}, "
                             f"key/value heads {groups}, head_dim {head_dim}, hidden {hidden}) wants [L, {shape[0]}, "
                             f"{shape[1]}]; give the HF model the checkpoint was converted from")


def _layer_tensors(state: dict[str, torch.Tensor]):
    """(Megatron key, Row, HF names, tensor) per layer / expert slice of every stacked key of ``state``."""
    layer_rows = {row.megatron: row for row in LAYER_ROWS}
    expert_rows = {row.megatron: row for row in EXPERT_ROWS}
    top_rows = {row.megatron: row for row in TOP_ROWS}
    for key, tensor in state.items():
        base_key = key.replace(_ADAPTER_IN, ".weight").replace(_ADAPTER_OUT, ".weight")
        if key.startswith(_EXPERTS):
            row = expert_rows.get(base_key[len(_EXPERTS):])
            if row is not None:
                for layer in range(tensor.shape[0]):
                    for expert in range(tensor.shape[1]):
                        hf = tuple(f"model.layers.{layer}.mlp.experts.{expert}.{n}" for n in row.hf)
                        yield key, row, hf, tensor[layer, expert]
                continue
        elif key.startswith(_LAYERS):
            row = layer_rows.get(base_key[len(_LAYERS):])
            if row is not None:
                for layer in range(tensor.shape[0]):
                    yield key, row, tuple(f"model.layers.{layer}.{n}" for n in row.hf), tensor[layer]
                continue
        elif base_key in top_rows:
            yield key, top_rows[base_key], top_rows[base_key].hf, tensor
            continue
        raise MergeError(f"torch_dist key {key!r} is not in weightsync's Megatron-Bridge table "
                         f"(sync_service/megatron/layouts.py); its model family is not supported yet")


def _disk_shapes(hf_dir: Path) -> dict[str, tuple[int, ...]]:
    """On-disk tensor name → shape of the safetensors files in ``hf_dir`` (headers only)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            shapes.update({key: tuple(f.get_slice(key).get_shape()) for key in f.keys()})
    return shapes


def hf_dirs(ckpt: str | Path, hf_dir: str | Path, tmp: str | Path, *, alpha: float | None = None) -> tuple[Path, Path, dict]:
    """(base dir, PEFT adapter dir, summary) for the ``torch_dist`` checkpoint ``ckpt`` of the HF model
    ``hf_dir`` (its ``config.json``; its weights where ``ckpt`` holds only adapters), written under ``tmp``.

    Summary: ``{"lora_dim", "lora_alpha", "alpha_from", "base_from", "adapted"}`` (``adapted``: HF projections
    with a LoRA pair).

    Raises:
        MergeError: not a torch_dist checkpoint, no ``config.json`` in ``hf_dir``, a key the table does not
            know, no LoRA in it, LoRA dims that differ, base tensors that are only partly there, no alpha.
    """
    from sync_service.megatron.torch_dist_metadata import register
    from sync_service.merge.dcp import read_dcp_state

    register()
    ckpt, hf_dir, tmp = Path(ckpt), Path(hf_dir), Path(tmp)
    if not is_torch_dist_dir(ckpt):
        raise MergeError(f"{ckpt}: not a Megatron-Core torch_dist checkpoint (no metadata.json naming "
                         f"sharded_backend torch_dist)")
    if not (hf_dir / "config.json").is_file():
        raise MergeError(f"--hf-config {hf_dir}: no config.json; give the HF model directory the Megatron model "
                         f"was converted from")
    geometry = _geometry(hf_dir)
    state = read_dcp_state(ckpt, tensors_only=True)
    _check_attention(state, geometry, ckpt, hf_dir)
    split_geometry = {k: geometry[k] for k in ("heads", "groups", "head_dim")}
    base: dict[str, torch.Tensor] = {}
    lora_in: dict[str, torch.Tensor] = {}
    lora_out: dict[str, torch.Tensor] = {}
    dims: set[int] = set()
    for key, row, hf, tensor in _layer_tensors(state):
        try:
            parts = () if key.endswith(_ADAPTER_IN) else split(row, tensor, **split_geometry)
        except ValueError as exc:  # linear_qkv rows that the config's geometry does not split
            raise MergeError(f"{ckpt}: {key} {list(tensor.shape)}: {exc}; --hf-config {hf_dir} is not the HF model the "
                             f"checkpoint was converted from") from None
        if key.endswith(_ADAPTER_IN):
            dims.add(tensor.shape[0])
            for name in hf:
                lora_in[name] = tensor
        elif key.endswith(_ADAPTER_OUT):
            lora_out.update(zip(hf, parts))
        else:
            base.update(zip(hf, parts))
    if not lora_in:
        raise MergeError(f"{ckpt}: no Megatron-Bridge LoRA (no '*{_ADAPTER_IN}' key); nothing to merge")
    if len(dims) != 1 or set(lora_in) != set(lora_out):
        raise MergeError(f"{ckpt}: LoRA dims {sorted(dims)} (one expected) or linear_in without linear_out")
    dim = dims.pop()
    alpha_value, alpha_from = lora_alpha(ckpt, alpha)
    if geometry["tie"]:
        base.pop("lm_head.weight", None)
    base_dir = _write_base(base, hf_dir, tmp / "base", ckpt) if base else hf_dir
    adapter_dir = _write_adapter(lora_in, lora_out, tmp / "adapter", dim=dim, alpha=alpha_value, hf_dir=hf_dir)
    leaves = sorted({n.removesuffix(".weight").rpartition(".")[2] for n in lora_in})
    return base_dir, adapter_dir, {"lora_dim": dim, "lora_alpha": alpha_value, "alpha_from": alpha_from,
                                   "base_from": str(ckpt if base else hf_dir), "adapted": leaves}


def _write_base(base: dict[str, torch.Tensor], hf_dir: Path, out: Path, ckpt: Path) -> Path:
    """The checkpoint's base tensors as ``model.safetensors`` beside ``hf_dir``'s non-weight files."""
    from safetensors.torch import save_file

    expected = _disk_shapes(hf_dir)
    if expected:
        missing = sorted(set(expected) - set(base))
        wrong = sorted(n for n in set(expected) & set(base) if tuple(base[n].shape) != tuple(expected[n]))
        if missing or wrong:
            raise MergeError(f"{ckpt}: its base tensors do not match --hf-config {hf_dir}: missing {missing[:3]}, "
                             f"other shapes {wrong[:3]}; give the HF model the checkpoint was converted from")
    out.mkdir(parents=True)
    for item in hf_dir.iterdir():
        if item.is_file() and not item.name.endswith((".safetensors", ".bin")) and item.name != "model.safetensors.index.json":
            shutil.copy2(item, out / item.name)
    save_file({k: v.clone() for k, v in base.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    if not expected:
        _check_config_shapes(out, hf_dir, ckpt)
    return out


def _check_config_shapes(base_dir: Path, hf_dir: Path, ckpt: Path) -> None:
    """Where ``--hf-config`` holds no weights, the written base must be the model its ``config.json`` builds
    (transformers' model on the meta device, its in-memory names; a tied ``lm_head`` is the embedding): other
    layer, expert, vocabulary or intermediate sizes would give a checkpoint transformers cannot load, or fills
    with fresh random weights.

    Raises:
        MergeError: naming the first differing tensors."""
    from sync_service.merge.base import SafetensorsBase
    from sync_service.merge.derive import config_object, meta_model

    config = config_object(json.loads((base_dir / "config.json").read_text()))
    want = {k: tuple(v.shape) for k, v in meta_model(config).state_dict().items()}
    got = {m.name: tuple(m.shape) for m in SafetensorsBase(base_dir).metas()}
    if getattr(config, "tie_word_embeddings", False):
        want.pop("lm_head.weight", None)
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    wrong = sorted(f"{k} {list(got[k])} vs {list(want[k])}" for k in set(want) & set(got) if got[k] != want[k])
    if missing or extra or wrong:
        raise MergeError(f"{ckpt}: its tensors are not the model --hf-config {hf_dir}/config.json builds: missing "
                         f"{missing[:2]}, not in the config {extra[:2]}, other shapes {wrong[:2]}; give the HF model "
                         f"the checkpoint was converted from")


def _write_adapter(lora_in: dict, lora_out: dict, out: Path, *, dim: int, alpha: float, hf_dir: Path) -> Path:
    """A PEFT LoRA adapter: per HF projection ``lora_A`` = Bridge's ``linear_in``, ``lora_B`` = its ``linear_out`` rows."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    tensors = {}
    for name in sorted(lora_in):
        module = name.removesuffix(".weight")
        tensors[f"{_PREFIX}{module}.lora_A.weight"] = lora_in[name].clone()  # shared by the fused projections
        tensors[f"{_PREFIX}{module}.lora_B.weight"] = lora_out[name].clone()
    leaves = sorted({n.removesuffix(".weight").rpartition(".")[2] for n in lora_in})
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    LoraConfig(r=dim, lora_alpha=alpha, target_modules=leaves, task_type="CAUSAL_LM",
               base_model_name_or_path=str(hf_dir)).save_pretrained(str(out))
    return out
