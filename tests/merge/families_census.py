"""Every MoE family of the installed transformers, merged or refused: the census behind the README's table.

One process, no Ray, no CLI. For each candidate of ``sync_service.synthetic.census`` (transformers' causal-LM
and image-text-to-text classes whose config names routed experts):
1. build its tiny config and model on CPU (float32, seeded weights); a family whose model holds no 3D
   (fused experts) parameter at that config is no MoE family and is left out;
2. derive its layout row (``layout_for``); write the base with ``save_pretrained``; make a PEFT LoRA adapter
   on the decoder's attention projections plus ``target_parameters`` on the fused expert tensors;
3. merge it with ``merge_checkpoint`` (target ``hf``) and compare every tensor with PEFT's own
   ``merge_and_unload`` in float64, cast once (``values_match``: the oracle's fp32-accumulation bound).

Verdicts: ``supported`` (every tensor within the bound), ``refused`` (a ``MergeError`` naming the family and
why, or "transformers cannot build it on CPU at a tiny config: <error>"), ``peft`` (PEFT itself cannot put
LoRA on it, so there is no oracle), ``untested`` (its tiny config still exceeds ``MAX_PARAMS``: a sub-config
the census does not shrink) and ``wrong`` (a merge differs from PEFT: a bug, the test fails).

The verdicts of each pinned version set (transformers and peft of ``constraints/cpu.txt``, this machine's
``.venv``, and of ``constraints/newest.txt``, the ``.venv-newest`` that ``.ci/run`` builds) are recorded in
``census_verdicts.json``; the README table shows them side by side. Record the installed set's verdicts and
rewrite the README table, in each venv::

    python -m tests.merge.families_census --write
    .venv-newest/bin/python -m tests.merge.families_census --write
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

MAX_PARAMS = 5_000_000  # a tiny model; more means a sub-config the census did not shrink
README = Path(__file__).parents[2] / "README.md"
RECORDED = Path(__file__).with_name("census_verdicts.json")
CONSTRAINTS = [Path(__file__).parents[2] / "constraints" / f for f in ("cpu.txt", "newest.txt")]
BEGIN, END = "<!-- moe-census:begin (python -m tests.merge.families_census --write) -->", "<!-- moe-census:end -->"


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the census found for one family.

    Attributes:
        model_type: transformers ``model_type``.
        model_class: the transformers class built.
        status: ``"supported"``, ``"refused"``, ``"peft"``, ``"untested"`` or ``"wrong"`` (module docstring).
        reason: the refusal / failure, one line; ``""`` when supported.
        seconds: wall time of this family's build, merge and oracle.
    """

    model_type: str
    model_class: str
    status: str
    reason: str
    seconds: float


def _one_line(err: BaseException) -> str:
    return " ".join(f"{type(err).__name__}: {err}".split())[:160]


def _build(model_type: str, class_name: str):
    """(config, randomised fp32 model) of the family, or raises ``_Refused``."""
    import transformers

    from sync_service.synthetic.base import randomize_
    from sync_service.synthetic.census import tiny_config

    try:
        cls = getattr(transformers, class_name)
        config = tiny_config(model_type, cls)
        with torch.device("meta"):
            size = sum(p.numel() for p in cls._from_config(config).parameters())
        if size > MAX_PARAMS:
            raise _Refused("untested", f"its tiny config still has {size:,} parameters (a sub-config the census "
                                       f"does not shrink)")
        model = cls._from_config(config, dtype=torch.float32)
    except _Refused:
        raise
    except Exception as err:  # noqa: BLE001 - the census reports whatever transformers raises
        raise _Refused("refused", f"transformers cannot build it on CPU at a tiny config: {_one_line(err)}") from None
    randomize_(model, seed=0, scale=0.1)
    return model.config, model.train(False)


class _Refused(Exception):
    def __init__(self, status: str, reason: str) -> None:
        super().__init__(reason)
        self.status, self.reason = status, reason


