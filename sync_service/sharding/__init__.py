"""Trainer-side sharding as training frameworks shard: expert parallel and tensor parallel (FSDP2's
DTensor dim-0 shards of a live model: ``sync_service/live/base.py``).

``ShardSpec`` + ``rules.py`` say which global boxes a rank holds; ``ShardedBase`` serves global
boxes from the rank's local tensors (a ``BaseProvider``); ``ep_factors.py`` all-gathers LoRA factors
(never the base) so each rank can merge its own base shard.
"""

from sync_service.sharding.base import ShardedBase, load_shard, shard_tensors
from sync_service.sharding.ep_factors import gather_factors, local_factors
from sync_service.sharding.rules import Piece, ShardSpec, shard_pieces

__all__ = ["Piece", "ShardSpec", "ShardedBase", "gather_factors", "load_shard", "local_factors",
           "shard_pieces", "shard_tensors"]
