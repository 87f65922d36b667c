"""Derive a ``FamilyLayout`` row from transformers itself: the meta-device model and its conversion mapping.

Steps (``derive_layout``):
1. Build the model of the checkpoint's config on the ``meta`` device (``config.architectures[0]``, else
   ``AutoModelForCausalLM``, else ``AutoModelForImageTextToText``): no weights are allocated.
2. Find its experts module(s): the modules holding 3D ``nn.Parameter``s (convolutions excluded). Their
   class gives the in-memory orientation (``is_transposed``) and gate/up order (``is_concatenated``) of
   transformers' ``use_experts_implementation``; a class without those flags needs a ``HAND_ROWS`` row.
3. Read transformers' conversions for the model (``get_model_conversion_mapping``, as ``save_pretrained``
   uses them; ``PrefixChange`` dropped as ``revert_weight_conversion`` drops it for a model built from
   config) and refuse any converter that touches something other than the experts.
4. Run ``revert_weight_conversion`` (what ``save_pretrained`` runs) on probe tensors of distinct values
   put in place of one experts module's parameters, and keep the one candidate row whose ``"hf"`` target
   pieces (``targets.target_pieces``) reproduce transformers' output exactly, names and values. So the
   on-disk naming, orientation and gate/up order come from transformers' operations, not from shapes.

Any model this cannot derive is refused with one line naming the family and what is missing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

import torch

from sync_service.merge.errors import MergeError
from sync_service.merge.layouts import GATE_FIRST_OVERRIDES, HAND_ROWS, FamilyLayout
from sync_service.merge.targets import target_pieces

_PROBE_E, _PROBE_I, _PROBE_H = 3, 2, 5  # probe sizes: E experts, I intermediate, H hidden (all distinct)


def _get(config: Mapping[str, Any] | Any, key: str) -> Any:
    return config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)


def config_object(config: Mapping[str, Any] | Any):
    """A ``config.json`` dict → its transformers ``PretrainedConfig`` (a config object is returned as is).

    Raises:
        MergeError: no ``model_type``, or one transformers does not know.
    """
    if not isinstance(config, Mapping):
        return config
    from transformers import CONFIG_MAPPING

    model_type = config.get("model_type")
    text = config.get("text_config")
    if model_type not in CONFIG_MAPPING and isinstance(text, Mapping) and text.get("model_type") in CONFIG_MAPPING:
        return config_object(text)  # a wrapper transformers does not know around a language model it knows
    if model_type not in CONFIG_MAPPING:
        raise MergeError(f"model_type {model_type!r} is unknown to the installed transformers; "
                         f"upgrade transformers or pass a checkpoint of a model it knows")
    try:
        return CONFIG_MAPPING[model_type].from_dict(dict(config))
    except Exception as err:  # noqa: BLE001 - any config error is reported as bad input
        raise MergeError(f"model family {model_type}: transformers cannot read config.json "
                         f"({type(err).__name__}: {_one_line(err)})") from None


def model_class(config) -> type:
    """The transformers class of ``config``: the first of its ``architectures`` transformers has, else the
    causal-LM or image-text-to-text auto class of its config type.

    Raises:
        MergeError: transformers has no such class (names the family).
    """
    import transformers

    for arch in _get(config, "architectures") or []:
        cls = getattr(transformers, arch, None)
        if cls is not None:
            return cls
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModelForImageTextToText):
        if type(config) in auto._model_mapping:
            return auto._model_mapping[type(config)]
    raise MergeError(f"model family {config.model_type}: transformers has no causal-LM or image-text-to-text "
                     f"class for it (architectures {_get(config, 'architectures')})")


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())[:200]


def meta_model(config) -> torch.nn.Module:
    """The transformers model of ``config`` built on the ``meta`` device (no weights allocated).

    Raises:
        MergeError: transformers cannot build it from this config (names the family and the error).
    """
    cls = model_class(config)
    try:
        with torch.device("meta"):
            return cls._from_config(config)
    except Exception as err:  # noqa: BLE001 - a config the model class rejects is bad input
        raise MergeError(f"model family {config.model_type}: transformers cannot build {cls.__name__} from "
                         f"config.json ({type(err).__name__}: {_one_line(err)})") from None


def _experts_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Modules inside a decoder layer (``layers.N.``) holding 3D parameters, convolutions excluded (a 3D
    parameter outside the layers, e.g. kimi_k25's vision position embeddings, holds no experts)."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.conv._ConvNd) or not re.search(r"(^|\.)layers\.\d+\.", name):
            continue
        if any(p.dim() == 3 for p in module.parameters(recurse=False)):
            found.append((name, module))
    return found


def _experts_module_path(family: str, name: str) -> str:
    m = re.fullmatch(r"(.*\.)?layers\.\d+\.(.+)", name)
    if m is None:
        raise MergeError(f"model family {family}: experts module {name} is not inside a decoder layer (layers.N.)")
    return m.group(2)


def _memory_row(family: str, modules: list[tuple[str, torch.nn.Module]]) -> dict:
    """Row fields read from the in-memory experts module (class, flags, parameter names)."""
    classes = {type(m).__name__ for _, m in modules}
    if len(classes) != 1:
        raise MergeError(f"model family {family}: several experts classes {sorted(classes)}; no row covers them")
    (cls,) = classes
    name, module = modules[0]
    params = tuple(n for n, _ in module.named_parameters(recurse=False))
    if not {"gate_up_proj", "down_proj"} <= set(params) or any(
            not (p.startswith("gate_up_proj") or p.startswith("down_proj")) for p in params):
        raise MergeError(f"model family {family}: experts {cls} hold {list(params)}; the merge core needs "
                         f"gate_up_proj and down_proj (and their biases) only")
    paths = {_experts_module_path(family, n) for n, _ in modules}
    if len(paths) != 1:
        raise MergeError(f"model family {family}: experts at several paths {sorted(paths)}")
    row: dict = dict(experts_module=paths.pop(), expert_params=params)
    flagged = hasattr(module, "is_transposed") and hasattr(module, "is_concatenated")
    if cls in HAND_ROWS and not flagged:  # a release that adds the flags derives the row instead
        return row | HAND_ROWS[cls] | dict(source="hand")
    if not flagged:
        raise MergeError(f"model family {family}: experts class {cls} has no is_transposed / is_concatenated "
                         f"(not a use_experts_implementation class) and no hand-written row")
    apply_gate = getattr(type(module), "_apply_gate", None)
    if getattr(apply_gate, "__name__", "") != "_default_apply_gate" and cls not in GATE_FIRST_OVERRIDES:
        raise MergeError(f"model family {family}: experts class {cls} overrides _apply_gate; its gate/up order "
                         f"is not verified")
    return row | dict(orientation="in_out" if module.is_transposed else "out_in",
                      gate_up_order="concat" if module.is_concatenated else "interleaved",
                      peft_transposed=bool(module.is_transposed))


def _holds_one_weight(module: torch.nn.Module) -> bool:
    """An experts module of one 3D ``weight`` and no ``is_transposed`` flag (jetmoe's ``JetMoeParallelExperts``,
    ``F.linear(x, weight[e])``): PEFT's ``ParamWrapper`` reads it as [E, out, in]."""
    params = dict(module.named_parameters(recurse=False))
    return list(params) == ["weight"] and params["weight"].dim() == 3 and not hasattr(module, "is_transposed")


