"""A ``resume`` that moves a socket to the conversation running its generation, with the
awaits of the move interleaved with the owner's end or another resume (Events set the order:
no sleeps, no timing)."""

from __future__ import annotations

import asyncio
from typing import Any

from rill.protocols.generate_ws import messages as m
from rill.protocols.generate_ws import session as s
from rill.protocols.generate_ws.conversation import TAKEN_OVER_CLOSE_CODE, ClientEnd, Conversation
from rill.protocols.generate_ws.service import GenerateService

REQUEST_ID = "gen_race"


class End(ClientEnd):
    """A client end that keeps what it was sent and how it was closed."""

    def __init__(self) -> None:
        super().__init__(self._keep, self._closed)
        self.sent: list[m.ServerMessage] = []
        self.closed: tuple[int, str] | None = None
        self.wrote = asyncio.Event()

    async def _keep(self, message: m.ServerMessage) -> None:
        self.sent.append(message)
        self.wrote.set()

    async def _closed(self, code: int, reason: str) -> None:
        self.closed = (code, reason)


async def running(service: GenerateService) -> tuple[Conversation, End]:
    """A conversation recording a resumable generation (one message so far), with its socket."""
    end = End()
    owner = Conversation(service, end, None, "peer:a")
    stream = service.registry.open(REQUEST_ID, owner.owner)
    service.live[REQUEST_ID] = owner
    await owner.writer.record(stream)
    await owner.send(m.Status(operation="queued"))
    return owner, end


def hold_drain(conversation: Conversation) -> tuple[asyncio.Event, asyncio.Event]:
    """Make the first await of ``conversation``'s resume wait for ``release``; ``entered`` is
    set once it waits."""
    entered, release = asyncio.Event(), asyncio.Event()
    drain = conversation.writer.drain

    async def held() -> None:
        entered.set()
        await release.wait()
        await drain()

    conversation.writer.drain = held  # type: ignore[method-assign]
    return entered, release


async def test_a_resume_reads_on_alone_when_the_owner_ends_during_the_move(make_server: Any) -> None:
    """The owner was running when the resume looked, and ended while the resume awaited:
    the resuming socket reads what it sent in its own conversation, which stays open."""
    live = await make_server()
    service = GenerateService(live.deps)
    owner, _ = await running(service)
    end = End()
    resumer = Conversation(service, end, None, "peer:b")
    entered, release = hold_drain(resumer)
    attach = asyncio.create_task(resumer.perform(s.Attach(REQUEST_ID, -1)))
    await entered.wait()
    await owner.shutdown()
    release.set()
    await attach
    await end.wrote.wait()
    assert end.conversation is resumer and not resumer.is_closed
    assert [(type(x), x.index) for x in end.sent] == [(m.Status, 0)]
    assert end.closed is None
    await resumer.shutdown()


async def test_a_resume_takes_over_from_a_socket_that_resumed_during_the_move(make_server: Any) -> None:
    """Another socket resumed the generation while this resume awaited: the owner is still
    running, so this one takes it over and the other socket is closed as taken over."""
    live = await make_server()
    service = GenerateService(live.deps)
    owner, _ = await running(service)
    first, second = End(), End()
    early = Conversation(service, first, None, "peer:b")
    late = Conversation(service, second, None, "peer:c")
    entered, release = hold_drain(late)
    attach = asyncio.create_task(late.perform(s.Attach(REQUEST_ID, -1)))
    await entered.wait()
    await early.perform(s.Attach(REQUEST_ID, -1))
    assert first.conversation is owner and early.is_closed
    release.set()
    await attach
    await second.wrote.wait()
    assert second.conversation is owner and late.is_closed and not owner.is_closed
    assert first.closed is not None and first.closed[0] == TAKEN_OVER_CLOSE_CODE
    assert owner.writer.peer is second
    await owner.shutdown()
