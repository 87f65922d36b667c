"""PEFT adapter keys → ``LoraTerm``s (the rules of PEFT 0.21, ``tuners/lora``).

Key forms (``base_model.model.`` prefix stripped, adapter name already dropped by PEFT):
- dense: ``<module>.lora_A.weight`` [r, in], ``<module>.lora_B.weight`` [out, r]; ΔW = s·B@A.
  ``fan_in_fan_out`` is ignored: PEFT honours it only on ``Conv1D`` targets (GPT-2 style) and resets it
  to False, with a warning, on ``nn.Linear`` (``tuners/lora/layer.py`` ``dispatch_default``); every
  dense target of the supported families is an ``nn.Linear``. On ``target_parameters`` PEFT refuses it
  (``ParamWrapper``), and so does this module. DoRA adds ``<module>.lora_magnitude_vector`` [out].
- embedding: ``<module>.lora_embedding_A`` [r, V], ``<module>.lora_embedding_B`` [H, r]; ΔW = s·(B@A)ᵀ.
- ``target_parameters`` on 3D experts: ``<experts>(.base_layer)*k.lora_{A,B}.weight``; the targeted
  parameters nest in registration order, the first innermost (most ``base_layer``s); a
  ``FamilyLayout.weight_experts`` module's one ``weight``: ``<module>.lora_{A,B}.weight``. Factor packing
  and orientation (PEFT reads ``is_transposed``, absent = False, so llama4's [in, out] experts are packed as
  [d1, d2] too): ``param_wrapper``.
- legacy per-expert: ``<experts>.N.<gate_proj|up_proj|down_proj|w1|w3|w2>.lora_{A,B}.weight`` trained on
  a pre-fusion model; applied exactly per expert with the adapter's own r and α (rsLoRA honoured).
- anything else without ``lora_``: a modules_to_save copy replacing the base tensor of that name.
"""

from __future__ import annotations

import re
from collections import defaultdict

import torch

from protocols.params import FLOAT_DTYPES, ParamMeta
from sync_service.merge.adapter_contract import check_config
from sync_service.merge.adapter_tokens import TOKENS_DELTA, add_token_rows
from sync_service.merge.errors import MergeError
from sync_service.merge.finite import all_finite
from sync_service.merge.layouts import FamilyLayout
from sync_service.merge.lora_scaling import scaling as _scaling
from sync_service.merge.param_wrapper import expert_factors
from sync_service.merge.targets import target_pieces
from sync_service.merge.terms import LoraAdapter, LoraTerm, sel_len

