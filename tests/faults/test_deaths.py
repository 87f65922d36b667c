"""An actor that dies says why: each way a worker process vanishes under load, caused for real in a small
actor of the fault package's Ray (a SIGBUS from a truncated /dev/shm mapping, a SIGKILL, the kernel's OOM
killer in a small memory cgroup), reaches the caller the way the coordinator sees it (``calls.settle``, the
CLI's ``died_error``) as one line naming the actor, its pid and the cause. Ray's own message is the same
"connection error code 2. End of file" for all three (``coordinator/deaths.py``)."""

from __future__ import annotations

import mmap
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import ray

from protocols.endpoints import EndpointDiedError
from sync_service.coordinator.calls import settle
from sync_service.coordinator.deaths import died_error
from sync_service.entrypoints.cli import describe

pytestmark = pytest.mark.faults

TIMEOUT_S = 60.0


@ray.remote(num_cpus=0)
class Victim:
    """A bare actor (no torch) that can die in each of the ways a trainer did."""

    def pid(self) -> int:
        return os.getpid()

    def write_past_a_truncated_shm_mapping(self) -> None:
        """A write into a /dev/shm page that no longer has backing: a real SIGBUS, as a ring writer takes
        when tmpfs cannot back a page."""
        path = f"/dev/shm/weightsync-test-bus-{os.getpid()}"
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        os.ftruncate(fd, 1 << 16)
        mm = mmap.mmap(fd, 1 << 16)
        os.ftruncate(fd, 0)
        os.close(fd)
        os.unlink(path)
        mm[0] = 1

    def allocate(self, mib: int) -> int:
        """Touch ``mib`` MiB of fresh memory."""
        return len([bytearray(1 << 20) for _ in range(mib)])


def _died(ref) -> EndpointDiedError:
    """The coordinator's view of ``ref``: the error ``calls.settle`` makes of it."""
    _, (err,) = settle([ref], ["trainer rank 0"], "send", TIMEOUT_S)
    assert isinstance(err, EndpointDiedError), err
    assert "\n" not in str(err), str(err)
    return err


def _started() -> tuple:
    victim = Victim.remote()
    return victim, ray.get(victim.pid.remote(), timeout=TIMEOUT_S)


def test_sigbus_names_the_fatal_error_and_the_frame(ray_local):
    victim, pid = _started()
    text = str(_died(victim.write_past_a_truncated_shm_mapping.remote()))
    assert text.startswith(f"trainer rank 0: send failed: ActorDiedError: the actor died (Victim pid {pid}): "
                           "crashed: Fatal Python error: Bus error at File "), text
    assert "test_deaths.py" in text and "in write_past_a_truncated_shm_mapping" in text, text
    assert "/dev/shm" in text, "the hint names where a SIGBUS of this code comes from"


def test_sigkill_says_so_with_the_memory_available_and_the_cli_keeps_it_one_line(ray_local):
    victim, pid = _started()
    os.kill(pid, signal.SIGKILL)
    text = str(_died(victim.pid.remote()))
    assert re.search(rf"the actor died \(Victim pid {pid}\): no fatal error in its log: killed by SIGKILL or "
                     r"os\._exit \(the kernel's OOM killer\? memory available: \d+ MiB\)$", text), text
    with pytest.raises(ray.exceptions.RayActorError) as raw:  # a bare ray.get, as the CLI's start-up makes
        ray.get(victim.pid.remote(), timeout=TIMEOUT_S)
    message, code = describe(died_error(raw.value))
    assert code == 1 and message.startswith(f"actor Victim: a call failed: ActorDiedError: the actor died (Victim "
                                            f"pid {pid}): no fatal error"), message


def _memory_cgroup() -> Path | None:
    """Where a fresh memory cgroup may be made (the v1 ``memory`` hierarchy, or a v2 root whose children
    get the memory controller), or ``None``."""
    v1, v2 = Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup")
    if (v1 / "memory.limit_in_bytes").exists() and os.access(v1, os.W_OK):
        return v1 / f"weightsync-test-{os.getpid()}"
    if "memory" in _read(v2 / "cgroup.subtree_control").split() and os.access(v2, os.W_OK):
        return v2 / f"weightsync-test-{os.getpid()}"
    return None


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root (a memory cgroup and the kernel log)"
    if subprocess.run(["dmesg"], capture_output=True, timeout=5).returncode != 0:
        return "the kernel log (dmesg) is not readable"
    if _memory_cgroup() is None:
        return "no writable memory cgroup (v1 memory hierarchy or v2 with the memory controller)"
    return None


@pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))
def test_kernel_oom_kill_in_a_small_cgroup_is_named_from_the_kernel_log(ray_local):
    """Only the actor is confined (256 MiB more than it holds); the machine's memory is never touched."""
    victim, pid = _started()
    cgroup = _memory_cgroup()
    cgroup.mkdir()
    try:
        limit = "memory.limit_in_bytes" if (cgroup / "memory.limit_in_bytes").exists() else "memory.max"
        (cgroup / limit).write_text(str(256 << 20))
        (cgroup / "cgroup.procs").write_text(str(pid))
        text = str(_died(victim.allocate.remote(2048)))
    finally:
        _remove(cgroup)
    assert f"the actor died (Victim pid {pid}): killed by the kernel's OOM killer (dmesg: " in text, text
    assert f"Killed process {pid} " in text, text


def _remove(cgroup: Path) -> None:
    """rmdir once the killed process left it (bounded: ~5 s)."""
    import time

    for _ in range(50):
        try:
            cgroup.rmdir()
            return
        except OSError:
            time.sleep(0.1)


SMALL_TMPFS_SENDER = """
import sys
from sync_service.transports import TransportSpec, shm
from protocols.interfaces import TransportError
shm.SHM_DIR = sys.argv[1]  # a 1 MiB tmpfs: this child's shared-memory directory
try:
    shm.ShmSender(TransportSpec(kind="shm", name="full", bucket_bytes=4 << 20), 0)
except TransportError as exc:
    print(exc)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mounts a 1 MiB tmpfs)")
def test_a_full_shm_dir_is_an_error_at_open_not_a_sigbus_in_the_writer(tmp_path):
    """The ring writer of a segment that does not fit its tmpfs (a child process: before, it died of SIGBUS)."""
    from tests.ray_session import ROOT

    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(tmp_path)], capture_output=True,
                      timeout=10).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        done = subprocess.run([sys.executable, "-c", SMALL_TMPFS_SENDER, str(tmp_path)], capture_output=True,
                              text=True, timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
        left = os.listdir(tmp_path)
    finally:
        subprocess.run(["umount", str(tmp_path)], timeout=10)
    assert done.returncode == 0, f"the writer died (status {done.returncode}): {done.stderr[-1000:]}"
    assert re.fullmatch(rf"shm segment {tmp_path}/weightsync-full-s0: \d+ MiB do not fit in {tmp_path} \(\d+ MiB "
                        r"free\): No space left on device; free .*\n", done.stdout), done.stdout
    assert left == [], left
