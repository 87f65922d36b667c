"""What an installed Megatron-Bridge's LoRA forward computes where it is not W + (alpha/dim)·B@A — by version, as data.

weightsync serves the function the trainer computes. Megatron-Bridge 0.6.2 (with megatron-core 0.19.2; measured on
CPU, local spec, no grouped GEMM, allgather dispatcher, 2026-12-05): on the experts' ``linear_fc2`` at expert-TP > 1
its row-parallel ``linear_in`` skips the all-reduce (an expert layer's output is reduced later, by the MoE combine),
its ``linear_out`` gathers the ranks' outputs, and the combine sums over the expert-TP ranks, so the layer computes
W·x + ETP·s·blockdiag(B_r A_r)·x: expert-TP rank r's ``linear_out`` rows B_r [H/ETP, dim] times its ``linear_in``
columns A_r [dim, I/ETP], ETP times, and nothing off the diagonal blocks (``tests/megatron/test_live.py`` holds the
served weights against Megatron's own forward at ETP = 2). Every other adapter, and every case at expert-TP 1, is
W + s·B@A.

``EXPERT_FC2_AT_ETP[version]``: ``"blockdiag"`` (the formula above) or ``"dense"`` (W + s·B@A). A version not in
the table with expert-TP > 1 is refused at attach, naming the version and the deviation.
"""

from __future__ import annotations

__all__ = ["EXPERT_FC2_AT_ETP", "bridge_version", "expert_fc2_rule"]

EXPERT_FC2_AT_ETP: dict[str, str] = {
    "0.6.2": "blockdiag",
}


def bridge_version() -> str:
    """The installed Megatron-Bridge's version (``""`` when it is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("megatron-bridge")
    except PackageNotFoundError:
        return ""


def expert_fc2_rule(etp: int, version: str | None = None) -> str:
    """``"dense"`` at expert-TP 1; else the table's rule for ``version`` (default: the installed Bridge's).

    Raises:
        ValueError: expert-TP > 1 with a Bridge version the table does not know (one line: the version, the
            deviation, the fix)."""
    if etp <= 1:
        return "dense"
    version = bridge_version() if version is None else version
    rule = EXPERT_FC2_AT_ETP.get(version)
    if rule is None:
        raise ValueError(f"Megatron-Bridge {version or '(not installed)'} at expert-TP {etp}: weightsync does not know what "
                         f"its LoRA forward computes on the experts' linear_fc2 (0.6.2 computes W + ETP*s*blockdiag(B_r "
                         f"A_r), not W + s*B@A; sync_service/megatron/deviations.py knows {sorted(EXPERT_FC2_AT_ETP)}); "
                         f"train at expert_tensor_parallel_size=1 or add the version after checking it against "
                         f"Megatron's forward")
    return rule