def _experts(model) -> list[str]:
    """Names of the modules of decoder layers holding 3D parameters (fused experts; convolutions excluded)."""
    return [n for n, m in model.named_modules() if not isinstance(m, torch.nn.modules.conv._ConvNd)
            and re.search(r"(^|\.)layers\.\d+\.", n) and any(p.dim() == 3 for p in m.parameters(recurse=False))]


def _targets(model, experts: list[str], layout) -> tuple[list[str], list[str]]:
    """(attention ``nn.Linear`` names of the decoder holding the experts, the fused expert parameters)."""
    container = re.match(r"(.*\blayers\.)\d+\.", experts[0]).group(1)
    attention = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith(container)
                 and re.search(r"\.(self_attn|attention|attn|self_attention)\.", n)
                 and not re.search(r"(gate|up)_proj$", n)]  # gated attention's gate_proj: PEFT maps it to experts
    params = [f"{layout.experts_module}.{p}" for p in layout.expert_params if not p.endswith("bias")]
    params += [f"{path}.weight" for path in layout.weight_experts]
    return attention, params


def _adapter(model, base_dir: Path, out: Path, attention: list[str], params: list[str]) -> Path:
    from peft import LoraConfig, get_peft_model

    from sync_service.synthetic.adapters import _randomize_adapter_

    config = LoraConfig(r=2, lora_alpha=6, target_modules=attention or None, target_parameters=params,
                        base_model_name_or_path=str(base_dir))
    try:
        peft_model = get_peft_model(model, config)
    except Exception as err:  # noqa: BLE001 - PEFT's own limits are reported, not ours
        raise _Refused("peft", f"PEFT cannot put LoRA on it: {_one_line(err)}") from None
    _randomize_adapter_(peft_model, seed=7, init_scale=0.1)
    peft_model.save_pretrained(str(out))
    return out


def _compare(merged_dir: Path, base_dir: Path, adapter_dir: Path, tmp: Path) -> str:
    """``""`` if our merge equals PEFT's float64 merge within ``values_match``, else what differs."""
    from sync_service.verify.peft_oracle import values_match
    from tests.merge.conftest import peft_oracle, read_checkpoint

    try:
        want = peft_oracle(base_dir, adapter_dir, tmp / "oracle")
    except Exception as err:  # noqa: BLE001 - PEFT cannot merge what it built: no oracle
        raise _Refused("peft", f"PEFT cannot merge its own adapter: {_one_line(err)}") from None
    got = read_checkpoint(merged_dir)
    if got.keys() != want.keys():
        return f"names differ from PEFT's: {sorted(got.keys() ^ want.keys())[:3]}"
    bad = [n for n in want if not values_match(got[n], want[n])[0]]
    base = read_checkpoint(base_dir)
    if not any(not torch.equal(base[n], want[n]) for n in want if "expert" in n or "_linear" in n):
        return "the adapter changed no expert tensor (vacuous)"
    return f"{len(bad)} tensors differ from PEFT's merge, e.g. {bad[:3]}" if bad else ""


def census_files(model_type: str, class_name: str, root: Path) -> tuple[Path, Path]:
    """(base dir, adapter dir) of one family as the census builds them: the tiny fp32 model saved by
    ``save_pretrained``, a PEFT LoRA on its attention and ``target_parameters`` on its experts."""
    from sync_service.merge.derive import layout_for

    config, model = _build(model_type, class_name)
    layout = layout_for(config)
    model.save_pretrained(str(root / "base"))
    return root / "base", _adapter(model, root / "base", root / "lora", *_targets(model, _experts(model), layout))


def judge(model_type: str, class_name: str, tmp: Path) -> Verdict | None:
    """The verdict of one family (``None``: its model holds no fused experts at the tiny config)."""
    from sync_service.merge.derive import layout_for
    from sync_service.merge.errors import MergeError
    from sync_service.merge.export import merge_checkpoint

    start = time.perf_counter()
    try:
        config, model = _build(model_type, class_name)
        experts = _experts(model)
        if not experts:
            return None
        try:
            layout = layout_for(config)
            base_dir = tmp / "base"
            model.save_pretrained(str(base_dir))
            adapter_dir = _adapter(model, base_dir, tmp / "lora", *_targets(model, experts, layout))
            merge_checkpoint(base_dir, adapter_dir, tmp / "merged", target="hf", progress=False)
        except MergeError as err:
            raise _Refused("refused", str(err)) from None
        wrong = _compare(tmp / "merged", base_dir, adapter_dir, tmp)
        status, reason = ("wrong", wrong) if wrong else ("supported", "")
    except _Refused as refusal:
        status, reason = refusal.status, refusal.reason
    return Verdict(model_type=model_type, model_class=class_name, status=status, reason=reason,
                   seconds=time.perf_counter() - start)


