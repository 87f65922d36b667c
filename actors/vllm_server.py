"""``VLLMServer(url)``: a running vLLM server as a rollout engine of ``WeightSync`` (a thin Ray actor).

    sync = WeightSync(trainers=shards, engines=[VLLMServer("http://127.0.0.1:8000", api_key=KEY)])

The actor holds a ``VLLMServerEngine`` (HTTP calls to the server) and answers the coordinator's
``protocols.endpoints.RolloutEndpoint`` calls; the weights go from the trainers straight into the
server's worker. The server has one weight-transfer channel: opening it for another owner (a second
coordinator) replaces the first one's.
If the server is gone (unreachable) during ``receive``, the actor exits, so the coordinator sees a
dead engine: it drops it and commits the push on the other engines (``SyncMetrics`` names it).
"""

from __future__ import annotations

import ray

from protocols.endpoints import ExportReport, ExportRequest, OpenChannel, ReceiveReport
from protocols.params import ParamMeta
from protocols.readback import ServedWeights
from sync_service.engines.vllm_server import ServerUnreachableError, VLLMServerConfig, VLLMServerEngine

__all__ = ["VLLMServer", "VLLMServerActor", "VLLMServerActorCore"]


class VLLMServerActorCore:
    """``VLLMServerEngine`` behind the ``RolloutEngine`` calls (threaded: liveness checks answer during a push)."""

    def __init__(self, config: VLLMServerConfig) -> None:
        self.engine = VLLMServerEngine(config)
        self._owner: str | None = None  # whose channel the server's transfer engine holds

    def engine_name(self) -> str:
        return self.engine.engine_name()

    def param_metas(self) -> tuple[ParamMeta, ...]:
        return tuple(ParamMeta(name=n, dtype=d, shape=tuple(s)) for n, d, s, _ in self.engine.param_metas())

    def weight_version(self) -> int | None:
        return self.engine.weight_version()

    def can_export(self) -> bool:
        return False

    def served_weights(self, names: list[str] | None = None, values: bool = False) -> ServedWeights:
        """Per-tensor digests computed in the server's worker (``VLLMServerEngine.served_digests``: vLLM's names,
        checkpoint copies where it keeps a tensor opaque)."""
        from sync_service.engines.readback import served_from_rows

        return served_from_rows(self.engine.engine_name(), *self.engine.served_digests(names, values))

    def send_weights(self, request: ExportRequest) -> ExportReport:
        """Never: a server's weights are not exported (a late joiner copies from an engine that can)."""
        raise RuntimeError(f"{self.engine.engine_name()}: a vLLM server cannot export its weights (can_export is False)")

    def open_transport(self, request: OpenChannel) -> None:
        self.engine.open_transport(request.spec, request.plan, request.index, secret=request.secret,
                                   check_served=getattr(request, "check_served", "off"))
        self._owner = request.owner

    def close_transport(self, owner: str | None = None) -> None:
        if owner is not None and owner != self._owner:
            return  # another owner's channel was replaced already
        self._owner = None
        try:
            self.engine.close_transport()
        except ServerUnreachableError:
            pass  # nothing to close on a server that is gone

    def receive(self, owner: str, timeout_s: float, reset_versions: bool = False) -> ReceiveReport:
        if owner != self._owner:
            raise RuntimeError(f"{self.engine.engine_name()}: receive before open_transport (channel {owner!r})")
        try:
            return ReceiveReport(**self.engine.receive(timeout_s, reset_versions))
        except ServerUnreachableError:
            ray.actor.exit_actor()  # the coordinator sees this engine dead and goes on without it
            raise

    def commit(self, owner: str, version: int, update_id: str | None = None) -> None:
        """Commit the update ``update_id`` (the token of ``receive``'s report) as ``version``; the server's
        ``CommitGate`` decides (``VLLMServerEngine.commit``)."""
        self.engine.commit(version, update_id)

    def abort(self, owner: str, update_id: str | None = None) -> None:
        """Drop the update ``update_id`` (``None``: this handle's last received one); another's is untouched."""
        self.engine.abort(update_id)

    def reset_caches(self) -> None:
        self.engine.reset_caches()

    def generate(self, prompt_token_ids: list[int], max_new_tokens: int) -> tuple[list[int], int | None]:
        return self.engine.generate(prompt_token_ids, max_new_tokens)

    def token_logprobs(self, sequences: list[list[int]]) -> tuple[list, int | None]:
        """Per sequence a float32 ``[len - 1, vocab]`` array of the served model's teacher-forced next-token
        log-probabilities over the full vocabulary (``VLLMServerEngine.token_logprobs``), and the version that
        produced them (``RolloutEngine.token_logprobs``'s shape; ``verify.policy_kl``).

        Raises:
            TypeError: the server reports no full-vocabulary logprobs (started without ``--max-logprobs -1``;
                ``policy_kl`` is then ``null``).
        """
        from sync_service.engines.vllm_server.engine import LogprobsUnavailable

        try:
            version, out = self.engine.token_logprobs(sequences)
        except LogprobsUnavailable as exc:
            raise TypeError(str(exc)) from None
        return [t.numpy() for t in out], version

    def complete(self, prompts: list[list[int]], max_new_tokens: int) -> list[dict]:
        """Greedy completions: ``{"tokens", "logprobs"}`` per prompt."""
        return [{"tokens": g.tokens, "logprobs": g.logprobs} for g in self.engine.complete(prompts, max_new_tokens)]


VLLMServerActor = ray.remote(num_cpus=0, max_concurrency=4)(VLLMServerActorCore)
"""The Ray actor class (threaded: liveness checks answer during a push)."""


def VLLMServer(url: str, *, api_key: str | None = None, name: str | None = None, pause_mode: str = "wait",
               timeout_s: float = 30.0, actor_options: dict | None = None):
    """A rollout-engine actor for the vLLM server at ``url`` (``VLLMServerConfig`` fields as keywords).

    Blocks until the server answered (up to ``timeout_s`` + 30 s).

    Raises:
        ServerUnreachableError / ServerSetupError: as ``VLLMServerEngine`` (e.g. the server was started
            without ``--weight-transfer-config '{"backend": "weightsync"}'``: the message names the flag).
    """
    config = VLLMServerConfig(url=url, api_key=api_key, name=name, pause_mode=pause_mode, timeout_s=timeout_s)
    VLLMServerEngine(config)  # checks the server here, so a setup error reaches the caller as itself
    actor = VLLMServerActor.options(**(actor_options or {})).remote(config)
    ray.get(actor.engine_name.remote(), timeout=timeout_s + 30)
    return actor
