"""Python client of the ``/generate`` WebSocket, and ``rill client generate``.

    async with GenerateClient("ws://127.0.0.1:8000/generate", api_key=None) as client:
        async for msg in client.generate("Once upon a time", max_tokens=50, temperature=0.7):
            if msg["type"] == "token":
                print(msg["token"], end="")
        await client.feedback(1, text="nice")

``generate`` yields every server message of one generation as a dict (``status``, ``init``,
``token``…) and ends after the ``completion``; an ``error`` message raises
``GenerateError`` (with the message and the partial text). While it runs, ``stop``,
``pause``, ``resume``, ``modify`` and ``regenerate`` steer it from another task.

``rill client generate --prompt TEXT [--url URL] [--api-key KEY]`` streams the text to the
terminal; Ctrl-C sends ``stop`` (a second Ctrl-C quits at once).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
from collections.abc import AsyncIterator
from typing import Any

DEFAULT_URL = "ws://127.0.0.1:8000/generate"


class GenerateError(Exception):
    """The server answered with an ``error`` message; ``.message`` holds it as a dict."""

    def __init__(self, message: dict[str, Any]) -> None:
        super().__init__(f"{message.get('error')}: {message.get('message')}")
        self.message = message

    @property
    def generated_text(self) -> str | None:
        """The partial text when the error cut a generation short."""
        return self.message.get("generated_text")


class GenerateClient:
    """One ``/generate`` connection; generations run one after another on it."""

    def __init__(self, url: str = DEFAULT_URL, api_key: str | None = None) -> None:
        self.url = url
        self.api_key = api_key
        self._ws: Any = None
        self.request_id: str | None = None

    async def __aenter__(self) -> GenerateClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()

    async def connect(self) -> None:
        """Open the socket (the key goes in the Authorization header)."""
        from websockets.asyncio.client import connect

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        self._ws = await connect(self.url, additional_headers=headers, max_size=None)

    async def close(self) -> None:
        """Close the socket."""
        if self._ws is not None:
            await self._ws.close()
            self._ws = None

    async def send(self, message: dict[str, Any]) -> None:
        """Send one raw client message."""
        await self._ws.send(json.dumps(message))

    async def receive(self) -> dict[str, Any]:
        """The next server message."""
        return json.loads(await self._ws.recv())

    async def generate(
        self, prompt: str, *, options: dict[str, Any] | None = None, model: str | None = None, **parameters: Any
    ) -> AsyncIterator[dict[str, Any]]:
        """Start a generation and yield its messages up to and including ``completion``.

        Raises ``GenerateError`` when the server sends an ``error`` for it.
        """
        config: dict[str, Any] = {"type": "config", "prompt": prompt, "parameters": parameters}
        if options:
            config["options"] = options
        if model:
            config["model"] = model
        await self.send(config)
        while True:
            msg = await self.receive()
            if msg["type"] == "init":
                self.request_id = msg["request_id"]
            if msg["type"] == "error":
                raise GenerateError(msg)
            yield msg
            if msg["type"] == "completion":
                return

    async def control(self, action: str, **parameters: Any) -> None:
        """Send a control message (``stop``, ``pause``, ``resume``, ``regenerate``, ``modify``)."""
        msg: dict[str, Any] = {"type": "control", "action": action}
        if parameters:
            msg["parameters"] = parameters
        await self.send(msg)

    async def stop(self) -> None:
        """End the running generation at the next token (a ``cancelled`` completion follows)."""
        await self.control("stop")

    async def pause(self) -> None:
        """Pause the running generation."""
        await self.control("pause")

    async def resume(self) -> None:
        """Resume a paused generation."""
        await self.control("resume")

    async def modify(self, **parameters: Any) -> None:
        """Change sampling parameters from the next token on."""
        await self.control("modify", **parameters)

    async def regenerate(self) -> None:
        """Restart the running generation from its prompt."""
        await self.control("regenerate")

    async def feedback(self, rating: float, text: str | None = None, position: int | None = None) -> dict[str, Any]:
        """Send feedback on the last generation and return the acknowledging ``status``.

        Call it between generations (while one runs, its messages would interleave).
        """
        msg: dict[str, Any] = {"type": "feedback", "rating": rating}
        if text is not None:
            msg["text"] = text
        if position is not None:
            msg["position"] = position
        await self.send(msg)
        reply = await self.receive()
        if reply["type"] == "error":
            raise GenerateError(reply)
        return reply


async def _stream_to_terminal(args: argparse.Namespace) -> int:
    parameters = {
        k: v
        for k, v in (("max_tokens", args.max_tokens), ("temperature", args.temperature), ("seed", args.seed))
        if v is not None
    }
    loop = asyncio.get_running_loop()
    async with GenerateClient(args.url, args.api_key) as client:
        num_interrupts = 0
        stopping: set[asyncio.Task[None]] = set()  # held: a task nobody refers to may be collected

        def on_sigint() -> None:
            nonlocal num_interrupts
            num_interrupts += 1
            if num_interrupts == 1:
                task = loop.create_task(client.stop())  # the server ends it at the next token
                stopping.add(task)
                task.add_done_callback(stopping.discard)
            else:
                raise KeyboardInterrupt

        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signal.SIGINT, on_sigint)
        try:
            async for msg in client.generate(args.prompt, **parameters):
                if msg["type"] == "token":
                    sys.stdout.write(msg["token"])
                    sys.stdout.flush()
                elif msg["type"] == "status" and msg.get("operation") == "model_loading":
                    print(f"[loading model: {msg.get('progress', 0):.0f}%]", file=sys.stderr)
                elif msg["type"] == "completion":
                    usage = msg["usage"]
                    print(
                        f"\n[{msg['finish_reason']}: {usage['prompt_tokens']} prompt + "
                        f"{usage['completion_tokens']} generated tokens]",
                        file=sys.stderr,
                    )
        except GenerateError as exc:
            print(f"\nrill: error: {exc}", file=sys.stderr)
            return 1
        finally:
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(signal.SIGINT)
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_stream_to_terminal(args))
    except KeyboardInterrupt:
        return 130
    except OSError as exc:
        print(f"rill: cannot connect to {args.url}: {exc}", file=sys.stderr)
        return 1


def register(client_subparsers: Any) -> None:
    """Add ``rill client generate``."""
    parser = client_subparsers.add_parser("generate", help="stream one generation over the /generate WebSocket")
    parser.add_argument("--prompt", required=True, help="prompt text")
    parser.add_argument("--url", default=DEFAULT_URL, help=f"WebSocket URL (default: {DEFAULT_URL})")
    parser.add_argument("--api-key", default=None, help="API key (sent as a bearer token)")
    parser.add_argument("--max-tokens", type=int, default=None, help="most tokens to generate")
    parser.add_argument("--temperature", type=float, default=None, help="sampling temperature (0: greedy)")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed")
    parser.set_defaults(func=_cmd_generate)
