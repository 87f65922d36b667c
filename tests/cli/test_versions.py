"""Weight versions across runs, without Ray: a run's first version follows what the engines serve
(``sync_cli.first_version``: ``weightsync sync --engine vllm-server --vllm-url`` and ``weightsync run``
reach engines an earlier run synced), the flags ``sync`` / ``demo`` / ``run`` take, and the one-line
refusal a push below a served version gets (``coordinator.versions.check_push_version``; end to end
through ``WeightSync`` in ``tests/faults/test_bad_input.py``)."""

from __future__ import annotations

import pytest

from sync_service.coordinator.versions import check_push_version
from sync_service.entrypoints.cli import build_parser
from sync_service.entrypoints.sync_cli import first_version, version_options


def test_first_version_continues_above_what_the_engines_serve():
    assert first_version({}) == 0 and first_version({"e0": None, "e1": None}) == 0  # fresh engines
    assert first_version({"server0": 1, "e1": None}) == 2  # a server an earlier run left at version 1
    assert first_version({"server0": 1}, given=5) == 5
    assert first_version({"server0": 1}, reset=True) == 0 and first_version({"server0": 7}, given=3, reset=True) == 3


def test_a_push_below_a_served_version_is_refused_naming_the_engine_and_the_fix():
    with pytest.raises(ValueError) as err:
        check_push_version(1, None, {"server0": 1, "e1": None}, reset=False)
    assert str(err.value) == ("push_async(1): engine server0 already serves version 1 (from an earlier WeightSync); "
                              "push version 2 or later, or pass SyncConfig(reset_versions=True) (weightsync "
                              "sync|demo|run: --reset-versions) to number versions from below it again")
    check_push_version(2, None, {"server0": 1}, reset=False)
    check_push_version(0, None, {"server0": 1}, reset=True)
    with pytest.raises(ValueError, match=r"push_async\(3\): versions must increase; the last push was 3"):
        check_push_version(3, 3, {}, reset=True)


@pytest.mark.parametrize("command,required", [("sync", ["--base", "b"]), ("demo", []), ("run", ["--config", "c.yaml"])])
def test_version_flags_of_every_command(command, required):
    parser = build_parser()
    assert version_options(parser.parse_args([command, *required])) == {
        "accumulate_dtype": "float32", "first_version": None, "reset_versions": False}
    args = parser.parse_args([command, *required, "--accumulate-dtype", "float64", "--first-version", "4",
                              "--reset-versions"])
    assert version_options(args) == {"accumulate_dtype": "float64", "first_version": 4, "reset_versions": True}
