"""The sans-I/O Evergreen session: actions, their readiness and their output fragments.

One ``EvergreenSession`` per stream, a driver ``Session`` (``protocols/_shared/driver.py``).
The adapter feeds it and performs what it returns:

    receive(SessionMessage)        -> [Send | Generate | Close]   raises on a broken rule
    request_for(Generate, refs)    -> GenerateRequest             (after reading file refs)
    on_output(action_id, output, now) -> [Send | Generate | Close | AbortSession + Abort...]
    on_input_end()                 -> [Close] or raises InputMissing
    on_refused(exc)                -> [Rejected, AbortSession, Abort...]   (receive or on_input_end raised)
    on_error(exc) / on_start_failed(action_id, exc, now) -> [AbortSession, Abort...]
    ref_budget(Generate) / count_refs(Generate, contents, num_read)   (around reading refs)

Every failure aborts the whole session (spec "Error handling"): ``AbortSession`` carries the
error (its status comes from ``codec.status_of``) and the running actions are aborted; after
that, and after ``Close``, the session answers nothing more.

The nodes, their fragments and links, and the bounds on what a session holds are the node
store's (``store.py``, which states the rules). The session adds the actions':

* limits (past its bound, ``SessionLimit``, RESOURCE_EXHAUSTED): ``max_actions`` open
  actions; ``max_bytes`` also counts open actions' configs (``ACTION_COST_BYTES`` each
  besides), generated text and the bytes read through file refs (``count_refs``);
  ``max_prompt_bytes`` per action prompt, each use of a shared node or file counted.

Actions: ``GENERATE`` (input ``prompt`` or ``text``; output ``response`` or ``text``, none
meaning "not wanted", so nothing runs) is accepted at once and started when its input graph
is complete (the data-dependency barrier): outputs of earlier actions count as complete when
those actions finish, so chains and multi-turn conversations need no re-sending.

Pure: no I/O, no ``await``, no clock, no engine import; errors are ``evergreen.errors``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rill.errors import GenerationError, RillError
from rill.protocols._shared.actions import Abort, Close, Rejected, Send
from rill.protocols._shared.session import Key, Session
from rill.protocols.evergreen import codec
from rill.protocols.evergreen.errors import InputMissing, RuleBroken, SessionLimit, UnknownTarget
from rill.protocols.evergreen.messages import Action, GenerateConfig, SessionMessage
from rill.protocols.evergreen.prompt import (
    FileRef,
    ModelFacts,
    PromptItem,
    TextLeaf,
    TurnEnd,
    build_request,
    is_under,
)
from rill.protocols.evergreen.store import ActionId, NodeId, NodeStore, SessionLimits, utf8_len
from rill.types import GenerateRequest, RequestOutput

__all__ = [
    "EvergreenSession",
    "SessionLimits",
    "ModelFacts",
    "Send",
    "Generate",
    "Close",
    "AbortSession",
    "Command",
    "FileRef",
    "TextLeaf",
    "TurnEnd",
    "PromptItem",
    "is_under",
]

GENERATE = "GENERATE"
INPUT_NAMES = ("prompt", "text")
OUTPUT_NAMES = ("response", "text")

ACTION_COST_BYTES = 256
"""Bytes an open action counts besides its configs."""


# -- commands for the adapter -----------------------------------------------------------------


@dataclass(frozen=True)
class Generate:
    """Start action ``action_id``: read ``refs``, then ``request_for`` gives its request."""

    action_id: ActionId
    items: tuple[PromptItem, ...]
    config: GenerateConfig
    num_inline_bytes: int = 0
    """Bytes of the prompt's inline text (each use of a shared node counted), refs excluded."""

    @property
    def refs(self) -> list[FileRef]:
        """Every file ref of the prompt, in order."""
        return [p for item in self.items if isinstance(item, TextLeaf) for p in item.pieces if isinstance(p, FileRef)]


@dataclass(frozen=True)
class AbortSession:
    """End the session with ``error``'s status (``codec.status_of``; over WebSocket the close
    code 4000 + that status, ``codec.ws_close``)."""

    error: BaseException


Command = Send[SessionMessage] | Generate | Close | AbortSession | Abort | Rejected
"""``Close``: the session is over, end the stream with OK. ``Abort``: stop a running action
(the session is being aborted). ``Rejected``: count a refused input."""


# -- state ---------------------------------------------------------------------------------------


@dataclass
class _Action:
    id: ActionId
    input_id: NodeId
    output_id: NodeId | None
    config: GenerateConfig
    is_running: bool = False


