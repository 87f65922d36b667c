"""The benchmark's model: a bf16 Qwen3-MoE base scaled by layers, and one PEFT LoRA adapter on it.

Legend: H hidden, I expert intermediate, E experts, L layers, r LoRA rank, K key/value heads. Per layer the
base holds E·3·I·H expert weights (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]) plus q/k/v/o (2
heads of H/2, K = 1 key/value head; ``tp_variant``: K = 2, so attention splits over tp = 2), so size x holds
about x · ``unit_bytes`` bytes of bf16. The adapter is a PEFT
``target_parameters`` LoRA on both expert tensors and ``target_modules`` LoRA on q/k/v/o (what
``sync_service.synthetic.make_adapter(kind="target_parameters")`` writes), with seeded random
non-zero factors.

Unlike ``make_base`` / ``make_adapter`` (which build the model in fp32 and, for the adapter, load
the base), the base is built directly in bf16 and the adapter on a ``meta``-device model, so a 4 GB
base needs ~4 GB while it is generated. Outputs are cached by shape under ``cache_dir``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

__all__ = ["ModelShape", "BenchModel", "ensure_fp8_engine", "fp8_block", "model_for_size", "ensure_model"]

FAMILY = "qwen3_moe"
TP_KV_HEADS = 2
"""Key/value heads of ``ModelShape.tp_variant`` (as ``synthetic.demo_files.TP_OVERRIDES``)."""


@dataclass(frozen=True, slots=True)
class ModelShape:
    """Sizes of one generated model (see the module legend)."""

    hidden: int
    """H."""
    intermediate: int
    """I (expert and dense intermediate)."""
    num_experts: int
    """E."""
    num_layers: int
    """L."""
    vocab_size: int
    """Tokens (embedding and lm_head rows)."""
    r: int
    """LoRA rank."""
    lora_alpha: float
    """LoRA alpha (scaling lora_alpha / r)."""
    kv_heads: int = 1
    """K: key/value heads (of head dim H/2; 1 or 2)."""

    def params_per_layer(self) -> int:
        h, i, e, k = self.hidden, self.intermediate, self.num_experts, self.kv_heads
        return e * 3 * i * h + 2 * h * h + k * h * h + e * h  # experts + q,o [H, H] + k,v [K·H/2, H] + router [E, H]

    def bf16_bytes(self) -> int:
        """Approximate base bytes in bf16 (layers + embeddings + lm_head; norms left out)."""
        return 2 * (self.num_layers * self.params_per_layer() + 2 * self.vocab_size * self.hidden)

    def key(self) -> str:
        kv = f"-kv{self.kv_heads}" if self.kv_heads != 1 else ""  # K = 1 keeps the key of the models cached before K
        return f"h{self.hidden}-i{self.intermediate}-e{self.num_experts}-l{self.num_layers}-v{self.vocab_size}-r{self.r}{kv}"

    def tp_variant(self) -> "ModelShape":
        """The same shape with 2 key/value heads (``TP_KV_HEADS``), so attention splits over tp = 2 (the
        ``live_fsdp2_tp`` row's base: ``entrypoints.demo_live.TrainerKind.tp_base``)."""
        return replace(self, kv_heads=TP_KV_HEADS)


# unit shape per mode: size x has x · layers_per_unit layers; the "full" unit holds >= 1 GB of bf16
UNITS = {
    "full": dict(hidden=1024, intermediate=512, num_experts=32, vocab_size=1024, r=16, lora_alpha=32.0, min_bytes=10**9),
    "quick": dict(hidden=64, intermediate=32, num_experts=8, vocab_size=128, r=4, lora_alpha=8.0, min_bytes=200_000),
}


def model_for_size(size: int, *, quick: bool = False) -> ModelShape:
    """The shape of size ``size`` (>= 1): ``size`` times the layers of the unit model, whose bf16
    bytes are at least the unit's ``min_bytes`` (1 GB for the full benchmark).

    Raises:
        ValueError: ``size`` < 1.
    """
    if size < 1:
        raise ValueError(f"model size {size} must be an integer >= 1 (a multiple of the 1x model)")
    unit = dict(UNITS["quick" if quick else "full"])
    min_bytes = unit.pop("min_bytes")
    one = ModelShape(num_layers=1, **unit)
    layers = max(1, math.ceil((min_bytes - 4 * one.vocab_size * one.hidden) / (2 * one.params_per_layer())))
    return ModelShape(num_layers=layers * size, **unit)


@dataclass(frozen=True, slots=True)
class BenchModel:
    """Paths of a generated base and adapter."""

    shape: ModelShape
    base_dir: Path
    adapter_dir: Path

    def factor_bytes(self) -> int:
        """Bytes of the adapter's factors as stored (the full factors a trainer gathers)."""
        return (self.adapter_dir / "adapter_model.safetensors").stat().st_size


def ensure_model(shape: ModelShape, cache_dir: Path) -> BenchModel:
    """Generate (once; reused when ``cache_dir/<shape key>/done.json`` exists) the base and adapter."""
    root = Path(cache_dir) / shape.key()
    model = BenchModel(shape=shape, base_dir=root / "base", adapter_dir=root / "lora")
    marker = root / "done.json"
    if marker.exists():
        return model
    _write_base(shape, model.base_dir)
    _write_adapter(shape, model.base_dir, model.adapter_dir)
    marker.write_text(json.dumps(asdict(shape)))
    return model


def _config(shape: ModelShape):
    from sync_service.synthetic import build_config

    config = build_config(FAMILY, num_layers=shape.num_layers, num_experts=shape.num_experts, hidden=shape.hidden,
                          intermediate=shape.intermediate, vocab_size=shape.vocab_size)
    config.num_key_value_heads = shape.kv_heads
    return config


@torch.no_grad()
def _write_base(shape: ModelShape, out: Path) -> None:
    from transformers import AutoModelForCausalLM

    from sync_service.synthetic import randomize_, save_tokenizer

    config = _config(shape)
    config.dtype = torch.bfloat16
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    randomize_(model, seed=0, scale=0.1)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), max_shard_size="2GB")
    save_tokenizer(out, shape.vocab_size)


