"""``weightsync sync --vllm-url``: each server answers, runs the weightsync backend, and serves a
model whose table fits ``--base`` — checked before Ray starts (one line, exit 2, on a failure)."""

from __future__ import annotations

import argparse
import os

from sync_service.engines.vllm_server.client import ServerError, redact
from sync_service.engines.vllm_server.engine import VLLMServerConfig, VLLMServerEngine
from sync_service.entrypoints.preflight import fail

__all__ = ["check_servers"]


def check_servers(args: argparse.Namespace) -> None:
    """Exit 2 naming the URL and the fix when a URL is given twice (two engines on one server would
    race), ``--engines`` contradicts the URLs' count, a server is unreachable, lacks the backend or the
    dev routes, or rejects the API key (``--vllm-api-key`` / ``$VLLM_API_KEY``)."""
    if args.engine != "vllm-server":
        fail(args, f"--vllm-url needs --engine vllm-server (got --engine {args.engine})")
    twice = sorted({u for u in args.vllm_urls if args.vllm_urls.count(u) > 1})
    if twice:
        fail(args, f"--vllm-url {redact(twice[0])} given twice; give each server once (one engine per server)")
    if args.engines is not None and args.engines != len(args.vllm_urls):
        fail(args, f"--engines {args.engines} != {len(args.vllm_urls)} --vllm-url server(s); drop --engines "
                   f"(the servers given are the engines)")
    key = args.vllm_api_key or os.environ.get("VLLM_API_KEY")
    for url in args.vllm_urls:
        try:
            VLLMServerEngine(VLLMServerConfig(url=url, api_key=key, timeout_s=min(30.0, args.timeout)))
        except (ServerError, ValueError) as exc:
            fail(args, f"--vllm-url {redact(url)}: {exc}")
