"""Model-family layout tables: fused MoE experts in memory vs on disk.

Legend: E experts, H hidden, I expert intermediate. "out"/"in" are a linear map's output and input
features (``nn.Linear.weight`` is [out, in]).

Every family here keeps, in transformers v5 memory ("hf-fused" naming), one fused 3D tensor per
expert projection inside ``<layer>.mlp.experts``:

- ``orientation="out_in"``: ``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I] (per expert [out, in]);
  qwen3_moe, qwen2_moe, mixtral, olmoe, deepseek_v3.
- ``orientation="in_out"``: ``gate_up_proj`` [E, H, 2I], ``down_proj`` [E, I, H] (per expert [in, out],
  ``x @ W``); gpt_oss (transformers ``use_experts_implementation(is_transposed=True)``).

``gate_up_order`` says where gate and up sit on the out axis of ``gate_up_proj``: ``"concat"`` (gate
rows [0, I), up rows [I, 2I)) or ``"interleaved"`` (gate = ``[..., ::2]``, up = ``[..., 1::2]``, gpt_oss).
Orientation and order come from this table, never from shapes (square H == I and narrow experts exist).

On disk (what ``save_pretrained`` writes, from transformers' ``conversion_mapping.py``): per-expert
``<experts>.N.{gate,up,down}_proj.weight`` [out, in] (``disk="per_expert"``; Mixtral renames ``.mlp.``
to ``.block_sparse_moe.`` and uses ``w1``/``w3``/``w2``), or the fused tensors under their in-memory
names (``disk="fused"``, gpt_oss). Names are matched on suffixes, so a language model under a prefix
(``model.language_model.layers.…`` in a vision-language checkpoint) maps through the same table.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from sync_service.merge.errors import MergeError

Slot = Literal["gate", "up", "down"]


@dataclass(frozen=True, slots=True)
class FamilyLayout:
    """One model family's fused-expert layout and its on-disk naming.

    Attributes:
        family: canonical name (a key of ``LAYOUTS``).
        model_types: ``config.model_type`` values (or a VL model's ``text_config.model_type``) served.
        experts_module: in-memory path of the experts module inside a decoder layer.
        gate_up: name of the fused gate/up parameter of the experts module.
        down: name of the fused down parameter of the experts module.
        orientation: ``"out_in"`` (per expert [out, in]) or ``"in_out"`` (per expert [in, out]).
        gate_up_order: ``"concat"`` (gate block then up block) or ``"interleaved"`` (gate even, up odd).
        expert_params: the experts module's parameters in registration order (PEFT nests one
            ``ParamWrapper`` per targeted parameter in this order: the first is innermost).
        disk: ``"per_expert"`` (``save_pretrained`` splits experts) or ``"fused"``.
        disk_renames: ``(in-memory fragment, on-disk fragment)`` pairs applied to whole names.
        per_expert_names: legacy per-expert module name of each slot (gate, up, down), as on disk
            and in adapters trained on pre-fusion models.
        tied_alias: ``(alias, kept)`` name suffixes of tied embeddings: the alias is not stored.
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
    disk_renames: tuple[tuple[str, str], ...] = ()
    per_expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    tied_alias: tuple[str, str] = ("lm_head.weight", "embed_tokens.weight")

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
        """In-memory name → on-disk name (``disk_renames`` applied)."""
        for mem, disk in self.disk_renames:
            name = name.replace(mem, disk)
        return name

    def from_disk(self, name: str) -> str:
        """On-disk (or legacy module) name → in-memory name."""
        for mem, disk in self.disk_renames:
            name = name.replace(disk, mem)
        return name

    def slot_of(self, per_expert_name: str) -> Slot | None:
        """Legacy per-expert module name (``gate_proj``, Mixtral ``w1``) → slot, or ``None``."""
        for slot, known in zip(("gate", "up", "down"), self.per_expert_names):
            if per_expert_name == known:
                return slot  # type: ignore[return-value]
        return None


_QWEN_LIKE = dict(orientation="out_in", gate_up_order="concat", disk="per_expert")

LAYOUTS: dict[str, FamilyLayout] = {
    layout.family: layout
    for layout in (
        FamilyLayout(family="qwen3_moe", model_types=("qwen3_moe",), **_QWEN_LIKE),
        # shared expert: dense mlp.shared_expert.{gate,up,down}_proj + mlp.shared_expert_gate
        FamilyLayout(family="qwen2_moe", model_types=("qwen2_moe",), **_QWEN_LIKE),
        FamilyLayout(family="olmoe", model_types=("olmoe",), **_QWEN_LIKE),
        # dense first layers mlp.{gate,up,down}_proj, mlp.shared_experts.*, MLA attention
        FamilyLayout(family="deepseek_v3", model_types=("deepseek_v3",), **_QWEN_LIKE),
        FamilyLayout(
            family="mixtral",
            model_types=("mixtral",),
            disk_renames=((".mlp.", ".block_sparse_moe."),),
            per_expert_names=("w1", "w3", "w2"),
            **_QWEN_LIKE,
        ),
        FamilyLayout(
            family="gpt_oss",
            model_types=("gpt_oss",),
            orientation="in_out",
            gate_up_order="interleaved",
            expert_params=("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"),
            disk="fused",
        ),
    )
}


def _get(config: Mapping[str, Any] | Any, key: str) -> Any:
    if isinstance(config, Mapping):
        return config.get(key)
    return getattr(config, key, None)


def layout_for(config: Mapping[str, Any] | Any) -> FamilyLayout:
    """The layout of a model config (a ``config.json`` dict or a ``PretrainedConfig``).

    Looks up ``model_type``, then ``text_config.model_type`` (a vision-language model whose language
    model is one of the families).

    Raises:
        MergeError: the family is not supported; the message lists the supported families.
    """
    tried = []
    for cfg in (config, _get(config, "text_config")):
        model_type = _get(cfg, "model_type") if cfg is not None else None
        if model_type is None:
            continue
        tried.append(model_type)
        for layout in LAYOUTS.values():
            if model_type in layout.model_types:
                return layout
    raise MergeError(
        f"unsupported model family (model_type {tried or 'missing'}); supported families: "
        f"{', '.join(sorted(LAYOUTS))}. Add a FamilyLayout row to sync_service/merge/layouts.py "
        f"for a new family."
    )
