"""What every batch ``/ws`` connection of one server shares: ``BatchService``.

Not pure (``tests/protocols/test_purity.py`` lists it): it reads the server's generation
defaults (the environment and ``.env``) unless ``Deps.sampling_defaults`` gives them, and it
holds the engine client and the continuation store every socket of the server uses.
"""

from __future__ import annotations

import dataclasses

from rill import config as rill_config
from rill.deps import Deps
from rill.errors import ConfigError, InvalidRequest
from rill.frontend.client import EngineClient
from rill.protocols.batch_ws.messages import GenerationConfig
from rill.protocols.batch_ws.session import BatchSession, ContinuationStore, Limits


class BatchService:
    """The engine client, generation defaults, per-socket limits and continuation store of
    one server's batch sockets.

    Args:
        deps: the server's dependencies.

    Raises:
        ConfigError: the defaults are invalid (a bad ``MODEL_DEFAULT_*`` value must stop
            startup, not fail every message later).
    """

    def __init__(self, deps: Deps) -> None:
        self.client: EngineClient = deps.client
        self.metrics = deps.metrics
        source = deps.sampling_defaults or rill_config.sampling_defaults()
        # The fields both types name; what SamplingDefaults has no default for stays unset.
        shared = set(GenerationConfig.__struct_fields__) & {f.name for f in dataclasses.fields(source)}
        self.defaults = GenerationConfig(**{name: getattr(source, name) for name in shared})
        cfg = deps.config.batch_ws
        self.limits = Limits(
            max_inflight_prompts=cfg.batch_max_inflight_prompts, request_timeout_s=deps.config.policy.request_timeout_s
        )
        # Kept generations are charged to the server's session-memory budget.
        self.store = ContinuationStore(
            cfg.batch_cache_max_entries, cfg.batch_cache_max_tokens, cfg.batch_cache_ttl_s, memory=deps.memory
        )
        try:
            self.session("check").default_sampling()
        except InvalidRequest as exc:
            raise ConfigError(f"batch /ws generation defaults (MODEL_DEFAULT_* / RILL_DEFAULT_*): {exc}") from exc

    def session(self, key_prefix: str, scope: str = "", principal: str = "") -> BatchSession:
        """A new socket's session: its keys start with ``key_prefix``; it may continue the
        generations kept under ``scope``; what it keeps is charged to ``principal``."""
        return BatchSession(self.store, self.defaults, self.limits, key_prefix, scope, principal=principal)
