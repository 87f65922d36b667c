"""``attach_megatron``: a live Megatron-Core model with Megatron-Bridge LoRA on 4 Ray-actor ranks (one gloo group:
dense layers TP=2 x DP=2, experts EP=2 x expert-TP=2) pushed by ``WeightSync`` into a transformers engine, full then
delta. The oracle is Megatron's own forward of the unmerged LoRA model at the ranks' parallelism (none of
weightsync's code): the engine's teacher-forced next-token log-probabilities of a fixed sequence equal Megatron's
within ``BOUND`` (fp32) and its argmax tokens are Megatron's. Between the versions of the main test the adapters change
by a real training step (``megatron_train.AdapterTrainer``: Megatron's forward / backward on an LM loss, AdamW); the
other tests change them by a seeded draw on every rank (``randomize_adapters``: each global adapter tensor drawn from
its key, replicas equal)."""

from __future__ import annotations

import pytest
import ray
import torch

BOUND = 1e-5  # fp32 log-probabilities, two implementations of one function (measured 8.5e-7, 2026-12-05)
MESH = {"world": 4, "tp": 2, "ep": 2, "etp": 2}


@pytest.fixture(scope="module")
def megatron(ray_local, hf_model):
    from sync_service.entrypoints.megatron_rank import start_megatron_ranks

    ranks, mesh = start_megatron_ranks(str(hf_model), **MESH, seed=0, timeout_s=600)
    handles = ray.get([r.attach.remote() for r in ranks], timeout=300)
    yield {"ranks": ranks, "handles": handles, "mesh": mesh, "hf": hf_model}
    for r in ranks:
        ray.kill(r)


def megatron_logprobs(ranks) -> torch.Tensor:
    """Megatron's forward (all ranks; the last stage's answer) as float64 next-token log-probabilities [s-1, V]."""
    logits = [x for x in ray.get([r.logits.remote() for r in ranks], timeout=300) if x is not None][0][0]
    return torch.log_softmax(torch.from_numpy(logits.copy()).double(), -1)[:-1]


def engine_logprobs(engine) -> tuple[torch.Tensor, int | None]:
    from sync_service.entrypoints.megatron_rank import TOKENS

    (lp,), version = ray.get(engine.token_logprobs.remote([TOKENS[0].tolist()]), timeout=120)
    return torch.from_numpy(lp.copy()).double(), version


def assert_serves_megatron(engine, ranks, version: int) -> float:
    want = megatron_logprobs(ranks)
    got, served = engine_logprobs(engine)
    worst = (got - want).abs().max().item()
    assert served == version and worst <= BOUND, (served, worst)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    return worst


def reseed(ranks, seed: int) -> None:
    ray.get([r.randomize_adapters.remote(seed) for r in ranks], timeout=120)


def _make_trainer(rank) -> None:
    from sync_service.entrypoints.megatron_train import AdapterTrainer

    rank.trainer = AdapterTrainer(rank.model)


def _train_step(rank) -> float:
    return rank.trainer.step()


_TRAINERS: set[tuple[str, ...]] = set()
"""The rank sets that made their ``AdapterTrainer`` (once per set of actors)."""


def train_step(ranks) -> float:
    """One AdamW step on every rank (collective); the loss before it."""
    key = tuple(r._actor_id.hex() for r in ranks)
    if key not in _TRAINERS:
        ray.get([r.__ray_call__.remote(_make_trainer) for r in ranks], timeout=300)
        _TRAINERS.add(key)
    return ray.get([r.__ray_call__.remote(_train_step) for r in ranks], timeout=300)[0]


def test_full_then_delta_serve_megatrons_own_forward(megatron):
    from actors.launch import start_engines
    from sync_service.api import SyncConfig, WeightSync

    ranks = megatron["ranks"]
    assert megatron["mesh"] == {"tp": 2, "ep": 2, "etp": 2, "pp": 1, "dp": 2}
    (engine,) = start_engines(megatron["hf"], 1, prefix="mhf")
    base_lp, _ = engine_logprobs(engine)
    sync = WeightSync(trainers=megatron["handles"], engines=[engine], config=SyncConfig(transport="shm", timeout_s=120))
    try:
        # every engine box is sent by exactly one rank
        owned = [m for h in megatron["handles"] for m in ray.get(h.owned_metas.remote(), timeout=60)]
        table = ray.get(engine.param_metas.remote(), timeout=60)
        assert sum(m.nbytes for m in owned) == sum(m.nbytes for m in table)
        assert {m.name for m in owned} == {m.name for m in table}
        full = sync.push(0)
        assert full.full and full.engines[0].committed
        print("v0 full", assert_serves_megatron(engine, ranks, 0))
        before = megatron_logprobs(ranks)
        assert (before - base_lp).abs().max() > 0.05  # the LoRA changes the function
        for v in (1, 2):
            loss = train_step(ranks)
            m = sync.push(v)
            assert not m.full and m.bytes < full.bytes and m.engines[0].committed
            print(f"v{v} delta after a step at loss {loss:.4f}", assert_serves_megatron(engine, ranks, v))
            now = megatron_logprobs(ranks)
            assert (now - before).abs().max() > 1e-3  # the step moved the function
            before = now
    finally:
        sync.close()
        ray.kill(engine)


