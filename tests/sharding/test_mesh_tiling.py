"""Trainer ranks on different meshes are refused as such before any engine is compared with their plan: the
refusal named the engine's model ('load the engine from the same model family/size'). Real ranks' boxes
(``sharding.base.load_shard`` over a real checkpoint, what ``load_rank`` holds, each with its own ``ShardSpec``), checked by the planning step every
``WeightSync`` runs first (``planning.engine_dtypes`` → ``tiling.check_tiling``)."""

from __future__ import annotations

import pytest

from protocols.params import ParamMeta
from sync_service.coordinator.planning import engine_dtypes
from sync_service.coordinator.tiling import TrainerMeshError, check_tiling
from sync_service.merge.fp8_base import open_base
from sync_service.sharding.base import load_shard
from sync_service.sharding.rules import ShardSpec
from sync_service.synthetic import make_base


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_base("qwen3_moe", tmp_path_factory.mktemp("mesh") / "base", num_layers=1)


def owned(base, specs) -> list[list[ParamMeta]]:
    return [list(load_shard(open_base(base), spec).owned()) for spec in specs]


@pytest.mark.parametrize("ep,tp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_ranks_on_one_mesh_tile_every_tensor(base, ep, tp):
    ranks = owned(base, [ShardSpec(rank=r, ep=ep, tp=tp) for r in range(ep * tp)])
    check_tiling(ranks)
    engine_dtypes(ranks, {})


@pytest.mark.parametrize("specs,fragment", [
    # rank 0 thinks ep=2; rank 1 thinks tp=2: experts overlap, attention rows overlap
    ((ShardSpec(rank=0, ep=2), ShardSpec(rank=1, ep=1, tp=2)), "overlap"),
    # both think they are rank 0 of ep=2: the first half of the experts twice
    ((ShardSpec(rank=0, ep=2), ShardSpec(rank=0, ep=2)), "overlap"),
    # a 2-rank job where rank 1 believes it is rank 3 of ep=4: expert 2 nobody sends
    ((ShardSpec(rank=0, ep=2), ShardSpec(rank=3, ep=4)), "cover"),
])
def test_ranks_on_different_meshes_are_named_as_such(base, specs, fragment):
    ranks = owned(base, specs)
    with pytest.raises(TrainerMeshError) as err:
        engine_dtypes(ranks, {})
    text = str(err.value)
    assert text.startswith("trainer ranks' boxes of ") and fragment in text, text
    assert "the trainer ranks disagree on the mesh" in text and "same model family" not in text, text


def test_different_whole_shapes_are_named_with_both_ranks():
    a = ParamMeta("w", "float32", (4, 4), ((0, 2), (0, 4)))
    b = ParamMeta("w", "float32", (6, 4), ((2, 6), (0, 4)))
    with pytest.raises(TrainerMeshError, match=r"rank 0 holds it as \[4, 4\], rank 1 as \[6, 4\]"):
        check_tiling([[a], [b]])
