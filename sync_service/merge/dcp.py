"""Trainer-native checkpoints: a torch.distributed.checkpoint (DCP) directory as a merge input.

An FSDP2 trainer saves its PEFT model as ``dcp.save(get_model_state_dict(model), checkpoint_id=DIR)``: a
``.metadata`` file plus one ``__<rank>_0.distcp`` file per rank, keys the PEFT model's own names
(``base_model.model.…q_proj.base_layer.weight``, ``….lora_A.default.weight``, ``…experts.base_layer.base_layer
.gate_up_proj``). Beside them the directory must hold the model's ``config.json`` (``model.config
.save_pretrained(DIR)``) and, for the adapter, ``adapter_config.json`` (``peft_config.save_pretrained(DIR)``).

``hf_dirs`` turns such a directory into the directories every other part of weightsync reads (a
``save_pretrained`` base, a PEFT adapter) by transformers' and PEFT's own code: the model is built from
``config.json`` in the dtype the checkpoint holds, wrapped by PEFT, loaded from the DCP state (strict: a
missing or unexpected key is an error), then the adapter is written by ``PeftModel.save_pretrained`` and
the base by ``unload()`` + ``save_pretrained`` — the on-disk layout is the family's own, so the merge and
its PEFT oracle see exactly what a trainer saving HF files would have written. Memory: the whole state once.

``.metadata`` is a pickle; nothing unpickles it: ``dcp_metadata`` walks its opcodes and builds only DCP's
metadata records from a table of allowed GLOBALs, and its data files must be plain names inside the directory.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import torch

from sync_service.merge.errors import MergeError

__all__ = ["hf_dirs", "is_dcp_dir", "read_dcp_state", "resolve_inputs"]

METADATA = ".metadata"
SINGLE_PROCESS_WARNING = r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to load"
"""The start of the ``UserWarning`` ``dcp.load`` gives for every read without a process group
(``torch/distributed/checkpoint/state_dict_loader.py``): ``read_dcp_state`` reads in one process on purpose."""


def is_dcp_dir(path: str | Path) -> bool:
    """``path`` is a directory holding a DCP ``.metadata`` file."""
    return (Path(path) / METADATA).is_file()


def _reader(path: Path):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    from sync_service.merge.dcp_metadata import check_layout, parse_metadata  # imports DCP: only when read

    class SafeMetadataReader(FileSystemReader):
        """``FileSystemReader`` whose ``.metadata`` is built from its opcodes (``dcp_metadata``), not unpickled."""

        def read_metadata(self, *args, **kwargs):
            metadata = parse_metadata((Path(self.path) / METADATA).read_bytes())
            check_layout(Path(self.path), metadata)
            metadata.storage_meta = metadata.storage_meta or StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeMetadataReader(str(path))


def read_dcp_state(path: str | Path, *, tensors_only: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor of the DCP checkpoint at ``path``, whole (the ranks' shards joined by DCP), in the
    dtypes it holds. Reads in this process, no process group. ``tensors_only``: leave the non-tensor entries
    unread (a Megatron-Core ``torch_dist`` checkpoint's ``_extra_state`` / ``common_state`` bytes) instead of
    refusing them.

    Raises:
        MergeError: no ``.metadata``, a metadata pickle naming anything but DCP records, non-tensor entries,
            or data files DCP cannot read (the message names the directory and the error).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = Path(path)
    reader = _reader(path)
    try:
        metadata = reader.read_metadata()
    except (ValueError, OSError, RuntimeError) as exc:  # MetadataError (a ValueError) names the non-DCP part
        raise MergeError(f"{path / METADATA}: not a torch.distributed.checkpoint metadata file ({exc}); "
                         f"save the checkpoint with torch.distributed.checkpoint.save") from None
    entries = metadata.state_dict_metadata
    others = sorted(k for k, m in entries.items() if not isinstance(m, TensorStorageMetadata))
    if others and not tensors_only:
        raise MergeError(f"{path}: holds non-tensor entries {others[:3]}; save only the model state "
                         f"(get_model_state_dict), not the optimizer or trainer state")
    try:
        state = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in entries.items()
                 if isinstance(m, TensorStorageMetadata)}
    except RuntimeError as exc:  # sizes whose product overflows or exceeds memory
        raise MergeError(f"{path}: cannot hold its tensors ({' '.join(str(exc).split())[:200]})") from None
    try:
        with warnings.catch_warnings():  # the single-process read is the intent here, not a fallback to report
            warnings.filterwarnings("ignore", message=SINGLE_PROCESS_WARNING, category=UserWarning)
            dcp.load(state, storage_reader=_reader(path), no_dist=True)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP's wrapper is a BaseException
        raise MergeError(f"{path}: torch.distributed.checkpoint cannot read it ({type(exc).__name__}: "
                         f"{' '.join(str(exc).split())[:300]})") from None
    return state


def _model(path: Path, state: dict[str, torch.Tensor]):
    """The model of ``path``'s ``config.json`` — wrapped by PEFT when ``adapter_config.json`` is there —
    holding ``state`` (every key, nothing else), built in the dtype of the checkpoint's base tensors."""
    import transformers

    from sync_service.merge.derive import model_class

    if not (path / "config.json").is_file():
        raise MergeError(f"{path}: a DCP checkpoint without config.json; save it beside the checkpoint "
                         f"(model.config.save_pretrained(DIR))")
    config = transformers.AutoConfig.from_pretrained(str(path))
    dtypes = {t.dtype for k, t in state.items() if ".lora_" not in k}
    model = model_class(config)._from_config(config, dtype=dtypes.pop() if len(dtypes) == 1 else torch.float32)
    if (path / "adapter_config.json").is_file():
        from peft import PeftConfig, get_peft_model

        model = get_peft_model(model, PeftConfig.from_pretrained(str(path)))
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # torch: "size mismatch for <key>: copying a param with shape …"
        detail = " ".join(str(exc).split(":", 1)[-1].split())[:300]
        raise MergeError(f"{path}: the DCP state's shapes are not those of its config.json ({detail}); save the "
                         f"config.json of the very model checkpointed (model.config.save_pretrained(DIR))") from None
    if missing or unexpected:
        raise MergeError(f"{path}: the DCP state is not the {type(model).__name__} of its config.json"
                         f"{' + adapter_config.json' if hasattr(model, 'peft_config') else ''}: missing "
                         f"{sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}; save "
                         f"get_model_state_dict(model) of that very model (and its adapter_config.json if a PEFT model)")
    return model