_PREFIX = "base_model.model."
_LORA_PARTS = ("lora_A.weight", "lora_B.weight", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")
_NON_LORA = ("hada_", "lokr_", "ia3_", "oft_", "boft_", "vera_", "fourierft_", "lora_E", "ranknum")


def _wrapper_copy(name: str, names: set[str]) -> bool:
    """``<m>.modules_to_save.weight`` / ``<m>.original_module.weight`` next to ``<m>.weight``: what
    ``save_pretrained`` adds for a modules_to_save embedding with ``save_embedding_layers`` (set by
    itself when the vocabulary was resized). PEFT loads the first into the same trained copy as
    ``<m>.weight``, which it loads after it (keys in file order), and the second into the wrapped
    base module that ``merge_and_unload`` discards; so ``<m>.weight`` alone decides the merge."""
    m = re.fullmatch(r"(.+)\.(modules_to_save|original_module)\.weight", name)
    return m is not None and f"{m.group(1)}.weight" in names


def _group(state_dict) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    modules: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    plain: dict[str, torch.Tensor] = {}
    names = {key.removeprefix(_PREFIX) for key in state_dict}
    for key, t in state_dict.items():
        name = key.removeprefix(_PREFIX)
        if _wrapper_copy(name, names):
            continue
        if re.search(r"\.lora_B\.bias$", name):
            raise MergeError(f"adapter key {key}: lora_bias=True adapters are not supported; retrain with lora_bias=False")
        bad = next((p for p in _NON_LORA if f".{p}" in name), None)
        if bad is not None:
            raise MergeError(f"adapter key {key}: {bad!r} is not a LoRA weight; only LoRA adapters merge here")
        part = next((p for p in _LORA_PARTS if name.endswith("." + p)), None)
        if part is None:
            if ".lora_" in name:
                raise MergeError(f"adapter key {key}: unsupported LoRA tensor; supported: {', '.join(_LORA_PARTS)}")
            plain[name] = t
        else:
            modules[name[: -len(part) - 1]][part] = t
    return modules, plain


def _check_pair(module: str, parts: dict[str, torch.Tensor], a: str, b: str,
                derived: list) -> tuple[torch.Tensor, torch.Tensor]:
    if a not in parts or b not in parts:
        raise MergeError(f"adapter module {module}: needs both {a} and {b}, has {sorted(parts)}")
    for part in (a, b):
        _check_factor(f"{module}.{part}", parts[part])
    return _acc(parts[a], derived), _acc(parts[b], derived)


def _check_factor(key: str, t: torch.Tensor) -> None:
    """A LoRA factor must be a 2D floating tensor of finite values."""
    if not t.is_floating_point() or t.dim() != 2:
        raise MergeError(f"adapter key {key}: {str(t.dtype).removeprefix('torch.')}{list(t.shape)} is not a 2D "
                         f"floating-point LoRA factor; re-save the adapter from PEFT")
    if not all_finite(t):
        raise MergeError(f"adapter key {key}: holds NaN or Inf values; the adapter is corrupt or training diverged")


def _check_float_base(module: str, meta: ParamMeta) -> None:
    if meta.dtype not in FLOAT_DTYPES:
        raise MergeError(f"adapter module {module}: targets base {meta.name} of dtype {meta.dtype}; LoRA merges "
                         f"only into floating-point tensors — remove the module from the adapter or fix the base")


def _acc(t: torch.Tensor, derived: list) -> torch.Tensor:
    """Factors in the accumulation dtype: fp32, or float64 when given in float64 (a view when already
    so; a recorded copy otherwise, see ``LoraAdapter.refresh``)."""
    return t if t.dtype in (torch.float32, torch.float64) else _derive(t.float(), t, derived)


def _derive(copy: torch.Tensor, source: torch.Tensor, derived: list) -> torch.Tensor:
    """Record ``copy`` as derived from the state-dict view ``source`` unless it is that view itself."""
    if copy is not source:
        derived.append((copy, source))
    return copy


def normalise(config, state_dict, layout: FamilyLayout, base_metas, tied: dict[str, str]) -> LoraAdapter:
    if getattr(config, "peft_type", None) is not None and str(getattr(config.peft_type, "value", config.peft_type)) != "LORA":
        raise MergeError(f"adapter peft_type {config.peft_type} is not LoRA; only LoRA adapters merge here")
    check_config(config)  # every LoraConfig field merged exactly or refused (adapter_contract.FIELDS)
    metas = {m.name: m for m in base_metas}
    modules, plain = _group(state_dict)
    out = LoraAdapter()
    ctx = _Ctx(config, layout, metas, tied, out)
    for module, parts in modules.items():
        ctx.module(module, parts)  # each LoRA module must be selected by the adapter_config (check_targeted)
    if not modules:
        ctx.check_targets_exist()
    for name, t in plain.items():
        ctx.replacement(name, t)
    ctx.check_weight_tying()
    return out


class _Ctx:
    def __init__(self, config, layout: FamilyLayout, metas: dict[str, ParamMeta], tied: dict[str, str], out: LoraAdapter):
        self.config, self.layout, self.metas, self.tied, self.out = config, layout, metas, tied, out

    def resolve(self, name: str) -> str | None:
        name = self.layout.from_disk(name)
        name = self.tied.get(name, name)
        return name if name in self.metas else None

    def add(self, name: str, term: LoraTerm) -> None:
        self.out.terms.setdefault(name, []).append(term)

    def module(self, module: str, parts: dict[str, torch.Tensor]) -> None:
        stripped = self.layout.from_disk(re.sub(r"(\.base_layer)+$", "", module))
        if stripped != self.layout.from_disk(module) or re.search(rf"(^|\.){re.escape(self.layout.experts_module)}$", stripped):
            return self.target_parameter(module, stripped, parts)
        target = self.resolve(module + ".weight")
        if target is not None and self.layout.is_weight_expert(target):
            return self.weight_expert(module, target, parts)
        if target is not None:
            self.check_targeted(module)
            return self.dense(module, target, parts)
        legacy = re.fullmatch(rf"(.*\.)?{re.escape(self.layout.experts_module)}\.(\d+)\.([A-Za-z0-9_]+)", self.layout.from_disk(module))
        if legacy is not None and self.layout.slot_of(legacy.group(3)) is not None:
            self.check_targeted(module)
            return self.legacy(module, legacy.group(1) or "", int(legacy.group(2)), legacy.group(3), parts)
        raise MergeError(
            f"adapter module {module} ({', '.join(sorted(parts))}) matches no base tensor (looked for {module}.weight "
            f"and {self.layout.family} expert names); the adapter was trained on a different model — check "
            f"the base checkpoint and the adapter's base_model_name_or_path"
        )

    def by_parameter(self, key: str) -> bool:
        """``key`` (``<module>.<param>``) is selected by ``target_parameters`` (PEFT's suffix rule)."""
        return any(key == t or key.endswith("." + t) for t in getattr(self.config, "target_parameters", None) or [])

    def _module_names(self):
        """Every module name the base has, in memory naming and as on disk (per-expert legacy modules)."""
        for meta in self.metas.values():
            for piece in target_pieces("hf", meta.name, meta.shape, self.layout):
                yield piece.name.rpartition(".")[0]
            yield meta.name.rpartition(".")[0]
        for alias in self.tied:
            yield alias.rpartition(".")[0]

    def check_targets_exist(self) -> None:
        """PEFT's loader refuses an adapter_config whose ``target_modules`` and ``target_parameters``
        select nothing in the base (``NoMatchingPeftModuleError``, ``tuners_utils.inject_adapter``); so do we."""
        from peft.tuners.tuners_utils import check_target_module_exists

        modules = getattr(self.config, "target_modules", None)
        parameters = getattr(self.config, "target_parameters", None) or []
        if (modules is None and not parameters) or modules in ("all-linear", "dummy-target-modules"):
            return  # nothing to check (PEFT fills in defaults / expands these itself)
        if parameters and any(self.by_parameter(name) for name in list(self.metas) + list(self.tied)):
            return
        if modules and any(check_target_module_exists(self.config, m) for m in self._module_names()):
            return
        example = next((m for m in self._module_names() if m.endswith("proj")), "q_proj")
        raise MergeError(
            f"adapter_config target_modules {modules!r} / target_parameters {parameters!r} select no module or "
            f"parameter of the base (PEFT's loader refuses it too: 'Target modules not found in the base model'); "
            f"the adapter was made for another model — fix target_modules to this base's module names "
            f"(e.g. {example.rpartition('.')[2]!r}, as in {example})"
        )

    def check_targeted(self, module: str) -> None:
        """The adapter_config must select ``module`` (PEFT's own ``check_target_module_exists``), or
        its weight through ``target_parameters`` (a 2D parameter, e.g. a router that is no nn.Linear)."""
        from peft.tuners.tuners_utils import check_target_module_exists

        if self.by_parameter(module + ".weight"):
            return
        if getattr(self.config, "target_modules", None) is not None and not check_target_module_exists(self.config, module):
            weight = self.layout.from_disk(module + ".weight")
            if getattr(self.config, "ensure_weight_tying", False) and weight in set(self.tied) | set(self.tied.values()):
                # PEFT wrapped the tied copy of a targeted side too
                self._refuse_weight_tying(weight)
            raise MergeError(
                f"adapter module {module} has LoRA weights but adapter_config target_modules "
                f"{self.config.target_modules!r} does not select it; the config does not describe these weights"
            )

    def dense(self, module: str, target: str, parts: dict[str, torch.Tensor]) -> None:
        meta = self.metas[target]
        _check_float_base(module, meta)
        # a 2D ParamWrapper (target_parameters) resolves patterns on "<module>.weight", a module on "<module>"
        by_parameter = self.by_parameter(module + ".weight")
        if by_parameter and getattr(self.config, "fan_in_fan_out", False):
            raise MergeError(f"adapter module {module}: adapter_config fan_in_fan_out=true does not work with "
                             f"target_parameters (PEFT's ParamWrapper refuses it too); set fan_in_fan_out to false")
        r, s = _scaling(self.config, module + ".weight" if by_parameter else module)
        if "lora_embedding_A" in parts:
            a, b = _check_pair(module, parts, "lora_embedding_A", "lora_embedding_B", self.out.derived)
            x, y = a.T, b.T  # ΔW [V, H] = (B@A)ᵀ
            if "lora_magnitude_vector" in parts:
                raise MergeError(f"adapter module {module}: DoRA on embeddings is not supported")
        else:
            a, b = _check_pair(module, parts, "lora_A.weight", "lora_B.weight", self.out.derived)
            x, y = b, a  # fan_in_fan_out ignored on nn.Linear, as PEFT does (module docstring)
        if len(meta.shape) != 2 or x.shape[0] != meta.shape[0] or y.shape[1] != meta.shape[1] or x.shape[1] != r or y.shape[0] != r:
            raise MergeError(
                f"adapter module {module}: LoRA factors A {list(a.shape)}, B {list(b.shape)} (r={r}) do not fit "
                f"base {target} {list(meta.shape)}; the adapter was trained on a different model size"
            )
        self.add(target, LoraTerm(None, (0, meta.shape[0], 1), (0, meta.shape[1], 1), x, y, s))
        if getattr(self.config, "use_dora", False) and "lora_magnitude_vector" not in parts:
            raise MergeError(f"adapter module {module}: adapter_config use_dora=true but no lora_magnitude_vector; "
                             f"re-save the adapter from PEFT or set use_dora=false")
        if "lora_magnitude_vector" in parts and not getattr(self.config, "use_dora", False):
            raise MergeError(f"adapter module {module}: holds a DoRA lora_magnitude_vector but adapter_config "
                             f"use_dora=false, so PEFT would not apply it; set use_dora=true if the adapter was "
                             f"trained with DoRA, else re-save it without the magnitude")
        if "lora_magnitude_vector" in parts:
            m = _acc(parts["lora_magnitude_vector"], self.out.derived).reshape(-1)
            if not all_finite(m):
                raise MergeError(f"adapter key {module}.lora_magnitude_vector: holds NaN or Inf values; the adapter is corrupt")
            if m.numel() != meta.shape[0]:
                raise MergeError(f"adapter module {module}: DoRA magnitude {list(m.shape)} does not fit {target} {list(meta.shape)}")
            self.out.dora_magnitudes[target] = m

    def check_weight_tying(self) -> None:
        """``ensure_weight_tying=true`` keeps PEFT's copies of tied tensors tied; weightsync unties a pair
        whose one side carries a trained copy or LoRA (as PEFT does without the flag), so refuse it there."""
        if not getattr(self.config, "ensure_weight_tying", False) or not self.tied:
            return
        tied = set(self.tied) | set(self.tied.values())
        touched = sorted(tied & (set(self.out.replacements) | set(self.out.terms)))
        if touched:
            self._refuse_weight_tying(touched[0])

    def _refuse_weight_tying(self, name: str) -> None:
        raise MergeError(f"adapter_config ensure_weight_tying=true on tied tensor {name}: keeping the "
                         f"trained copy tied is not merged here; save the adapter with ensure_weight_tying=false")

    def _experts_meta(self, module: str, name: str) -> ParamMeta:
        target = self.resolve(name)
        if target is None or len(self.metas[target].shape) != 3:
            raise MergeError(f"adapter module {module}: base has no fused 3D expert tensor {name}")
        _check_float_base(module, self.metas[target])
        return self.metas[target]

    def refuse_wrapper_options(self, module: str, parts: dict[str, torch.Tensor]) -> None:
        """DoRA and ``fan_in_fan_out``, which PEFT's ``ParamWrapper`` refuses, are refused here too."""
        if "lora_magnitude_vector" in parts:
            raise MergeError(f"adapter module {module}: DoRA is not defined for target_parameters (PEFT ParamWrapper)")
        if getattr(self.config, "fan_in_fan_out", False):
            raise MergeError(f"adapter module {module}: adapter_config fan_in_fan_out=true does not work with "
                             f"target_parameters (PEFT's ParamWrapper refuses it too); set fan_in_fan_out to false")

    def target_parameter(self, module: str, experts: str, parts: dict[str, torch.Tensor]) -> None:
        self.refuse_wrapper_options(module, parts)
        lay = self.layout
        targets = list(getattr(self.config, "target_parameters", None) or [])
        chosen = [p for p in lay.expert_params if self.by_parameter(f"{experts}.{p}")]
        depth = module.count(".base_layer")
        if depth >= len(chosen):
            raise MergeError(
                f"adapter module {module}: nesting depth {depth} but target_parameters {targets} select "
                f"{chosen} on {experts}; the adapter_config does not describe this adapter"
            )
        param = chosen[len(chosen) - 1 - depth]
        key = f"{experts}.{param}"
        self.expert_term(module, param, key, self._experts_meta(module, key), parts, lay.peft_transposed)

    def weight_expert(self, module: str, target: str, parts: dict[str, torch.Tensor]) -> None:
        """LoRA on the 3D ``weight`` of a ``FamilyLayout.weight_experts`` module (``target_parameters``; the
        module has no ``is_transposed``)."""
        key = module + ".weight"
        if not self.by_parameter(key):
            raise MergeError(f"adapter module {module} has LoRA weights but adapter_config target_parameters "
                             f"{getattr(self.config, 'target_parameters', None)!r} does not select {key}; the config "
                             f"does not describe these weights")
        self.refuse_wrapper_options(module, parts)
        self.expert_term(module, "weight", key, self._experts_meta(module, target), parts, False)

    def expert_term(self, module: str, param: str, key: str, meta: ParamMeta, parts: dict[str, torch.Tensor],
                    peft_transposed: bool) -> None:
        """One ``LoraTerm`` over every expert of 3D ``meta`` from PEFT ``ParamWrapper`` factors (param_wrapper)."""
        a, b = _check_pair(module, parts, "lora_A.weight", "lora_B.weight", self.out.derived)
        r, s = _scaling(self.config, key)
        x, y = expert_factors(module, param, meta, a, b, r, peft_transposed)
        # per-expert contiguous copies of the (small) factors: baddbmm_ runs ~15-30% faster on them
        x, y = (_derive(t.contiguous(), t, self.out.derived) for t in (x, y))
        num_experts, d1, d2 = meta.shape
        self.add(meta.name, LoraTerm((0, num_experts), (0, d1, 1), (0, d2, 1), x, y, s))

    def legacy(self, module: str, prefix: str, expert: int, per_expert: str, parts: dict[str, torch.Tensor]) -> None:
        lay = self.layout
        if "lora_magnitude_vector" in parts:
            raise MergeError(f"adapter module {module}: DoRA on per-expert modules of a fused base is not supported")
        slot = lay.slot_of(per_expert)
        meta = self._experts_meta(module, f"{prefix}{lay.experts_module}.{lay.slot_param(slot)}")
        num_experts, d1, d2 = meta.shape
        if expert >= num_experts:
            raise MergeError(f"adapter module {module}: expert {expert} but base {meta.name} has E={num_experts}")
        a, b = _check_pair(module, parts, "lora_A.weight", "lora_B.weight", self.out.derived)
        r, s = _scaling(self.config, module)
        out_dim = 1 if lay.orientation == "out_in" else 2
        sel = lay.out_selection(slot, meta.shape[out_dim])
        in_f = d2 if out_dim == 1 else d1
        if tuple(a.shape) != (r, in_f) or tuple(b.shape) != (sel_len(sel), r):
            raise MergeError(
                f"adapter module {module}: A {list(a.shape)}, B {list(b.shape)} do not fit expert {expert} of "
                f"{meta.name} {list(meta.shape)} with r={r}: expected A [{r}, {in_f}], B [{sel_len(sel)}, {r}]"
            )
        if out_dim == 1:
            term = LoraTerm((expert, expert + 1), sel, (0, d2, 1), b[None], a[None], s)
        else:
            term = LoraTerm((expert, expert + 1), (0, d1, 1), sel, a.T[None], b.T[None], s)
        self.add(meta.name, term)

    def replacement(self, name: str, t: torch.Tensor) -> None:
        if name.endswith(TOKENS_DELTA):
            return self.trainable_tokens(name.removesuffix(TOKENS_DELTA), t)
        # PEFT saves targeted embedding layers as <module>.base_layer.weight and loads them as the base
        plain = self.layout.from_disk(name.replace(".base_layer.", "."))
        if not name.endswith(".base_layer.weight") and self.untie(plain, t):
            return
        target = self.resolve(plain)
        if target is None:
            raise MergeError(
                f"adapter key {name} matches no base tensor; a modules_to_save copy must name a base "
                f"tensor (e.g. lm_head.weight) — the adapter was trained on a different model"
            )
        if tuple(t.shape) != self.metas[target].shape:
            raise MergeError(f"adapter key {name}: shape {list(t.shape)} != base {target} {list(self.metas[target].shape)}")
        self.refuse_rows_and_copy(target)
        self.out.replacements[target] = t

    def trainable_tokens(self, module: str, t: torch.Tensor) -> None:
        """PEFT trainable tokens of ``module`` (``adapter_tokens.add_token_rows``)."""
        add_token_rows(self, module, t)

    def refuse_rows_and_copy(self, target: str, *, rows: bool = False) -> None:
        """Refuse trainable tokens and a trained copy (modules_to_save) on one tensor or tied pair: PEFT
        itself refuses both on one module, and a copy unties a pair whose rows were trained together."""
        pair = {target} | {a for a, k in self.tied.items() if k == target} | {self.tied.get(target, target)}
        copied = pair & (set(self.out.replacements) | set(self.out.untied))
        if (copied if rows else pair & set(self.out.row_overrides)):
            raise MergeError(f"adapter: {target} has both trainable_token_indices rows and a trained copy "
                             f"(modules_to_save / saved embedding); PEFT refuses that too — keep one of them")

    def untie(self, name: str, t: torch.Tensor) -> bool:
        """A modules_to_save copy of either tensor of a tied pair: PEFT wraps only that module, so
        ``merge_and_unload`` leaves the pair untied (the copy on one side, the base values on the
        other). Records the copy under its own name and the pair in ``untied``; False if not tied."""
        kept_of = {kept: alias for alias, kept in self.tied.items()}
        alias = name if name in self.tied else kept_of.get(name)
        if alias is None:
            return False
        kept = self.tied[alias]
        if tuple(t.shape) != self.metas[kept].shape:
            raise MergeError(f"adapter key {name}: shape {list(t.shape)} != base {kept} {list(self.metas[kept].shape)}")
        self.refuse_rows_and_copy(kept)
        self.out.replacements[name] = t
        self.out.untied[alias] = kept
        return True