def test_factor_mode_the_engine_merges_what_megatron_computes(megatron):
    """``SyncConfig(mode="factors")``: the ranks send the pristine base once and their LoRA terms per version (each
    rank's own: x = linear_out rows, y = linear_in columns; ETP x its own rows on the experts' linear_fc2), the engine
    merges; full, then a delta after a training step, each equal to Megatron's forward."""
    from actors.launch import start_engines
    from sync_service.api import SyncConfig, WeightSync

    ranks = megatron["ranks"]
    (engine,) = start_engines(megatron["hf"], 1, prefix="mfac")
    sync = WeightSync(trainers=megatron["handles"], engines=[engine],
                      config=SyncConfig(transport="shm", mode="factors", timeout_s=120))
    try:
        for v in (0, 1):
            if v:
                train_step(ranks)
            m = sync.push(v)
            assert m.full == (v == 0) and m.engines[0].committed
            assert any("experts.down_proj" in n for n in m.factor_tensors), m.factor_tensors
            print(f"factors v{v}", assert_serves_megatron(engine, ranks, v))
    finally:
        sync.close()
        ray.kill(engine)


def _set_rule(table: dict):
    def body(_actor, table):
        from sync_service.megatron import deviations

        deviations.EXPERT_FC2_AT_ETP.clear()
        deviations.EXPERT_FC2_AT_ETP.update(table)
    return body, table


def test_the_bridge_rule_is_what_megatron_computes_and_unknown_versions_are_refused(megatron):
    """Expert-TP 2: serving W + s·B@A on the experts' linear_fc2 (not Bridge 0.6.2's block-diagonal forward) would
    serve a policy the trainer does not run; a Bridge version the table does not know is refused at attach."""
    from actors.launch import start_engines
    from sync_service.api import SyncConfig, WeightSync
    from sync_service.megatron.deviations import EXPERT_FC2_AT_ETP, bridge_version

    ranks, version = megatron["ranks"], bridge_version()
    known = dict(EXPERT_FC2_AT_ETP)
    try:
        ray.get([r.__ray_call__.remote(*_set_rule({})) for r in ranks], timeout=60)
        errors = []
        for ref in [r.attach.remote() for r in ranks]:
            with pytest.raises(Exception) as info:
                ray.get(ref, timeout=120)
            errors.append(str(info.value))
        for err in errors:  # every rank: one line naming the version and the deviation
            assert any(f"Megatron-Bridge {version} at expert-TP 2" in x and "blockdiag" in x and "refused" in x
                       for x in err.splitlines()), err
        ray.get([r.__ray_call__.remote(*_set_rule({version: "dense"})) for r in ranks], timeout=60)
        handles = ray.get([r.attach.remote() for r in ranks], timeout=120)
        (engine,) = start_engines(megatron["hf"], 1, prefix="mdense")
        sync = WeightSync(trainers=handles, engines=[engine], config=SyncConfig(transport="shm", timeout_s=120))
        try:
            sync.push(0)
            got, _ = engine_logprobs(engine)
            off = (got - megatron_logprobs(ranks)).abs().max().item()
            print("dense rule at expert-TP 2 off by", off)
            assert off > 1e-2
        finally:
            sync.close()
            ray.kill(engine)
    finally:
        ray.get([r.__ray_call__.remote(*_set_rule(known)) for r in ranks], timeout=60)


def _nudge(_actor, name: str, by: float = 1e-3):
    import torch as t

    with t.no_grad():
        for chunk in _actor.model:
            for n, p in chunk.named_parameters():
                if n == name:
                    p.add_(by)


