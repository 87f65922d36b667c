"""Reading and checking merge inputs: JSON configs, safetensors files, adapter_config field values.

Every function raises ``MergeError`` naming the file (and field) and the fix, never a raw
``JSONDecodeError`` / ``SafetensorError`` / ``TypeError``, so a bad input fails before any merge.
Field rules follow PEFT 0.21 ``LoraConfig`` (``tuners/lora/config.py``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from sync_service.merge.errors import MergeError

T = TypeVar("T")


def read_json_object(path: Path) -> dict:
    """The JSON object in ``path``. Raises ``MergeError`` if it is not UTF-8 JSON holding an object."""
    try:
        value = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise MergeError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}); write it with save_pretrained") from None
    except json.JSONDecodeError as exc:
        raise MergeError(f"{path}: not valid JSON ({exc.msg}, line {exc.lineno} column {exc.colno}); "
                         f"write it with save_pretrained") from None
    if not isinstance(value, dict):
        raise MergeError(f"{path}: holds a JSON {type(value).__name__}, expected an object; write it with save_pretrained")
    return value


def read_safetensors(path: Path, read: Callable[[str], T]) -> T:
    """``read(str(path))`` with a corrupt file (truncated, empty, bad header) reported as ``MergeError``."""
    from safetensors import SafetensorError

    try:
        return read(str(path))
    except SafetensorError as exc:
        raise MergeError(f"{path}: not a valid safetensors file ({exc}); re-save it with safetensors") from None


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    try:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    except OverflowError:  # an int past float's range
        return False


def _check_rank(path: Path, field: str, v) -> None:
    if not _is_int(v) or v < 1:
        raise MergeError(f"{path}: {field} must be a positive int, got {v!r}; fix the adapter_config")


def _check_alpha(path: Path, field: str, v) -> None:
    if not _is_number(v):
        raise MergeError(f"{path}: {field} must be a finite number, got {v!r}; fix the adapter_config")


def check_adapter_config(path: Path, config: dict) -> None:
    """Types and ranges of the adapter_config fields the merge uses (r, lora_alpha, rank/alpha
    patterns, target_parameters, use_rslora, use_dora, fan_in_fan_out). Absent fields take PEFT's
    defaults and are not checked here."""
    if "r" in config:
        _check_rank(path, "r", config["r"])
    if "lora_alpha" in config:
        _check_alpha(path, "lora_alpha", config["lora_alpha"])
    for field, check in (("rank_pattern", _check_rank), ("alpha_pattern", _check_alpha)):
        pattern = config.get(field)
        if pattern is None:
            continue
        if not isinstance(pattern, dict):
            raise MergeError(f"{path}: {field} must be an object {{module pattern: value}}, got {pattern!r}")
        for key, v in pattern.items():
            check(path, f"{field}[{key!r}]", v)
    for field in ("target_parameters", "target_modules", "modules_to_save"):
        v = config.get(field)
        if field == "target_modules" and isinstance(v, str):
            continue  # PEFT: a regex over module names
        if v is not None and not (isinstance(v, list) and all(isinstance(s, str) for s in v)):
            raise MergeError(f"{path}: {field} must be a list of strings or null, got {v!r}")
    for field in ("use_rslora", "use_dora", "fan_in_fan_out", "lora_bias"):
        v = config.get(field, False)
        if not isinstance(v, bool):
            raise MergeError(f"{path}: {field} must be true or false, got {v!r}")
