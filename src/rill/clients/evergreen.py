"""Python client of Evergreen sessions over gRPC, and ``rill client evergreen``.

    async with EvergreenClient("127.0.0.1:50051") as client:
        async for text in client.generate("Once upon a time", config=GenerateConfig(max_tokens=50)):
            print(text, end="")

``generate`` opens one session (one ``StartSession`` call), sends a ``GENERATE`` action with
a prompt node (a parent of one ``text/plain`` leaf and an ``EndOfTurn`` leaf), half-closes,
and yields the text of each output fragment until the final one. A session aborted by the
server raises ``EvergreenError`` with the gRPC status name and message.

For multi-turn use, ``open_session()`` returns a ``Session`` whose ``send`` and ``receive``
carry raw ``messages.SessionMessage`` structs.

``rill client evergreen --prompt TEXT [--address HOST:PORT] [--max-tokens N] ...`` streams
the reply to the terminal (exit 0 on success, 2 on an aborted session, 3 if the server cannot
be reached); Ctrl-C cancels the call, which frees the generation on the server at once.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import uuid
from collections.abc import AsyncIterator
from typing import Any

from rill.config import EvergreenConfig
from rill.protocols.evergreen import codec
from rill.protocols.evergreen.messages import (
    Action,
    Chunk,
    ChunkMetadata,
    GenerateConfig,
    NamedParameter,
    NodeFragment,
    SessionMessage,
    TargetSpec,
)
from rill.protocols.evergreen.prompt import END_OF_TURN

DEFAULT_ADDRESS = f"127.0.0.1:{EvergreenConfig.grpc_port}"  # where `rill serve` listens by default


class EvergreenError(Exception):
    """The server aborted the session: ``status`` is the gRPC status name."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


def prompt_message(
    prompt: str,
    *,
    output_id: str | None = None,
    config: GenerateConfig | None = None,
    target: str = "",
    role: str = "user",
) -> tuple[SessionMessage, str]:
    """One message holding a GENERATE action and its prompt nodes; returns it and the output id."""
    ids = {name: f"{name}-{uuid.uuid4().hex[:12]}" for name in ("prompt", "text", "eot", "response")}
    output_id = output_id or ids["response"]
    action = Action(
        name="GENERATE",
        inputs=(NamedParameter(name="prompt", id=ids["prompt"]),),
        outputs=(NamedParameter(name="response", id=output_id),),
        configs=(codec.encode_config(config),) if config is not None else (),
        target_spec=TargetSpec(id=target) if target else None,
    )
    fragments = (
        NodeFragment(id=ids["prompt"], child_ids=(ids["text"], ids["eot"])),
        NodeFragment(
            id=ids["text"],
            chunk_fragment=Chunk(metadata=ChunkMetadata(mimetype="text/plain", role=role), data=prompt.encode()),
        ),
        NodeFragment(id=ids["eot"], chunk_fragment=Chunk(metadata=ChunkMetadata(mimetype=END_OF_TURN, role=role))),
    )
    return SessionMessage(node_fragments=fragments, actions=(action,)), output_id


class Session:
    """One open ``StartSession`` call: send messages, receive messages, end the input."""

    def __init__(self, call: Any) -> None:
        self._call = call

    async def send(self, message: SessionMessage) -> None:
        """Send one message.

        Raises:
            EvergreenError: the server already ended the session (e.g. a refused API key).
        """
        import grpc

        try:
            await self._call.write(codec.to_pb(message))
        except grpc.aio.AioRpcError as exc:
            raise EvergreenError(exc.code().name, exc.details() or "") from exc

    async def end_input(self) -> None:
        """Half-close: the server finishes running actions, then ends the session."""
        import grpc

        try:
            await self._call.done_writing()
        except grpc.aio.AioRpcError as exc:
            raise EvergreenError(exc.code().name, exc.details() or "") from exc

    async def receive(self) -> SessionMessage | None:
        """The next server message, or None once the session ended normally.

        Raises:
            EvergreenError: the server aborted the session.
        """
        import grpc

        try:
            message = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            raise EvergreenError(exc.code().name, exc.details() or "") from exc
        if message is grpc.aio.EOF:
            code = await self._call.code()
            if code != grpc.StatusCode.OK:
                raise EvergreenError(code.name, await self._call.details() or "")
            return None
        return codec.from_pb(message)

    def cancel(self) -> None:
        """Cancel the call: the server aborts every running action."""
        self._call.cancel()