def test_replicas_that_disagree_fail_the_push_on_every_engine(megatron):
    """Rank 2 holds a data-parallel replica of rank 0's dense adapter shards: one drifted value fails the push
    (named), the engine keeps serving the version before; so does a drifted layer norm (replicated on every rank)."""
    from actors.launch import start_engines
    from sync_service.api import SyncConfig, WeightSync
    from sync_service.coordinator.metrics import SyncError

    ranks = megatron["ranks"]
    reseed(ranks, 21)
    (engine,) = start_engines(megatron["hf"], 1, prefix="mrep")
    sync = WeightSync(trainers=megatron["handles"], engines=[engine], config=SyncConfig(transport="shm", timeout_s=120))
    name = "decoder.layers.0.self_attention.linear_qkv.adapter.linear_out.weight"
    try:
        sync.push(0)
        ray.get(ranks[2].__ray_call__.remote(_nudge, name), timeout=60)
        with pytest.raises(SyncError, match="replicas disagree") as info:
            sync.push(1)
        assert "linear_qkv.adapter.linear_out" in str(info.value) and "[0] vs [2]" in str(info.value)
        assert ray.get(engine.weight_version.remote(), timeout=60) == 0
        reseed(ranks, 21)
        sync.push(2)
        assert_serves_megatron(engine, ranks, 2)
        norm = "decoder.layers.1.input_layernorm.weight"  # replicated on all 4 ranks (TP and DP): checked every push
        ray.get(ranks[1].__ray_call__.remote(_nudge, norm), timeout=60)
        try:
            with pytest.raises(SyncError, match="replicas disagree") as info:
                sync.push(3)
            assert "input_layernorm" in str(info.value) and "[0, 2, 3] vs [1]" in str(info.value), str(info.value)
        finally:
            ray.get(ranks[1].__ray_call__.remote(_nudge, norm, -1e-3), timeout=60)
        assert ray.get(engine.weight_version.remote(), timeout=60) == 2
    finally:
        sync.close()
        ray.kill(engine)


def _grouped_gemm_weight(_actor, add: bool):
    """Give layer 0's experts a parameter named as Transformer Engine's grouped-GEMM experts hold them
    (``mlp.experts.linear_fc1.weight0``), or take it away: that layout cannot be built on CPU (TE only), so the test
    names one parameter as it would be named."""
    import torch as t

    experts = _actor.model[0].decoder.layers[0].mlp.experts
    if add:
        experts.linear_fc1 = t.nn.Module()
        experts.linear_fc1.register_parameter("weight0", t.nn.Parameter(t.zeros(32, 32), requires_grad=False))
    else:
        del experts.linear_fc1


def test_grouped_gemm_experts_are_refused_at_attach_on_every_rank(megatron):
    ranks = megatron["ranks"]
    ray.get(ranks[1].__ray_call__.remote(_grouped_gemm_weight, True), timeout=60)
    try:
        refs = [r.attach.remote() for r in ranks]
        for ref in refs:
            with pytest.raises(Exception) as info:
                ray.get(ref, timeout=120)
            assert any("rank 1 refused" in x and "decoder.layers.0.mlp.experts.linear_fc1.weight0" in x
                       and "grouped-GEMM" in x for x in str(info.value).splitlines()), str(info.value)
    finally:
        ray.get(ranks[1].__ray_call__.remote(_grouped_gemm_weight, False), timeout=60)


