"""``weightsync sync --base <block-FP8 dir>`` through the console script: the trainer reads the FP8 base
dequantized (``merge.fp8_base``); the engines load that same FP8 checkpoint (the default ``--engine-base``) or a
bf16 one (``--engine-base``, the preflight comparing the FP8 base as the trainers read it), and the run's own
verifier judges every byte (FP8 values and scales: transformers' ``Fp8Quantize``) against PEFT's float64 merge over
transformers' dequantized load (``verify.peft_oracle``: ``FineGrainedFP8Config(dequantize=True)``)."""

from __future__ import annotations

import json

import pytest

from sync_service.merge.export import merge_checkpoint
from sync_service.merge.export_fp8 import Fp8Options
from sync_service.synthetic import make_adapter, make_base
from tests.cli.test_cli_subprocess import weightsync


@pytest.fixture(scope="module")
def fp8_base(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8_base_cli")
    base = make_base("qwen3_moe", root / "bf16", dtype="bfloat16")
    other = make_adapter("qwen3_moe", base, root / "other", kind="target_parameters", r=2, init_scale=0.3, seed=7)
    merge_checkpoint(base, other, root / "fp8", quantize="fp8", fp8=Fp8Options(weight_block_size=(16, 16)), progress=False)
    return root / "fp8", make_adapter("qwen3_moe", base, root / "lora", kind="target_parameters", r=2, seed=1), base


@pytest.mark.parametrize("engine_base, to", [(None, "float8_e4m3fn"), ("bf16", "bfloat16")])
def test_sync_from_an_fp8_base_verifies_bitwise(fp8_base, tmp_path, engine_base, to):
    fp8, lora, bf16 = fp8_base
    out = tmp_path / "run.json"
    extra = ["--engine-base", str(bf16)] if engine_base else []
    rc, err, _ = weightsync(["sync", "--base", str(fp8), "--adapter", str(lora), "--ep", "1", "--engines", "1", *extra,
                             "--versions", "2", "--accumulate-dtype", "float64", "--json", str(out)], ray_allowed=True)
    assert rc == 0, err[-3000:]
    # stderr is a pipe here: one log line per phase (issue: nothing was printed off a terminal before the table)
    phases = [ln.split(": ", 2)[2].rsplit(" (", 1)[0] for ln in err.splitlines() if ln.startswith("weightsync sync: step ")]
    assert phases == ["starting a local Ray (2 CPUs)",
                      "starting 1 trainer shard(s) (ep=1, tp=1) and 1 engine(s)",
                      "planning, validating the plan against every engine",
                      "version 0: training step, push", "version 0: verify",
                      "version 1: training step, push", "version 1: verify"], err[-3000:]
    doc = json.loads(out.read_text())
    assert doc["ok"] and len(doc["versions"]) == 2
    for row in doc["versions"]:
        # the base's 4 FP8 tensors, read dequantized and requantized; its bf16 experts (I = 8 is no block multiple)
        # stay bf16 — the case where transformers' FP8 load keeps them bf16 and the oracle needs plain_float64
        assert row["dtype_conversions"] == {f"float32->{to}": 4}, row
        (engine,) = row["engines"]
        assert engine["verified"] and engine["weights_bitwise"] and engine["generations_equal"], engine