class EvergreenSession(Session):
    """State of one Evergreen session (see the module docstring and ``store.py`` for the rules).

    ``charge`` (optional) is told of every byte the session comes to hold, after the
    per-session ``max_bytes`` check and before the bytes are kept: the adapter charges them
    to the server-wide budget, and an exception it raises (``ResourceExhausted``) aborts
    the session like a broken limit. The session never gives bytes back before it ends, so
    the adapter releases the whole charge when the session is over.
    """

    def __init__(self, limits: SessionLimits, model: ModelFacts, charge: Callable[[int], None] | None = None) -> None:
        self.limits = limits
        self.model = model
        self._store = NodeStore(limits, charge)
        self._waiting: dict[ActionId, _Action] = {}
        self._running: dict[ActionId, _Action] = {}
        self._num_actions = 0
        self._is_input_ended = False
        self._is_over = False  # aborted or closed: nothing more to say

    # -- inbound ---------------------------------------------------------------------------------
    def receive(self, message: SessionMessage) -> list[Command]:
        """Take one client message: store its fragments, accept its actions, start the ready ones.

        Raises:
            RuleBroken, UnsupportedInput, UnknownTarget, SessionLimit: the session must abort.
        """
        if self._is_input_ended:
            raise RuleBroken("a message arrived after the client ended its input")
        for fragment in message.node_fragments:
            self._store.add_fragment(fragment)
        for action in message.actions:
            self._add_action(action)
        return self._start_ready()

    def on_input_end(self) -> list[Command]:
        """The client closed its side: finish running actions, then close.

        Raises:
            InputMissing: an action still waits for a node that can no longer arrive.
        """
        self._is_input_ended = True
        for action in self._waiting.values():
            missing = self._store.missing_client_node(action.input_id)
            if missing is not None:
                raise InputMissing(
                    f"the client ended its input but action {action.id} still waits for node "
                    f"'{missing}', which never arrived complete"
                )
        return self._maybe_close()

    @property
    def num_open_actions(self) -> int:
        """Actions accepted and not finished (waiting for inputs or running)."""
        return len(self._waiting) + len(self._running)

    # -- actions ---------------------------------------------------------------------------------
    def _add_action(self, action: Action) -> None:
        action_id = str(self._num_actions)
        label = f"action {action_id} ({action.name or 'unnamed'})"
        if action.name != GENERATE:
            raise RuleBroken(f"{label}: unknown action name '{action.name}' (rill runs {GENERATE})")
        target = action.target_spec.id if action.target_spec is not None else ""
        if target and target != self.model.name:
            raise UnknownTarget(
                f"{label}: target_spec.id '{target}' is not served here (this server runs "
                f"'{self.model.name}'; leave it empty for the default)"
            )
        config = self._config(action, label)
        max_id = self.limits.max_id_bytes
        input_id = self._one_param(action.inputs, INPUT_NAMES, "input", label, required=True, max_id_bytes=max_id)
        output_id = self._one_param(action.outputs, OUTPUT_NAMES, "output", label, required=False, max_id_bytes=max_id)
        if self.num_open_actions >= self.limits.max_actions:
            raise SessionLimit(f"{label}: {self.limits.max_actions} actions are already open (--evergreen-max-actions)")
        assert input_id is not None
        self._store.node(input_id)
        if output_id is not None:
            self._store.claim_output(output_id, input_id, action_id, label)
        self._num_actions += 1
        if output_id is not None:  # no output wanted: nothing to compute
            self._store.add_bytes(ACTION_COST_BYTES + sum(utf8_len(c.type_url) + len(c.value) for c in action.configs))
            self._waiting[action_id] = _Action(action_id, input_id, output_id, config)

    def _config(self, action: Action, label: str) -> GenerateConfig:
        merged: dict[str, Any] = {}
        for any_config in action.configs:
            config = codec.decode_config(any_config)
            if config is None:
                raise RuleBroken(
                    f"{label}: unknown config type '{any_config.type_url}' (rill takes "
                    "type.googleapis.com/rill.evergreen.v1.GenerateConfig)"
                )
            merged.update({k: v for k, v in _fields(config).items() if v is not None and v != ()})
        return GenerateConfig(**merged)

    @staticmethod
    def _one_param(
        params: tuple[Any, ...], names: tuple[str, ...], what: str, label: str, *, required: bool, max_id_bytes: int
    ) -> NodeId | None:
        found = None
        for param in params:
            if param.name not in names:
                raise RuleBroken(f"{label}: unknown {what} name '{param.name}' (use {' or '.join(names)})")
            if not param.id:
                raise RuleBroken(f"{label}: {what} '{param.name}' has an empty node id")
            if utf8_len(param.id) > max_id_bytes:
                raise SessionLimit(
                    f"{label}: {what} '{param.name}' names a node id longer than {max_id_bytes} "
                    "bytes (--evergreen-max-id-bytes)"
                )
            if found is not None:
                raise RuleBroken(f"{label}: more than one {what} ({' and '.join(names)} name the same parameter)")
            found = param.id
        if found is None and required:
            raise RuleBroken(f"{label}: no input named {' or '.join(names)}")
        return found

    def _start_ready(self) -> list[Command]:
        commands: list[Command] = []
        for action in list(self._waiting.values()):
            if self._store.is_complete(action.input_id):
                del self._waiting[action.id]
                self._running[action.id] = action
                action.is_running = True
                items, num_inline_bytes = self._store.flatten(action.input_id, self.model)
                commands.append(Generate(action.id, tuple(items), action.config, num_inline_bytes))
        return commands

    # -- prompt ------------------------------------------------------------------------------------
    def ref_budget(self, command: Generate) -> int:
        """Most bytes the adapter may read through ``command``'s file refs (each file once):
        what is left of the session's ``max_bytes`` and of the action's prompt budget."""
        return max(
            0,
            min(self.limits.max_bytes - self._store.num_bytes, self.limits.max_prompt_bytes - command.num_inline_bytes),
        )

    def count_refs(self, command: Generate, contents: dict[str, bytes], num_read_bytes: int) -> None:
        """Count what the adapter read for ``command``: ``num_read_bytes`` (each file once)
        against the session's ``max_bytes``, and the prompt with each ref's content once per
        use against ``max_prompt_bytes``. Call it before ``request_for``.

        Raises:
            SessionLimit: either bound is passed.
        """
        num_prompt_bytes = command.num_inline_bytes + sum(len(contents[ref.path]) for ref in command.refs)
        if num_prompt_bytes > self.limits.max_prompt_bytes:
            raise SessionLimit(
                f"action {command.action_id}: the prompt expands to {num_prompt_bytes} bytes with "
                f"its file refs, more than {self.limits.max_prompt_bytes} "
                "(--evergreen-max-prompt-bytes; a file counts once per ref)"
            )
        self._store.add_bytes(num_read_bytes)

    def request_for(self, command: Generate, ref_bytes: dict[str, bytes]) -> GenerateRequest:
        """The engine request of a started action, its file refs' contents given by path
        (see ``prompt.build_request`` for the rules and errors).

        It reads only ``command``, ``ref_bytes`` and the session's frozen limits and model
        facts, so the adapter may run it in a worker thread: a large prompt is joined and
        decoded there, not on the event loop.
        """
        return build_request(
            command.action_id,
            command.items,
            command.config,
            ref_bytes,
            self.model,
            deadline_s=self.limits.request_timeout_s,
        )

    # -- outbound ----------------------------------------------------------------------------------
    def on_output(self, key: Key, output: RequestOutput, now: float) -> list[Command]:
        """New output of running action ``key``: its text is the next fragment of the action's
        output node; the last output (``finished``) makes the final fragment, then any action
        that waited for this output starts. A failed output (``finish_reason`` "error"), or
        text past the session's bounds (``SessionLimit``), aborts the session."""
        if self._is_over:
            return []
        if output.finish_reason == "error":
            error = output.error
            if not isinstance(error, BaseException):
                error = GenerationError(f"action {key} failed while generating")
            return self.on_error(error)
        assert key is not None  # every request of this session is an action's
        try:
            return self._add_output(self._running[key], output.text, output.finished)
        except RillError as exc:
            return self.on_error(exc)

    def _add_output(self, action: _Action, text: str, finished: bool) -> list[Command]:
        assert action.output_id is not None
        fragment = self._store.add_output(action.output_id, text, finished)
        commands: list[Command] = []
        if fragment is not None:
            commands.append(Send(SessionMessage(node_fragments=(fragment,))))
        if finished:
            del self._running[action.id]
            commands.extend(self._start_ready())
            commands.extend(self._maybe_close())
        return commands

    def on_start_failed(self, key: Key, exc: BaseException, now: float) -> list[Command]:
        """Action ``key`` never started (a file ref could not be read, its prompt is refused,
        the engine refused it): the session aborts."""
        if key is not None:
            self._running.pop(key, None)  # it never runs: nothing to abort
        return self.on_error(exc)

    def on_error(self, exc: BaseException) -> list[Command]:
        """The session fails with ``exc`` (a failed action, a bug): abort it and every running
        action; the first failure wins, later ones are not answered."""
        if self._is_over:
            return []
        self._is_over = True
        return [AbortSession(exc), *(Abort(action_id) for action_id in self._running)]

    def on_refused(self, exc: BaseException) -> list[Command]:
        """The client's input was refused (``receive`` or ``on_input_end`` raised, or a message
        could not be decoded): counted as a rejection under ``exc``'s code, then ``on_error``."""
        if self._is_over:
            return []
        return [Rejected(exc.code if isinstance(exc, RillError) else RillError.code), *self.on_error(exc)]

    def _maybe_close(self) -> list[Command]:
        if not self._is_input_ended or self._running:
            return []
        if self._waiting:
            stuck = next(iter(self._waiting.values()))
            raise InputMissing(
                f"action {stuck.id} waits for outputs of actions that can never run "
                "(an action's input includes its own output)"
            )
        self._is_over = True
        return [Close()]


def _fields(struct: object) -> dict[str, Any]:
    return {name: getattr(struct, name) for name in struct.__struct_fields__}  # type: ignore[attr-defined]