def test_endpoint_calls_one_by_one_return_the_declared_reports(megatron):
    """The endpoint contract (``protocols.endpoints``; ``tests/conformance/test_endpoints.py`` checks the signatures)
    driven call by call over the 4 Megatron ranks as the coordinator drives it: one sync of version 1."""
    import uuid

    from actors.launch import start_engines
    from protocols.endpoints import FactorCost, OpenChannel, SendReport, SendRequest, SnapshotReport
    from protocols.params import ParamMeta
    from protocols.wire import encode
    from sync_service.coordinator import build_sync_plan
    from sync_service.transports import TransportSpec

    handles = megatron["handles"]
    (engine,) = start_engines(megatron["hf"], 1, prefix="mconf", engine="memory")
    owner = "megatron-conformance"
    try:
        owned = ray.get([h.owned_metas.remote() for h in handles], timeout=60)
        assert all(type(m) is ParamMeta for metas in owned for m in metas)
        plan = build_sync_plan([list(o) for o in owned], bucket_bytes=1 << 20)
        spec = TransportSpec(kind="shm", name="mc" + uuid.uuid4().hex[:8], num_senders=len(handles), num_receivers=1,
                             bucket_bytes=plan.bucket_bytes, connect_timeout_s=60, op_timeout_s=60)
        snaps = ray.get([h.snapshot.remote(1) for h in handles], timeout=60)
        assert all(type(s) is SnapshotReport and s.version == 1 for s in snaps)
        assert all(s.changed and all(".layers." in n for n in s.changed) for s in snaps)  # pushed before: a delta's names
        request = SendRequest(owner=owner, session="s1", version=1, names=None, timeout_s=60.0)
        with pytest.raises(Exception, match="send before open_transport"):
            ray.get(handles[0].send.remote(request), timeout=60)
        ray.get([a.open_transport.remote(OpenChannel(owner=owner, spec=spec.to_bytes(), plan=encode(plan), index=k))
                 for k, a in (*enumerate(handles), (0, engine))], timeout=120)
        received = engine.receive.remote(owner, 60.0)
        sent = ray.get([h.send.remote(request) for h in handles], timeout=120)
        got = ray.get(received, timeout=60)
        assert all(type(s) is SendReport for s in sent)
        assert got.version == 1 and got.payload_bytes == sum(s.payload_bytes for s in sent)
        ray.get(engine.commit.remote(owner, 1), timeout=60)
        assert ray.get(engine.weight_version.remote(), timeout=60) == 1
        costs = ray.get(handles[0].factor_costs.remote(), timeout=60)  # the planning rank knows every rank's terms
        assert costs and all(type(c) is FactorCost for c in costs)
        assert {c.name for c in costs} == {n for s in snaps for n in s.changed}
        ray.get([a.close_transport.remote(owner) for a in (*handles, engine)], timeout=60)
    finally:
        ray.kill(engine)


@pytest.fixture(scope="module")
def engine_dirs(hf_model, tmp_path_factory):
    """The HF model in bf16 and in block FP8 (8x8 blocks: they divide the TP=2 / expert-TP=2 shards; bf16 elsewhere),
    written by ``merge_checkpoint`` with no adapter."""
    from sync_service.merge.export import merge_checkpoint
    from sync_service.merge.export_fp8 import Fp8Options

    root = tmp_path_factory.mktemp("mdtypes")
    merge_checkpoint(hf_model, None, root / "bf16", dtype="bfloat16", progress=False)
    merge_checkpoint(hf_model, None, root / "fp8", quantize="fp8", fp8=Fp8Options(weight_block_size=FP8_BLOCK),
                     progress=False)
    return {"bfloat16": root / "bf16", "fp8": root / "fp8"}


FP8_BLOCK = (8, 8)
BF16_BOUND = 0.1  # bf16 engine vs Megatron's fp32 forward: the weights' one bf16 rounding and bf16 compute (measured 0.018-0.033)


def served(engine) -> dict[str, torch.Tensor]:
    from sync_service.dtypes import TORCH_DTYPES

    sw = ray.get(engine.served_weights.remote(None, True), timeout=120)
    return {t.name: torch.frombuffer(bytearray(t.values), dtype=TORCH_DTYPES[t.dtype]).reshape(t.shape)
            for t in sw.tensors}