class EvergreenClient:
    """A gRPC channel to a rill server's Evergreen service."""

    def __init__(self, address: str = DEFAULT_ADDRESS, api_key: str | None = None) -> None:
        self.address = address
        self.api_key = api_key
        self._channel: Any = None

    async def __aenter__(self) -> EvergreenClient:
        import grpc

        self._channel = grpc.aio.insecure_channel(self.address)
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the channel (cancelling any call still open)."""
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    def open_session(self) -> Session:
        """Start one session (a ``StartSession`` call)."""
        from rill.protocols.evergreen._pb import evergreen_service_pb2_grpc as service_grpc

        stub = service_grpc.EvergreenServiceStub(self._channel)
        metadata = (("authorization", f"Bearer {self.api_key}"),) if self.api_key else None
        return Session(stub.StartSession(metadata=metadata))

    async def generate(
        self, prompt: str, *, config: GenerateConfig | None = None, target: str = ""
    ) -> AsyncIterator[str]:
        """Run one GENERATE in a new session and yield the reply's text pieces in order.

        Raises:
            EvergreenError: the server aborted the session.
        """
        session = self.open_session()
        message, output_id = prompt_message(prompt, config=config, target=target)
        try:
            await session.send(message)
            await session.end_input()
            while (reply := await session.receive()) is not None:
                for fragment in reply.node_fragments:
                    if fragment.id != output_id:
                        continue
                    chunk = fragment.chunk_fragment
                    if chunk is not None and chunk.data:
                        yield chunk.data.decode("utf-8", errors="replace")
        finally:
            session.cancel()  # a no-op once the call ended; frees the server at once otherwise


# -- command line ---------------------------------------------------------------------------------


def register(client_subparsers: Any) -> None:
    """Add ``rill client evergreen``."""
    parser = client_subparsers.add_parser("evergreen", help="run a GENERATE action in an Evergreen session (gRPC)")
    parser.add_argument("--prompt", required=True, help="prompt text (one user turn)")
    parser.add_argument(
        "--address", default=DEFAULT_ADDRESS, help=f"gRPC address host:port (default {DEFAULT_ADDRESS})"
    )
    parser.add_argument("--api-key", default=None, help="API key, sent as 'authorization: Bearer KEY' metadata")
    parser.add_argument("--target", default="", help="target_spec.id (default: the server's model)")
    parser.add_argument("--max-tokens", type=int, default=None, help="most tokens to generate")
    parser.add_argument("--temperature", type=float, default=None, help="sampling temperature (0 = greedy)")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass")
    parser.add_argument("--top-k", type=int, default=None, help="top-k sampling (0 = off)")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed")
    parser.set_defaults(func=_cmd_evergreen)


def _cmd_evergreen(args: argparse.Namespace) -> int:
    config = GenerateConfig(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
    )
    try:
        return asyncio.run(_stream(args, config))
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


async def _stream(args: argparse.Namespace, config: GenerateConfig) -> int:
    async with EvergreenClient(args.address, api_key=args.api_key) as client:
        try:
            async for text in client.generate(args.prompt, config=config, target=args.target):
                sys.stdout.write(text)
                sys.stdout.flush()
        except EvergreenError as exc:
            sys.stdout.write("\n")
            print(f"rill client evergreen: session aborted: {exc}", file=sys.stderr)
            return 3 if exc.status == "UNAVAILABLE" else 2
    sys.stdout.write("\n")
    return 0