def census() -> list[Verdict]:
    """The verdict of every MoE family of the installed transformers, sorted by model_type."""
    from sync_service.synthetic.census import candidates

    verdicts = []
    for model_type, class_name in candidates():
        with tempfile.TemporaryDirectory(prefix=f"census-{model_type}-") as tmp:
            verdict = judge(model_type, class_name, Path(tmp))
        if verdict is not None:
            verdicts.append(verdict)
    return sorted(verdicts, key=lambda v: v.model_type)


_SHOWN = {"supported": "✓ merged = PEFT", "refused": "refused", "peft": "no oracle", "untested": "untested",
          "wrong": "WRONG"}


def installed_set() -> str:
    """The installed transformers and peft, as the census records a version set."""
    import peft
    import transformers

    return f"transformers {transformers.__version__}, peft {peft.__version__}"


def pinned_sets() -> list[str]:
    """The version sets of ``constraints/cpu.txt`` and ``constraints/newest.txt``, in that order."""
    sets = []
    for path in CONSTRAINTS:
        pins = dict(line.split("==", 1) for line in path.read_text().splitlines() if "==" in line and line[0] != "#")
        sets.append(f"transformers {pins['transformers'].strip()}, peft {pins['peft'].strip()}")
    return list(dict.fromkeys(sets))


def as_record(verdicts: list[Verdict]) -> dict[str, dict[str, str]]:
    """model_type → its class, status and reason (what ``census_verdicts.json`` holds per version set)."""
    return {v.model_type: dict(model_class=v.model_class, status=v.status, reason=v.reason) for v in verdicts}


def recorded() -> dict[str, dict[str, dict[str, str]]]:
    """version set → ``as_record`` of its census, from ``census_verdicts.json``."""
    return json.loads(RECORDED.read_text()) if RECORDED.exists() else {}


def table(sets: dict[str, dict[str, dict[str, str]]]) -> str:
    """The markdown table (no markers): one row per family, one verdict column per version set."""
    names = list(sets)
    lines = ["| family | class | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for family in sorted(set().union(*sets.values())):
        rows = [sets[s].get(family) for s in names]
        classes = " / ".join(dict.fromkeys(f"`{r['model_class']}`" for r in rows if r))
        cells = []
        for r in rows:
            if r is None:
                cells.append("not in this release")
                continue
            reason = r["reason"].replace("|", "\\|")
            cells.append(_SHOWN[r["status"]] + (f": {reason}" if reason else ""))
        lines.append(f"| {family} | {classes} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def readme_section(text: str) -> str:
    """The table between the markers of ``text`` (the README), stripped."""
    return text[text.index(BEGIN) + len(BEGIN):text.index(END)].strip()


def write(verdicts: list[Verdict]) -> dict[str, dict[str, dict[str, str]]]:
    """Record ``verdicts`` as the installed set's (sets no longer pinned are dropped) and rewrite the README."""
    sets = recorded() | {installed_set(): as_record(verdicts)}
    sets = {s: sets[s] for s in pinned_sets() if s in sets}
    RECORDED.write_text(json.dumps(sets, indent=1, sort_keys=True, ensure_ascii=False) + "\n")
    text = README.read_text()
    README.write_text(text[:text.index(BEGIN) + len(BEGIN)] + "\n" + table(sets) + "\n" + text[text.index(END):])
    return sets


if __name__ == "__main__" and "--write" in sys.argv:
    found = census()
    write(found)
    print(f"recorded {len(found)} families of {installed_set()} in {RECORDED.name}; wrote the census table of {README}")
