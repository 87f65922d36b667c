"""Every MoE family of the installed transformers ends supported or refused by name, never merged wrong,
and the README's census table is what this run found (``tests/merge/families_census.py``).

One census per module (one process, tiny models, no Ray, no CLI). A transformers upgrade that adds, drops or
changes a family fails ``test_readme_census_table_is_generated`` until the table is rewritten with
``python -m tests.merge.families_census --write``.
"""

from __future__ import annotations

import pytest

from tests.merge.families_census import README, census, readme_section, table


@pytest.fixture(scope="module")
def verdicts():
    return census()


def test_no_family_is_merged_wrong(verdicts):
    wrong = [(v.model_type, v.reason) for v in verdicts if v.status == "wrong"]
    assert not wrong, f"our merge differs from PEFT's float64 merge: {wrong}"


def test_every_refusal_names_the_family_and_why(verdicts):
    for v in verdicts:
        if v.status == "refused" and not v.reason.startswith("transformers cannot build it on CPU at a tiny config: "):
            assert v.reason.startswith(f"model family {v.model_type}") or v.model_type in v.reason, v
        assert v.status == "supported" or len(v.reason) > 20, f"{v.model_type}: {v.status} without a reason"


def test_census_finds_the_known_families_supported(verdicts):
    supported = {v.model_type for v in verdicts if v.status == "supported"}
    # the families the project has synced since the first release (sync_service/synthetic/families.py)
    assert {"qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss"} <= supported, supported


def test_readme_census_table_is_generated(verdicts):
    want = table(verdicts)
    assert readme_section(README.read_text()) == want, (
        "README's MoE census table is not what transformers' families give now: "
        "python -m tests.merge.families_census --write")
