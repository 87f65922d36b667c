"""Endpoint handles between the ranks of one job (a TRL run's rank 0 gathers them): ``handle_to_bytes`` /
``handle_from_bytes`` round-trip a real Ray actor handle, and anything else a peer could send is refused
before it is built (no class or callable outside the handle's own is resolved)."""

from __future__ import annotations

import os
import pickle
import struct

import pytest

from sync_service.live.handle import EndpointHandle, handle_from_bytes, handle_to_bytes
from tests.trainer.conftest import ray


@ray.remote(num_cpus=0)
class Rank:
    def ping(self) -> int:
        return os.getpid()


class _Reduces:
    def __init__(self, fn, args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def test_a_handle_round_trips_and_other_pickles_are_refused(ray_local):
    actor = Rank.remote()
    back = handle_from_bytes(handle_to_bytes(EndpointHandle(actor=actor, endpoint_id="trainer1-ab", rank=1, world=2)))
    assert (back.endpoint_id, back.rank, back.world) == ("trainer1-ab", 1, 2)
    assert ray.get(back.actor.ping.remote(), timeout=60) == ray.get(actor.ping.remote(), timeout=60)
    with pytest.raises(ValueError, match=r"does not refer to (posix|os)\.system"):
        handle_from_bytes(pickle.dumps(_Reduces(os.system, ("true",))))
    with pytest.raises(ValueError, match="does not read attribute '__init__'"):
        handle_from_bytes(pickle.dumps(_Reduces(getattr, (EndpointHandle, "__init__"))))
    with pytest.raises(ValueError, match="not a weightsync endpoint handle: int"):
        handle_from_bytes(pickle.dumps(3))
    with pytest.raises(ValueError, match="not a weightsync endpoint handle"):
        handle_from_bytes(b"garbage")
    with pytest.raises(ValueError, match="memo index 400000000"):  # 9 bytes that would make pickle allocate GBs
        handle_from_bytes(b"\x80\x04N" + b"r" + struct.pack("<I", 400_000_000) + b".")
    with pytest.raises(ValueError, match="at most 65536"):
        handle_from_bytes(b"\x80" * (1 << 17))


def test_engine_rollout_func_names_every_bad_argument_at_once():
    from sync_service.integrations.trl import engine_rollout_func

    with pytest.raises(ValueError, match=r"engines=\[None\]: a non-empty list of RolloutEngine actors; "
                                         r"max_new_tokens=1.5: an int in \[1, 2\*\*20\]; timeout_s=None: a finite"):
        engine_rollout_func([None], max_new_tokens=1.5, timeout_s=None)
    with pytest.raises(ValueError, match="engines=None"):
        engine_rollout_func(None, max_new_tokens=4)