def _quantized(name: str, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' Fp8Quantize of ``values`` (per expert for a fused [E, N, K] tensor): (FP8 values, scales)."""
    from sync_service.verify.fp8_oracle import transformers_quantize

    if values.dim() == 3:
        parts = [_quantized(name, v) for v in values]
        return torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
    out = transformers_quantize(name, values, FP8_BLOCK)
    scale = next(v for k, v in out.items() if k != name)
    return out[name], scale


def test_bf16_and_block_fp8_engines_serve_the_verified_weights_cast_once(megatron, engine_dirs):
    """The fp32 engine's weights are Megatron's function (its forward, above); a bf16 engine serves them cast once to
    bf16 (bitwise), a block-FP8 engine serves transformers' own Fp8Quantize of them (<= one FP8 step, >= 99.9 %
    bitwise; scales within an fp32 ulp), bf16 elsewhere. Full, then a delta after a seeded adapter change."""
    from actors.launch import start_engines
    from sync_service.api import SyncConfig, WeightSync
    from sync_service.dtypes import TORCH_DTYPES

    ranks = megatron["ranks"]
    (fp32,) = start_engines(megatron["hf"], 1, prefix="m32")
    (bf16,) = start_engines(engine_dirs["bfloat16"], 1, prefix="m16")
    (fp8,) = start_engines(engine_dirs["fp8"], 1, prefix="m8")
    syncs = [WeightSync(trainers=megatron["handles"], engines=[e], config=SyncConfig(transport="shm", timeout_s=120))
             for e in (fp32, bf16, fp8)]
    try:
        table = {m.name: m for m in ray.get(fp8.param_metas.remote(), timeout=60)}
        quantized = sorted(n for n, m in table.items() if m.dtype == "float8_e4m3fn")
        assert len(quantized) >= 4, quantized
        for v, seed in ((0, None), (1, 31)):
            if seed is not None:
                reseed(ranks, seed)
            ms = [s.push(v) for s in syncs]
            assert all(m.full == (v == 0) and m.engines[0].committed for m in ms)
            assert_serves_megatron(fp32, ranks, v)
            want = served(fp32)
            got16 = served(bf16)
            assert got16.keys() == want.keys()
            assert all(torch.equal(got16[k], want[k].to(torch.bfloat16)) for k in want), "bf16: not one cast"
            lp, _ = engine_logprobs(bf16)
            off = (lp - megatron_logprobs(ranks)).abs().max().item()
            print(f"v{v} bf16 engine vs Megatron fp32 forward", off)
            assert off <= BF16_BOUND
            got8 = served(fp8)
            equal = total = 0
            for name in quantized:
                values, scales = _quantized(name, want[name])
                scale_name = next(k for k in got8 if k.startswith(name.removesuffix(".weight")) and "scale" in k)
                code = lambda t: t.contiguous().view(torch.uint8).to(torch.int32)  # noqa: E731
                steps = (torch.where(code(got8[name]) >= 128, 128 - code(got8[name]), code(got8[name]))
                         - torch.where(code(values) >= 128, 128 - code(values), code(values))).abs()
                assert int(steps.max()) <= 1, name
                equal, total = equal + int((steps == 0).sum()), total + steps.numel()
                torch.testing.assert_close(got8[scale_name].float(), scales.float(), rtol=1e-6, atol=0)
            assert equal / total >= 0.999, (equal, total)
            rest = [k for k in want if k not in quantized]
            assert all(torch.equal(got8[k], want[k].to(TORCH_DTYPES[table[k].dtype])) for k in rest)
    finally:
        for s in syncs:
            s.close()
        for e in (fp32, bf16, fp8):
            ray.kill(e)


def test_a_wrong_alpha_or_hf_config_is_refused_on_every_rank_in_one_line(megatron):
    import json

    ranks = megatron["ranks"]
    config = json.loads((megatron["hf"] / "config.json").read_text())
    cases = (({"lora_alpha": 3}, "lora_alpha=3 differs from"),
             ({"hf_config": {**config, "moe_intermediate_size": 32}}, "mlp.experts.gate_up_proj [4, 32, 32], which the "
                                                                       "HF model of hf_config holds as [4, 64, 32]"))
    for kw, needle in cases:
        refs = [r.attach.remote(**kw) for r in ranks]
        for ref in refs:
            with pytest.raises(Exception) as info:
                ray.get(ref, timeout=120)
            assert any("attach_megatron: rank 0 (and 3 more) refused" in x and needle in x
                       for x in str(info.value).splitlines()), str(info.value)


def _gathered_keys(_actor, endpoint_id: str) -> dict[str, list[str]]:
    from sync_service.live.handle import lookup

    state = lookup(endpoint_id).state
    return {kind: sorted({k.split(".", 3)[3] if k.startswith("decoder.layers.") else k for k in g.keys})
            for kind, g in state.gathers.items()}


def test_factors_are_gathered_only_where_the_split_requires_it(megatron):
    """TP=2 splits Bridge's linear_in of the column-parallel linear_qkv (on dim) and linear_out of the row-parallel
    linear_proj (on out): those are gathered within the TP group; expert-TP=2 splits the experts' fc1 linear_in:
    gathered within the expert-TP group; nothing else (the experts' fc2 serves each rank's own blocks), and only by
    the ranks that send those boxes."""
    got = ray.get([r.__ray_call__.remote(_gathered_keys, h.endpoint_id)
                   for r, h in zip(megatron["ranks"], megatron["handles"])], timeout=60)
    dense = ["self_attention.linear_proj.adapter.linear_out.weight", "self_attention.linear_qkv.adapter.linear_in.weight"]
    assert [rank["dense"] for rank in got] == [dense, dense, [], []]  # data-parallel rank 1 sends no dense box
    for rank in got:
        assert {k.split(".", 4)[-1] for k in rank["expert"]} == {"linear_fc1.adapter.linear_in.weight"}, rank
