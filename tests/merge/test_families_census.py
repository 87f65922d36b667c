"""Every MoE family of the installed transformers ends supported or refused by name, never merged wrong, the
verdicts are the ones recorded for this pinned version set, and the README's census table shows the recorded
sets (``tests/merge/families_census.py``).

One census per module (one process, tiny models, no Ray, no CLI). Runs in this machine's ``.venv``
(constraints/cpu.txt) and in ``.venv-newest`` (constraints/newest.txt, built by ``.ci/run``). A release that
adds, drops or moves a family fails ``test_verdicts_are_the_recorded_ones`` until the verdicts are recorded
again with ``python -m tests.merge.families_census --write`` in that venv.
"""

from __future__ import annotations

import pytest

from tests.merge.families_census import README, as_record, census, installed_set, pinned_sets, readme_section, \
    recorded, table


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
    # the families the project has synced since the first release (sync_service/synthetic/families.py), and the
    # two whose experts transformers holds otherwise: jetmoe (one 3D weight per module), longcat_flash
    assert {"qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss", "jetmoe",
            "longcat_flash"} <= supported, supported


def test_verdicts_are_the_recorded_ones(verdicts):
    found = installed_set()
    assert found in pinned_sets(), f"installed {found} is none of the pinned sets {pinned_sets()} " \
                                   f"(constraints/cpu.txt, constraints/newest.txt)"
    want, got = recorded().get(found, {}), as_record(verdicts)
    moved = {f: (want.get(f), got.get(f)) for f in sorted(want.keys() | got.keys()) if want.get(f) != got.get(f)}
    assert not moved, (f"{found}: families whose verdict moved (recorded, now): {moved}; check them, then "
                       f"record: python -m tests.merge.families_census --write")


def test_readme_census_table_is_generated():
    sets = recorded()
    assert list(sets) == pinned_sets(), f"census_verdicts.json records {list(sets)}, the pins are {pinned_sets()}"
    assert readme_section(README.read_text()) == table(sets), (
        "README's MoE census table is not the recorded verdicts: python -m tests.merge.families_census --write")
