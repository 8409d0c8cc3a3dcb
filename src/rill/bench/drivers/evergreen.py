"""Evergreen driver: one gRPC ``StartSession`` per request over one shared channel.

Uses ``rill.clients.evergreen`` (a GENERATE action on a prompt node, then half-close);
each output fragment with data is a token-bearing message. The protocol reports no token
count, so the count is the number of fragments: when the client lags, one fragment can hold
several tokens and the count comes out low. An aborted session fails the request with its
gRPC status name (``RESOURCE_EXHAUSTED``, ``UNAVAILABLE`` …).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rill.bench.drivers import BenchError, Options, Target, Timer
from rill.bench.stats import RequestRecord
from rill.bench.workload import BenchRequest

if TYPE_CHECKING:
    from rill.clients.evergreen import EvergreenClient

SERVER_PROTOCOL = "evergreen"


class Driver:
    """One ``EvergreenClient`` (gRPC channel, HTTP/2-multiplexed) for the whole run."""

    name = "evergreen"

    def __init__(self, target: Target, options: Options) -> None:
        self.target = target
        self.options = options
        self._client: EvergreenClient | None = None

    async def open(self) -> None:
        """Open the channel."""
        from rill.clients.evergreen import EvergreenClient

        self._client = EvergreenClient(self.target.grpc_address, api_key=self.target.api_key)
        await self._client.__aenter__()

    async def close(self) -> None:
        """Close the channel."""
        if self._client is not None:
            await self._client.close()

    async def run(self, request: BenchRequest, timer: Timer) -> RequestRecord:
        """Run one GENERATE session to its end."""
        from rill.clients.evergreen import EvergreenError
        from rill.protocols.evergreen.messages import GenerateConfig

        assert self._client is not None, "open() first"
        config = GenerateConfig(
            max_tokens=request.max_tokens,
            temperature=self.options.temperature,
            ignore_eos=True if self.options.ignore_eos else None,
        )
        try:
            async for text in self._client.generate(request.prompt, config=config):
                if text:
                    timer.tokens()
        except EvergreenError as exc:
            raise BenchError(exc.status, exc.message) from exc
        return timer.done()