def _weight_experts_layout(model, family: str, model_types: tuple[str, ...], modules) -> FamilyLayout:
    """The row of a family whose experts modules each hold one 3D ``weight`` (``FamilyLayout.weight_experts``):
    transformers' renamings of them, verified on distinct-valued probes through ``revert_weight_conversion``
    (what ``save_pretrained`` writes must be each probe, unchanged, under ``to_disk`` of its name).

    Raises:
        MergeError: transformers converts these tensors (not only renames them), or writes them otherwise.
    """
    from transformers.core_model_loading import revert_weight_conversion

    paths = tuple(sorted({_experts_module_path(family, n) for n, _ in modules}))
    suffixes = tuple(f".{p}.weight" for p in paths)
    renames, _ = _conversions(model, family, lambda n: n.endswith(suffixes))
    layout = FamilyLayout(family=family, model_types=model_types, expert_params=(), disk="fused",
                          disk_renames=renames, weight_experts=paths)
    probes, start = {}, 0
    for name, module in modules:
        shape = (_PROBE_E, _PROBE_I, _PROBE_H)
        probes[f"{name}.weight"] = torch.arange(start, start + _PROBE_E * _PROBE_I * _PROBE_H,
                                                dtype=torch.float64).reshape(shape)
        module.weight = torch.nn.Parameter(torch.empty(shape, device="meta"), requires_grad=False)
        start += _PROBE_E * _PROBE_I * _PROBE_H
    disk = revert_weight_conversion(model, dict(probes))
    want = {layout.to_disk(n): v for n, v in probes.items()}
    if disk.keys() != want.keys() or any(not torch.equal(disk[k], v) for k, v in want.items()):
        raise MergeError(f"model family {family}: transformers' save_pretrained does not write the experts' "
                         f"3D weights of {paths[0]} as held in memory (keys {sorted(disk)[:4]}); the merge core "
                         f"cannot express it")
    return layout


