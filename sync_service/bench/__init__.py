"""``weightsync bench``: end-to-end performance envelope of a sync next to the paths in use today.

- ``model``: the generated bf16 Qwen3-MoE base (scaled by layers; 1x >= 1 GB) and its LoRA adapter.
- ``ours``: delta / full syncs through ``WeightSync`` (2 trainer shards -> 1 and -> 4 engines).
- ``baselines``: PEFT ``merge_and_unload`` + ``save_pretrained`` + reload; full-gather + ``ray.put``.
- ``floor``: one cross-process copy of the same bytes through reused shared memory.
- ``rss``: peak RSS of actor processes (psutil thread). ``report``: ratios, JSON, table, plot.
- across hosts (``--link``): ``link_run`` (namespace hosts + Ray nodes per rate, the driver process),
  ``link`` (the rows), ``sock`` (plain TCP: the link floor, the disk copy), ``wire`` (bytes counted at
  the interfaces), ``link_report`` (the ``"links"`` JSON, ratios, goals, table).
- ``run``: the whole run (``run_bench(BenchConfig(...))``); ``cli``: the sub-command.

Nothing is imported here: the floor's reader process (spawned) imports ``floor`` alone.
"""
