"""Model-family layout rows: fused MoE experts in memory vs on disk.

Legend: E experts, H hidden, I expert intermediate. "out"/"in" are a linear map's output and input
features (``nn.Linear.weight`` is [out, in]).

A ``FamilyLayout`` row is derived, not typed in (``sync_service/merge/derive.py``): from the model
built on the ``meta`` device from the checkpoint's config (which module holds the experts, its 3D
parameters in registration order, transformers' ``is_transposed`` / ``is_concatenated`` flags) and
from transformers' own conversion mapping (``conversion_mapping.get_model_conversion_mapping``:
``WeightRenaming`` / ``WeightConverter`` with ``MergeModulelist`` / ``Concatenate`` / ``Transpose``),
run on probe tensors so that the row reproduces exactly what ``save_pretrained`` writes.

- ``orientation="out_in"``: ``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I] (per expert [out, in]).
- ``orientation="in_out"``: ``gate_up_proj`` [E, H, 2I], ``down_proj`` [E, I, H] (per expert [in, out],
  ``x @ W``; gpt_oss, llama4).
- ``gate_up_order``: ``"concat"`` (gate [0, I), up [I, 2I) on the out axis) or ``"interleaved"``
  (gate = ``[..., ::2]``, up = ``[..., 1::2]``, gpt_oss).

Orientation and order come from these rows, never from shapes (square H == I and narrow experts exist).
``HAND_ROWS`` holds the only rows written by hand, each with the reason transformers lacks the information.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

Slot = Literal["gate", "up", "down"]


@dataclass(frozen=True, slots=True)
class FamilyLayout:
    """One model family's fused-expert layout and its on-disk naming.

    Attributes:
        family: ``config.model_type`` of the model (a VL model's outer model_type).
        model_types: ``model_type`` values served (the outer one and its ``text_config``'s).
        experts_module: in-memory path of the experts module inside a decoder layer (``mlp.experts``).
        gate_up: name of the fused gate/up parameter of the experts module.
        down: name of the fused down parameter of the experts module.
        orientation: ``"out_in"`` (per expert [out, in]) or ``"in_out"`` (per expert [in, out]).
        gate_up_order: ``"concat"`` (gate block then up block) or ``"interleaved"`` (gate even, up odd).
        expert_params: the experts module's parameters in registration order (PEFT nests one
            ``ParamWrapper`` per targeted parameter in this order: the first is innermost).
        disk: ``"per_expert"`` (``save_pretrained`` splits experts) or ``"fused"``.
        disk_transpose: fused on disk: ``"never"``, ``"always"`` (last two dims swapped on disk) or
            ``"by_shape"`` (transformers' ``Transpose(check_dims=True)``: a checkpoint may hold either
            orientation; it is transposed on load iff its shape differs from the in-memory one, and
            ``save_pretrained`` writes the in-memory orientation).
        disk_renames: transformers ``WeightRenaming``s as (on-disk pattern, in-memory pattern, scope prefix,
            base model prefix) in load order, applied by transformers' own ``rename_source_key`` (a scope,
            e.g. ``language_model`` of a VL model, limits a renaming to the names under it).
        per_expert_names: legacy per-expert module name of each slot (gate, up, down), as on disk
            and in adapters trained on pre-fusion models.
        peft_transposed: PEFT's ``ParamWrapper`` reads ``is_transposed`` of the experts module: with
            ``False`` it packs ``target_parameters`` factors as if each expert were [out, in] =
            [d1, d2], whatever the real orientation (llama4).
        tied_alias: ``(alias, kept)`` name suffixes of tied embeddings: the alias is not stored.
        weight_experts: in-memory paths (inside a decoder layer) of experts modules that hold one 3D
            ``weight`` [E, out, in] and no ``is_transposed`` flag instead of ``gate_up_proj`` / ``down_proj``
            (jetmoe's ``JetMoeParallelExperts``: ``mlp.input_linear``, ``mlp.output_linear`` and its attention
            experts); a family of these has no ``expert_params``. Stored as in memory (``disk_renames`` only);
            PEFT's ``ParamWrapper`` packs their ``target_parameters`` factors as [out, in] per expert.
        source: ``"derived"`` or ``"hand"`` (a ``HAND_ROWS`` row).
    """

    family: str
    model_types: tuple[str, ...]
    experts_module: str = "mlp.experts"
    gate_up: str = "gate_up_proj"
    down: str = "down_proj"
    orientation: Literal["out_in", "in_out"] = "out_in"
    gate_up_order: Literal["concat", "interleaved"] = "concat"
    expert_params: tuple[str, ...] = ("gate_up_proj", "down_proj")
    disk: Literal["per_expert", "fused"] = "per_expert"
    disk_transpose: Literal["never", "always", "by_shape"] = "never"
    disk_renames: tuple[tuple[str, str, str | None, str | None], ...] = ()
    per_expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    peft_transposed: bool = False
    tied_alias: tuple[str, str] = ("lm_head.weight", "embed_tokens.weight")
    weight_experts: tuple[str, ...] = ()
    source: Literal["derived", "hand"] = "derived"

    def is_weight_expert(self, name: str) -> bool:
        """``name`` (in-memory) is the 3D ``weight`` of one of ``weight_experts`` (``….layers.N.<path>.weight``)."""
        return any(re.search(rf"(^|\.)layers\.\d+\.{re.escape(path)}\.weight$", name) for path in self.weight_experts)

    def slot_param(self, slot: Slot) -> str:
        """The fused parameter holding a slot: gate/up → ``gate_up``, down → ``down``."""
        return self.down if slot == "down" else self.gate_up

    def out_selection(self, slot: Slot, out_features: int) -> tuple[int, int, int]:
        """``(start, stop, step)`` of a slot on its fused parameter's out axis.

        ``out_features`` is the fused out size (2I for gate/up, H for down).
        """
        if slot == "down":
            return (0, out_features, 1)
        half = out_features // 2
        if self.gate_up_order == "interleaved":
            return (0 if slot == "gate" else 1, out_features, 2)
        return (0, half, 1) if slot == "gate" else (half, out_features, 1)

    def to_disk(self, name: str) -> str:
        """In-memory name → on-disk name (transformers' renamings reversed, as ``save_pretrained``)."""
        if not self.disk_renames:
            return name
        from transformers.core_model_loading import rename_source_key

        return rename_source_key(name, _renamings(self.disk_renames)[1], [], reverse=True)[0]

    def from_disk(self, name: str) -> str:
        """On-disk (or legacy module) name → in-memory name (transformers' renamings, load order)."""
        if not self.disk_renames:
            return name
        from transformers.core_model_loading import rename_source_key

        return rename_source_key(name, _renamings(self.disk_renames)[0], [])[0]

    def slot_of(self, per_expert_name: str) -> Slot | None:
        """Legacy per-expert module name (``gate_proj``, Mixtral ``w1``) → slot, or ``None``."""
        for slot, known in zip(("gate", "up", "down"), self.per_expert_names):
            if per_expert_name == known:
                return slot  # type: ignore[return-value]
        return None


@lru_cache(maxsize=64)
def _renamings(rows: tuple[tuple[str, str, str | None, str | None], ...]) -> tuple[list, list]:
    """transformers ``WeightRenaming``s of ``rows`` (load order) and their reverse (save order)."""
    from transformers.core_model_loading import WeightRenaming

    forward = []
    for src, dst, scope, base_prefix in rows:
        renaming = WeightRenaming(source_patterns=src, target_patterns=dst)
        renaming.scope_prefix, renaming.base_model_prefix = scope, base_prefix
        forward.append(renaming)
    return forward, [r.reverse_transform() for r in forward[::-1]]


# Rows transformers cannot derive, keyed by the experts module's class name; each says why.
HAND_ROWS: dict[str, dict] = {
    # Llama4TextExperts is not decorated with use_experts_implementation, so it has no is_transposed /
    # is_concatenated flags; its forward is bmm(x, gate_up_proj) then gate, up = chunk(2, dim=-1):
    # [E, H, 2I] per expert [in, out], gate block first. transformers has no conversion for llama4:
    # stored fused on disk as in memory. PEFT reads no is_transposed either (peft_transposed=False).
    "Llama4TextExperts": dict(orientation="in_out", gate_up_order="concat", peft_transposed=False),
    # LongcatFlashExperts before transformers 5.20 is not decorated with use_experts_implementation (later
    # releases are, and derive the same row): its forward is F.linear(x, gate_up_proj[e]).chunk(2, dim=-1),
    # [E, 2I, H] per expert [out, in], gate block first. PEFT reads no is_transposed (peft_transposed=False).
    "LongcatFlashExperts": dict(orientation="out_in", gate_up_order="concat", peft_transposed=False),
}

# Experts classes that override transformers' default ``_apply_gate`` (gate, up = chunk(2, -1)) and whose
# gate-first order within each pair was read in their source; any other override is refused.
GATE_FIRST_OVERRIDES: dict[str, str] = {
    "GptOssExperts": "gate, up = gate_up[..., ::2], gate_up[..., 1::2] (is_concatenated=False)",
}


@dataclass(frozen=True, slots=True)
class ExpertNames:
    """Name patterns of a layout's expert tensors and their PEFT factor keys (hf-fused naming and PEFT keys
    alike; the experts module's last component survives every prefix and disk renaming)."""

    fused_gate_up: re.Pattern[str]
    """The fused gate/up tensor [E, ...] (``….mlp.experts.gate_up_proj``)."""
    fused_down: re.Pattern[str]
    """The fused down tensor [E, ...] (``….mlp.experts.down_proj``)."""
    fused: re.Pattern[str]
    """Either fused experts tensor [E, ...]: expert-parallel along dim 0."""
    per_expert: re.Pattern[str]
    """A legacy per-expert name or PEFT key (``….experts.N.gate_proj…``); group 1 is the expert N."""
    lora_a: re.Pattern[str]
    """PEFT ``target_parameters`` A factor of a fused experts tensor, [r·E, in] (rows expert-major)."""
    lora_b: re.Pattern[str]
    """PEFT ``target_parameters`` B factor of a fused experts tensor, [out, r·E] (columns rank-major)."""

    def with_expert(self, key: str, expert: int) -> str:
        """``key`` (a ``per_expert`` name) with its expert index replaced by ``expert``."""
        m = self.per_expert.search(key)
        assert m is not None, key
        return key[:m.start(1)] + str(expert) + key[m.end(1):]


@lru_cache(maxsize=64)
def _expert_names(experts_module: str, gate_up: str, down: str) -> ExpertNames:
    experts, gate_up, down = re.escape(experts_module.rpartition(".")[2]), re.escape(gate_up), re.escape(down)
    return ExpertNames(
        fused_gate_up=re.compile(rf"\.{experts}\.{gate_up}$"), fused_down=re.compile(rf"\.{experts}\.{down}$"),
        fused=re.compile(rf"\.{experts}\.(?:{gate_up}|{down})$"), per_expert=re.compile(rf"\.{experts}\.(\d+)\."),
        lora_a=re.compile(rf"\.{experts}\.(?:base_layer\.)?lora_A\.weight$"),
        lora_b=re.compile(rf"\.{experts}\.(?:base_layer\.)?lora_B\.weight$"))


def expert_names(layout: FamilyLayout | None = None) -> ExpertNames:
    """The expert name patterns of ``layout``'s ``experts_module`` / ``gate_up`` / ``down``; ``None``: of
    ``FamilyLayout``'s default naming (``mlp.experts.gate_up_proj`` / ``down_proj``, every family whose
    rows keep transformers' standard experts module)."""
    if layout is None:
        fields = FamilyLayout.__dataclass_fields__
        return _expert_names(fields["experts_module"].default, fields["gate_up"].default, fields["down"].default)
    return _expert_names(layout.experts_module, layout.gate_up, layout.down)