def _probe_shape(param: str, ndim: int, orientation: str) -> tuple[int, ...]:
    e, i, h = _PROBE_E, _PROBE_I, _PROBE_H
    out_in = {"gate_up_proj": (2 * i, h), "down_proj": (h, i)}[param.removesuffix("_bias")]
    if ndim == 2:  # bias [E, out]
        return (e, out_in[0])
    return (e, *out_in) if orientation == "out_in" else (e, out_in[1], out_in[0])


def _probes(model, name: str, module, row: dict) -> dict[str, torch.Tensor]:
    """Put distinct-valued probes in place of ``module``'s parameters (on this private model)."""
    probes, start = {}, 0
    for param in row["expert_params"]:
        shape = _probe_shape(param, getattr(module, param).dim(), row["orientation"])
        numel = int(torch.Size(shape).numel())
        probes[f"{name}.{param}"] = torch.arange(start, start + numel, dtype=torch.float64).reshape(shape)
        setattr(module, param, torch.nn.Parameter(torch.empty(shape, device="meta"), requires_grad=False))
        start += numel
    return probes


def _conversions(model, family: str, is_expert) -> tuple[tuple, bool]:
    """(renamings as ``FamilyLayout.disk_renames`` rows, whether an expert ``Transpose`` checks dims).

    Raises:
        MergeError: a transform the layout rows cannot express (a converter on non-expert tensors,
            a grouped or scoped renaming, an unknown transform type).
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange, Transpose, WeightConverter, WeightRenaming

    names = list(model.state_dict().keys())
    renames, by_shape = [], False
    for t in get_model_conversion_mapping(model, add_legacy=False):
        if isinstance(t, PrefixChange):
            continue  # dropped by save_pretrained for a model built from config, as here
        src, dst = t._original_source_patterns, t._original_target_patterns
        if type(t) is WeightRenaming:
            if len(src) != 1 or len(dst) != 1:
                raise MergeError(f"model family {family}: transformers renaming {src} -> {dst} has no layout row form")
            renames.append((src[0], dst[0], t.scope_prefix, t.base_model_prefix))
            continue
        if type(t) is not WeightConverter:
            raise MergeError(f"model family {family}: transformers transform {type(t).__name__} {src} -> {dst} "
                             f"has no layout row form")
        reverse = t.reverse_transform()
        touched = [n for n in names if reverse.rename_source_key(n)[1] is not None]
        stray = [n for n in touched if not is_expert(n)]
        if stray:
            raise MergeError(f"model family {family}: transformers converts {stray[0]} ({src} -> {dst}, "
                             f"{t.operations}); the merge core converts experts only")
        by_shape |= any(isinstance(op, Transpose) and op.check_dims for op in t.operations)
    return tuple(renames), by_shape


def _candidates(disk: Mapping[str, torch.Tensor], probes: Mapping[str, torch.Tensor]) -> list[dict]:
    """Row hypotheses consistent with the names transformers wrote (verified afterwards by values)."""
    per_expert = re.compile(r".*\.(\d+)\.([A-Za-z0-9_]+)\.weight")
    leaves: dict[str, list[str]] = {}
    for key, t in disk.items():
        m = per_expert.fullmatch(key)
        if m is None:
            continue
        first = float(t.reshape(-1)[0])
        param = next(p for p, v in probes.items() if float(v.min()) <= first <= float(v.max()))
        bucket = leaves.setdefault(param.rsplit(".", 1)[1], [])
        if m.group(2) not in bucket:
            bucket.append(m.group(2))
    if not leaves:
        return [dict(disk="fused", disk_transpose=t) for t in ("never", "always")]
    gate_up, down = leaves.get("gate_up_proj", []), leaves.get("down_proj", [])
    if len(gate_up) != 2 or len(down) != 1:
        return []
    return [dict(disk="per_expert", per_expert_names=(a, b, down[0])) for a, b in (gate_up, gate_up[::-1])]


def _reproduces(layout: FamilyLayout, probes: Mapping[str, torch.Tensor], disk: Mapping[str, torch.Tensor]) -> bool:
    """``layout``'s ``"hf"`` pieces of the probes equal transformers' saved tensors, names and values."""
    got: dict[str, torch.Tensor] = {}
    try:
        for name, probe in probes.items():
            for piece in target_pieces("hf", name, tuple(probe.shape), layout):
                got[piece.name] = piece.to_target(probe[tuple(slice(a, b) for a, b in piece.box)])
    except MergeError:
        return False
    return got.keys() == disk.keys() and all(
        got[k].shape == disk[k].shape and torch.equal(got[k], disk[k]) for k in got)


def _family(config) -> tuple[str, tuple[str, ...]]:
    text = config.get_text_config() if hasattr(config, "get_text_config") else None
    types = [config.model_type] + ([text.model_type] if text is not None and text is not config else [])
    return config.model_type, tuple(dict.fromkeys(t for t in types if t))


def derive_layout_of(config) -> FamilyLayout:
    """The derived row of a transformers config (see the module docstring).

    Raises:
        MergeError: one line naming the family and what is missing.
    """
    from transformers.core_model_loading import revert_weight_conversion

    family, model_types = _family(config)
    model = meta_model(config)
    modules = _experts_modules(model)
    if not modules:
        raise MergeError(f"model family {family}: no experts module with 3D parameters (a dense model needs no "
                         f"layout row, but the merge core serves MoE families only)")
    if all(_holds_one_weight(m) for _, m in modules):
        return _weight_experts_layout(model, family, model_types, modules)
    row = dict(family=family, model_types=model_types) | _memory_row(family, modules)
    expert_suffixes = tuple(f"{row['experts_module']}.{p}" for p in row["expert_params"])
    renames, by_shape = _conversions(model, family, lambda n: n.endswith(expert_suffixes))
    row["disk_renames"] = renames
    name, module = modules[0]
    probes = _probes(model, name, module, row)
    disk = revert_weight_conversion(model, dict(probes))
    for candidate in _candidates(disk, probes):
        layout = FamilyLayout(**row, **candidate)
        if _reproduces(layout, probes, disk):
            if by_shape and layout.disk_transpose == "never":
                layout = FamilyLayout(**row, **(candidate | dict(disk_transpose="by_shape")))
            return layout
    raise MergeError(f"model family {family}: no layout row reproduces what transformers' save_pretrained "
                     f"writes for {name} (keys {sorted(disk)[:4]}); the merge core cannot express it")


@lru_cache(maxsize=32)
def _derive_cached(config_json: str) -> FamilyLayout:
    return derive_layout_of(config_object(json.loads(config_json)))


def layout_for(config: Mapping[str, Any] | Any) -> FamilyLayout:
    """The derived layout row of a model config (a ``config.json`` dict or a ``PretrainedConfig``).

    Cached per config. Costs one meta-device model build (no weight memory) the first time.

    Raises:
        MergeError: one line naming the family and what is missing (unknown to transformers, no experts,
            a conversion the rows cannot express, ...).
    """
    as_dict = dict(config) if isinstance(config, Mapping) else config.to_dict()
    if not as_dict.get("model_type"):
        raise MergeError("config has no model_type; pass the config.json written by save_pretrained")
    return _derive_cached(json.dumps(as_dict, sort_keys=True, default=str))


@lru_cache(maxsize=8)
def _memory_cached(config_json: str) -> dict[str, tuple[int, ...]]:
    model = meta_model(config_object(json.loads(config_json)))
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def memory_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """In-memory name → shape of every parameter and persistent buffer of the model of ``config``
    (a ``config.json`` dict), from the meta-device model. Cached per config."""
    return _memory_cached(json.dumps(dict(config), sort_keys=True, default=str))


@lru_cache(maxsize=8)
def _kept_fp32_cached(config_json: str) -> frozenset[str]:
    from transformers.core_model_loading import build_glob_alternation

    config = config_object(json.loads(config_json))
    dtype = getattr(torch, str(_get(config, "dtype") or _get(config, "torch_dtype") or "float32").removeprefix("torch."))
    cls = model_class(config)
    with torch.device("meta"):
        model = cls._from_config(config, dtype=dtype)  # modules built in fp32 explicitly stay fp32 (hunyuan's router)
    built = {n for n, t in model.state_dict().items() if t.dtype == torch.float32 and dtype != torch.float32}
    plan = model._get_dtype_plan(dtype)
    if not plan:
        return frozenset(built)
    pattern, _, _ = build_glob_alternation(list(plan))
    return frozenset(built | {n for n in model.state_dict() if pattern.search(n)})


def kept_in_fp32(config: Mapping[str, Any]) -> frozenset[str]:
    """In-memory names that transformers' ``from_pretrained`` loads in float32 whatever the checkpoint's
    dtype: the model's own ``_get_dtype_plan`` (``_keep_in_fp32_modules_strict`` for a bf16/fp16 checkpoint,
    ``_keep_in_fp32_modules`` for fp16; DeepSeek's ``mlp.gate.e_score_correction_bias``) and the modules it
    builds in float32 explicitly (hunyuan_v1_moe's router ``mlp.gate.wg``), from the meta-device model."""
    return _kept_fp32_cached(json.dumps(dict(config), sort_keys=True, default=str))
