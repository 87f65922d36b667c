"""The commands and everything only they use: the ``weightsync`` command line and its sub-commands.

``cli`` (the parser and dispatch; the console script is ``actors.cli``), ``sync_cli`` (``weightsync sync``),
``run_cli`` (``weightsync run``, a deploy config on a Ray cluster), ``merge_cli`` (``weightsync merge``),
``demo`` / ``demo_vllm`` / ``demo_vllm_server`` / ``demo_live`` / ``rl/`` (``weightsync demo``: HF, vLLM,
a vLLM server, a live FSDP2 trainer, the toy GRPO loop), ``preflight`` / ``preflight_vllm_server`` (bad
input refused before Ray starts), ``progress`` (step lines on a terminal), ``local`` (a local run's adapter
replay). The core (``sync_service`` and its other packages) never imports this package; ``bench`` does
(it is a command too).
"""