def hf_dirs(path: str | Path, out_dir: str | Path) -> tuple[Path, Path | None]:
    """Write the DCP checkpoint at ``path`` as ``out_dir/base`` (``save_pretrained``: the family's on-disk
    layout, the checkpoint's dtype, with ``path``'s tokenizer / generation files) and, for a PEFT model,
    ``out_dir/adapter`` (``PeftModel.save_pretrained``). Returns (base dir, adapter dir or ``None``).
    Call it outside a torch.distributed process group: within one, transformers writes only on rank 0.

    Raises:
        MergeError: as ``read_dcp_state``; no ``config.json``; state keys or shapes that are not the model's.
    """
    from sync_service.merge.export import COPIED_FILES

    from transformers.utils import logging as hf_logging

    path, out = Path(path), Path(out_dir)
    model = _model(path, read_dcp_state(path))
    adapter = None
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Writing model shards" bar in a command's output
    try:
        if hasattr(model, "peft_config"):
            adapter = out / "adapter"
            model.save_pretrained(str(adapter))
            model = model.unload()
        model.save_pretrained(str(out / "base"))
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    for name in COPIED_FILES:
        if (path / name).is_file():
            shutil.copy2(path / name, out / "base" / name)
    return out / "base", adapter


def resolve_inputs(base: Path, adapter: Path | None, work_dir: Path) -> tuple[Path, Path | None]:
    """``(base, adapter)`` with every DCP directory among them written as HF directories under ``work_dir``
    (``hf_dirs``); other directories are returned as they are. The same DCP directory may be both.

    Raises:
        MergeError: as ``hf_dirs``; an ``--adapter`` DCP of a model without ``adapter_config.json``.
    """
    converted: dict[Path, tuple[Path, Path | None]] = {}
    for i, path in enumerate(p for p in (base, adapter) if p is not None and is_dcp_dir(p)):
        if Path(path) not in converted:
            converted[Path(path)] = hf_dirs(path, Path(work_dir) / f"dcp{i}")
    if base is not None and Path(base) in converted:
        base = converted[Path(base)][0]
    if adapter is not None and Path(adapter) in converted:
        adapter_dir = converted[Path(adapter)][1]
        if adapter_dir is None:
            raise MergeError(f"--adapter {adapter}: a DCP checkpoint of a model without adapter_config.json; "
                             f"save peft_config.save_pretrained(DIR) beside it")
        adapter = adapter_dir
    return base, adapter
