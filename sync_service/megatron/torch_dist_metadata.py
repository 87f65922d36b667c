"""What a Megatron-Core ``torch_dist`` checkpoint's ``.metadata`` adds to torch's DCP metadata, for the walker that
reads it without unpickling (``sync_service/merge/dcp_metadata.py``).

``dist_checkpointing.save`` (Megatron-Core 0.19.2, ``strategies/torch.py``) stores its cached save plans in
``Metadata.all_local_plans``: a list of torch's ``SavePlan`` records holding ``WriteItem`` / ``TensorWriteData``
records and ``WriteItemType`` codes (``torch/distributed/checkpoint/planner.py``). ``register()`` adds these
GLOBALs to the walker's table (records built empty and filled once, as DCP's own; ``WriteItemType`` only from
one of its int codes) and the field to ``Metadata``'s row, walked and left out (nothing reads the plans). Any
other GLOBAL stays refused.
"""

from __future__ import annotations

from sync_service.merge import dcp_metadata

__all__ = ["register"]

_PLANNER = "torch.distributed.checkpoint.planner"
_WRITE_ITEM_TYPES = (1, 2, 3)  # torch's WriteItemType: SHARD, TENSOR, BYTE_IO


def _write_item_type(code: object) -> int:
    if type(code) is not int or code not in _WRITE_ITEM_TYPES:
        raise dcp_metadata.MetadataError(f"WriteItemType code {code!r} is not one of torch's {_WRITE_ITEM_TYPES}")
    return code


def register() -> None:
    """Let ``dcp_metadata.parse_metadata`` read Megatron-Core's ``torch_dist`` metadata (idempotent)."""
    tables = dcp_metadata._GLOBALS  # noqa: SLF001 - the walker's own table, extended by its one extension
    tables.update({(_PLANNER, kind): kind for kind in ("SavePlan", "WriteItem", "TensorWriteData")})
    tables[(_PLANNER, "WriteItemType")] = dcp_metadata._Call("WriteItemType", _write_item_type)  # noqa: SLF001
    fields = dcp_metadata._SPECS["Metadata"][1]  # noqa: SLF001
    fields["all_local_plans"] = (lambda value, _b: dcp_metadata.IGNORED, False)