@torch.no_grad()
def _write_adapter(shape: ModelShape, base_dir: Path, out: Path) -> None:
    """PEFT's own module matching and key naming on a weightless (meta) model; factors ``0.1·N(0, 1)``."""
    from peft import LoraConfig, get_peft_model
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from sync_service.synthetic import family_spec

    spec = family_spec(FAMILY)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_config(shape), dtype=torch.bfloat16)
    config = LoraConfig(r=shape.r, lora_alpha=shape.lora_alpha, target_modules=list(spec.attention),
                        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                        task_type="CAUSAL_LM", base_model_name_or_path=str(base_dir))
    peft_model = get_peft_model(model, config)
    peft_model.peft_config["default"].base_model_name_or_path = str(base_dir)
    gen = torch.Generator().manual_seed(0)
    state = {n: torch.randn(tuple(p.shape), generator=gen) * 0.1
             for n, p in sorted(peft_model.named_parameters()) if "lora_" in n}
    saved = get_peft_model_state_dict(peft_model, state_dict=state)
    if not saved:
        raise RuntimeError(f"no LoRA parameters matched {config.target_modules} / {config.target_parameters}")
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in saved.items()}, str(out / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    peft_model.peft_config["default"].save_pretrained(str(out))


def fp8_block(shape: ModelShape) -> tuple[int, int]:
    """The FP8 block of the bench's FP8 engine: 128 x 128 (DeepSeek-V3's) where H and I divide by it, else the
    largest power-of-two square that does (the quick models)."""
    side = math.gcd(128, shape.hidden, shape.intermediate)
    return side, side


def ensure_fp8_engine(model: BenchModel) -> Path:
    """The engine checkpoint of the ``delta_fp8`` row: the base with the bench adapter merged, written as block FP8
    (``weightsync merge --quantize fp8``, ``fp8_block``), once per shape (``<model root>/fp8``)."""
    from sync_service.merge.export import merge_checkpoint
    from sync_service.merge.export_fp8 import Fp8Options

    out = model.base_dir.parent / "fp8"
    marker = model.base_dir.parent / "fp8-done.json"
    if not marker.is_file():
        if out.exists():
            import shutil

            shutil.rmtree(out)
        merge_checkpoint(model.base_dir, model.adapter_dir, out, quantize="fp8",
                         fp8=Fp8Options(weight_block_size=fp8_block(model.shape)), progress=False)
        marker.write_text(json.dumps({"block": list(fp8_block(model.shape))}))
    return out

