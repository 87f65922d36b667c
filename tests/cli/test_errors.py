"""How ``weightsync`` prints an error that ended a command: one line, no colour codes, no traceback
frames, the Ray call that raised it, and the exit status of its kind (``sync_service/entrypoints/cli.py``)."""

from __future__ import annotations

import pytest

from actors.launch import RayLauncher
from sync_service.entrypoints.cli import EXIT_BAD_INPUT, EXIT_FAILED, describe, main, one_line
from sync_service.coordinator.metrics import SyncError
from sync_service.merge.errors import MergeError

# str() of real Ray errors (ray 2.60): an actor whose __init__ raised, and a method that raised
ACTOR_DIED = ("The actor died because of an error raised in its creation task, \x1b[36mray::RolloutEngine.__init__()"
              "\x1b[39m (pid=19286, ip=192.0.2.2, actor_id=915b42cf, repr=<actors.rollout.RolloutEngine object at 0x7f>)\n"
              "           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n  File \"/x/actors/rollout.py\", line 6, in __init__\n"
              "    raise KeyError(\"no_such_act\")\nKeyError: 'no_such_act'")
TASK_ERROR = ("\x1b[36mray::TrainerShard.send()\x1b[39m (pid=19285, ip=192.0.2.2, actor_id=31742, repr=<x>)\n"
              "  File \"/x/actors/trainer.py\", line 10, in send\n    raise ValueError(\"bad\")\n"
              "    ^^^^^^^^^^^^^^^^^^^^^^\nValueError: bucket too large\nsecond line")


def test_one_line_drops_colour_frames_and_process_details():
    assert one_line(ACTOR_DIED) == ("The actor died because of an error raised in its creation task, "
                                    "ray::RolloutEngine.__init__(); KeyError: 'no_such_act'")
    assert one_line(TASK_ERROR) == "ray::TrainerShard.send(); ValueError: bucket too large; second line"


@pytest.mark.parametrize("error,message,code", [
    (MergeError("adapter key x: holds NaN"), "adapter key x: holds NaN", EXIT_BAD_INPUT),
    (ValueError("SyncConfig.bucket_bytes=3 bad"), "SyncConfig.bucket_bytes=3 bad", EXIT_BAD_INPUT),
    (SyncError("push(3): engine1 failed", None), "push(3): engine1 failed", EXIT_FAILED),
    (TimeoutError("no ack within 5 s"), "no ack within 5 s", EXIT_FAILED),
    (KeyError("k"), "KeyError: 'k'", EXIT_FAILED),
])
def test_describe_kinds(error, message, code):
    assert describe(error) == (message, code)


def test_ray_task_error_is_unwrapped_to_its_cause_with_the_call():
    from ray.exceptions import RayTaskError

    cause = MergeError("adapter module m: DoRA is not defined")
    wrapped = RayTaskError("send", TASK_ERROR, cause, actor_repr="TrainerShard").as_instanceof_cause()
    assert describe(wrapped) == ("TrainerShard.send: adapter module m: DoRA is not defined", EXIT_BAD_INPUT)


def test_unexpected_error_is_one_line_and_traceback_flag_reraises(monkeypatch, capsys):
    from sync_service.entrypoints import sync_cli

    def boom(args):
        raise RuntimeError("first\nsecond")

    monkeypatch.setattr(sync_cli, "run", boom)
    assert main(["sync", "--base", "b"], launcher=RayLauncher()) == EXIT_FAILED
    err = capsys.readouterr().err
    assert err.startswith("weightsync sync: error: RuntimeError: first; second") and err.count("\n") == 1, err
    with pytest.raises(RuntimeError):
        main(["--traceback", "sync", "--base", "b"], launcher=RayLauncher())


def test_one_line_drops_worker_prefixes_and_keeps_the_end_of_a_long_message():
    frames = "".join(f"[rank0]:   File \"/v/f{i}.py\", line {i}, in g\n[rank0]:     call_{i}()\n[rank0]:     ^^^^\n"
                     for i in range(3))
    text = "vLLM oracle failed (1):\n[rank0]: Traceback (most recent call last):\n" + frames + \
        "[rank0]: ValueError: Head size 8 is not supported"
    assert one_line(text) == "vLLM oracle failed (1):; ValueError: Head size 8 is not supported"
    long = one_line("start\n" + "x" * 5000 + "\nValueError: the cause")
    assert long.startswith("start; x") and long.endswith("ValueError: the cause") and " … " in long
