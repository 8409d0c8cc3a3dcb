"""The sans-I/O Evergreen session: the node store, action readiness and output fragments.

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

Rules of the node store (spec "Ordering", "Boundaries", "Mime type"; wire-notes §1.4):

* fragments of a node are keyed by ``(id, seq)``; the first copy wins, later copies are
  ignored without error (retries);
* ``continued`` false marks a node's final fragment; any fragment with a larger ``seq``
  (arriving before or after it) aborts; a node is complete once seq 0..final all arrived;
* metadata comes from ``seq`` 0 (a leaf's seq 0 must carry it); a later fragment may repeat
  identical metadata (the README's own example does), different metadata aborts;
* a node is a leaf (``chunk_fragment``) or a parent (``child_ids``), never both; a parent
  may stream more ``child_ids`` in later fragments (children in seq order);
* children may be referenced before they arrive; adding an edge that closes a cycle or
  makes a path longer than ``max_depth`` links aborts;
* limits (each past its bound aborts with ``SessionLimit``, RESOURCE_EXHAUSTED):
  ``max_nodes`` node ids (referenced ones included), ``max_fragments`` stored fragments
  (generated ones included), ``max_id_bytes`` per node id, ``max_actions`` open actions,
  ``max_bytes`` of what the session holds (``fragment_bytes``: chunk data, refs, ids,
  metadata, plus a fixed cost per fragment and per child id for their memory; generated
  text; open actions' configs; the bytes read through file refs, ``count_refs``), and
  ``max_prompt_bytes`` per action prompt, each use of a shared node or file counted.

Actions: ``GENERATE`` (input ``prompt`` or ``text``; output ``response`` or ``text``, none
meaning "not wanted", so nothing runs) is accepted at once and started when its input graph
is complete (the data-dependency barrier): outputs of earlier actions count as complete when
those actions finish, so chains and multi-turn conversations need no re-sending.

Pure: no I/O, no ``await``, no clock, no engine import; errors are ``evergreen.errors``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rill.errors import GenerationError, RillError
from rill.protocols._shared.actions import Abort, Close, Rejected, Send
from rill.protocols._shared.driver import Key, Session
from rill.protocols.evergreen import codec
from rill.protocols.evergreen.errors import InputMissing, RuleBroken, SessionLimit, UnknownTarget
from rill.protocols.evergreen.messages import (
    Action,
    Chunk,
    ChunkMetadata,
    GenerateConfig,
    NodeFragment,
    SessionMessage,
)
from rill.protocols.evergreen.prompt import (
    ROLES,
    FileRef,
    ModelFacts,
    PromptItem,
    TextLeaf,
    TurnEnd,
    build_request,
    is_under,
    leaf_item,
)
from rill.types import GenerateRequest, RequestOutput

__all__ = ["EvergreenSession", "SessionLimits", "ModelFacts", "Send", "Generate", "Close", "AbortSession", "Command",
           "FileRef", "TextLeaf", "TurnEnd", "PromptItem", "is_under"]

NodeId = str
ActionId = str
"""An action's number in the session, in order of arrival ("0", "1"...): the driver's key of its request."""

GENERATE = "GENERATE"
INPUT_NAMES = ("prompt", "text")
OUTPUT_NAMES = ("response", "text")
OUTPUT_METADATA = ChunkMetadata(mimetype="text/plain", role="model")
"""Metadata of seq 0 of every output node."""

FRAGMENT_COST_BYTES = 128
"""Bytes a stored fragment counts besides its content: the memory of its objects (an empty
fragment costs about this much), so that a flood of empty fragments meets ``max_bytes``."""
ID_COST_BYTES = 48
"""Bytes each child id of a fragment counts besides its text (a Python string's overhead)."""
ACTION_COST_BYTES = 256
"""Bytes an open action counts besides its configs."""

@dataclass(frozen=True)
class SessionLimits:
    """Per-session bounds and policies (from ``EvergreenConfig`` and ``HttpConfig``)."""

    max_depth: int = 32
    max_nodes: int = 10000
    max_bytes: int = 64 * 1024 * 1024
    max_actions: int = 64
    max_fragments: int = 100_000
    max_id_bytes: int = 1024
    max_prompt_bytes: int = 2 * 1024 * 1024
    request_timeout_s: float | None = None
    file_roots: tuple[str, ...] = ()


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
class _Node:
    id: NodeId
    fragments: dict[int, NodeFragment] = field(default_factory=dict)
    kind: str | None = None  # "leaf" | "parent" once a fragment says so
    final_seq: int | None = None
    max_seq: int = -1
    children: set[NodeId] = field(default_factory=set)
    parents: set[NodeId] = field(default_factory=set)
    output_of: ActionId | None = None  # written by the server for this action
    output_done: bool = False
    output_text: list[str] = field(default_factory=list)

    @property
    def is_complete(self) -> bool:
        if self.output_of is not None:
            return self.output_done
        return self.final_seq is not None and len(self.fragments) == self.final_seq + 1

    def ordered(self) -> list[NodeFragment]:
        return [self.fragments[seq] for seq in sorted(self.fragments)]


@dataclass
class _Action:
    id: ActionId
    input_id: NodeId
    output_id: NodeId | None
    config: GenerateConfig
    is_running: bool = False


class EvergreenSession(Session):
    """State of one Evergreen session (see the module docstring for the rules).

    ``charge`` (optional) is told of every byte the session comes to hold, after the
    per-session ``max_bytes`` check and before the bytes are kept: the adapter charges them
    to the server-wide budget, and an exception it raises (``ResourceExhausted``) aborts
    the session like a broken limit. The session never gives bytes back before it ends, so
    the adapter releases the whole charge when the session is over.
    """

    def __init__(self, limits: SessionLimits, model: ModelFacts,
                 charge: Callable[[int], None] | None = None) -> None:
        self.limits = limits
        self.model = model
        self._charge = charge
        self._nodes: dict[NodeId, _Node] = {}
        self._waiting: dict[ActionId, _Action] = {}
        self._running: dict[ActionId, _Action] = {}
        self._num_actions = 0
        self._num_bytes = 0
        self._num_fragments = 0
        self._is_input_ended = False
        self._is_over = False  # aborted or closed: nothing more to say
        self._complete_subtrees: set[NodeId] = set()

    # -- inbound ---------------------------------------------------------------------------------
    def receive(self, message: SessionMessage) -> list[Command]:
        """Take one client message: store its fragments, accept its actions, start the ready ones.

        Raises:
            RuleBroken, UnsupportedInput, UnknownTarget, SessionLimit: the session must abort.
        """
        if self._is_input_ended:
            raise RuleBroken("a message arrived after the client ended its input")
        for fragment in message.node_fragments:
            self._add_fragment(fragment)
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
            missing = self._missing_client_node(action.input_id, set())
            if missing is not None:
                raise InputMissing(f"the client ended its input but action {action.id} still waits for node "
                                   f"'{missing}', which never arrived complete")
        return self._maybe_close()

    @property
    def num_open_actions(self) -> int:
        """Actions accepted and not finished (waiting for inputs or running)."""
        return len(self._waiting) + len(self._running)

    # -- fragments -------------------------------------------------------------------------------
    def _node(self, node_id: NodeId) -> _Node:
        node = self._nodes.get(node_id)
        if node is None:
            if len(self._nodes) >= self.limits.max_nodes:
                raise SessionLimit(f"the session holds {self.limits.max_nodes} nodes, the most allowed "
                                   "(--evergreen-max-nodes)")
            node = self._nodes[node_id] = _Node(node_id)
        return node

    def _add_fragment(self, f: NodeFragment) -> None:
        if not f.id:
            raise RuleBroken("a node fragment has an empty id")
        self._check_id(f.id)
        if f.seq < 0:
            raise RuleBroken(f"node '{f.id}': seq {f.seq} is negative")
        node = self._node(f.id)
        if node.output_of is not None:
            raise RuleBroken(f"node '{f.id}' is the output of action {node.output_of}; only the server writes it")
        if f.seq in node.fragments:
            return  # a retry: the first copy wins, no error (spec "Ordering")
        if node.final_seq is not None and f.seq > node.final_seq:
            raise RuleBroken(f"node '{f.id}': fragment seq {f.seq} comes after the final fragment (seq {node.final_seq})")
        if not f.continued:
            if f.seq < node.max_seq:
                raise RuleBroken(f"node '{f.id}': fragment seq {node.max_seq} came before seq {f.seq}, "
                                 "which is marked final")
            node.final_seq = f.seq
        self._set_kind(node, f)
        self._check_metadata(node, f)
        for child_id in f.child_ids:
            self._check_id(child_id)
        self._count_fragment()
        self._add_bytes(fragment_bytes(f))
        node.fragments[f.seq] = f
        node.max_seq = max(node.max_seq, f.seq)
        first = node.fragments.get(0)
        if node.kind == "leaf" and first is not None and first.chunk_fragment is None:
            raise RuleBroken(f"node '{f.id}': fragment seq 0 of a leaf must carry chunk metadata with a mimetype")
        for child_id in f.child_ids:
            self._add_edge(node, child_id)

    def _set_kind(self, node: _Node, f: NodeFragment) -> None:
        if f.child_ids and f.chunk_fragment is not None:
            raise RuleBroken(f"node '{f.id}': a fragment has both child_ids and chunk_fragment "
                             "(a node is a leaf or a parent, not both)")
        kind = "parent" if f.child_ids else "leaf" if f.chunk_fragment is not None else None
        if kind is None:
            return
        if node.kind is not None and node.kind != kind:
            raise RuleBroken(f"node '{f.id}' mixes child_ids and chunk_fragment across fragments "
                             "(a node is a leaf or a parent, not both)")
        node.kind = kind

    def _check_metadata(self, node: _Node, f: NodeFragment) -> None:
        # Fragments may arrive out of order, so seq 0 is compared with every other fragment
        # whichever of the two comes second.
        metadata = f.chunk_fragment.metadata if f.chunk_fragment is not None else None
        if f.seq == 0:
            if f.chunk_fragment is not None and (metadata is None or not metadata.mimetype):
                raise RuleBroken(f"node '{f.id}': fragment seq 0 of a leaf must carry metadata with a mimetype")
            for other in node.fragments.values():
                self._compare_metadata(f, other)
        elif metadata is not None and 0 in node.fragments:
            self._compare_metadata(node.fragments[0], f)

    @staticmethod
    def _compare_metadata(first: NodeFragment, later: NodeFragment) -> None:
        later_meta = later.chunk_fragment.metadata if later.chunk_fragment is not None else None
        if later_meta is None:
            return
        first_meta = first.chunk_fragment.metadata if first.chunk_fragment is not None else None
        if first_meta != later_meta:
            raise RuleBroken(f"node '{later.id}': fragment seq {later.seq} carries metadata different from "
                             "seq 0's (metadata is set once, on seq 0)")

    def _check_id(self, node_id: NodeId) -> None:
        if _utf8_len(node_id) > self.limits.max_id_bytes:
            raise SessionLimit(f"a node id of {_utf8_len(node_id)} bytes is longer than {self.limits.max_id_bytes} "
                               f"bytes (--evergreen-max-id-bytes): '{node_id[:32]}…'")

    def _count_fragment(self) -> None:
        if self._num_fragments >= self.limits.max_fragments:
            raise SessionLimit(f"the session holds {self.limits.max_fragments} node fragments, the most allowed "
                               "(--evergreen-max-fragments)")
        self._num_fragments += 1

    def _add_bytes(self, num_bytes: int) -> None:
        if self._num_bytes + num_bytes > self.limits.max_bytes:
            raise SessionLimit(f"the session would hold more than {self.limits.max_bytes} bytes "
                               "(--evergreen-max-bytes)")
        if self._charge is not None:
            self._charge(num_bytes)
        self._num_bytes += num_bytes

    def _add_edge(self, parent: _Node, child_id: NodeId) -> None:
        if not child_id:
            raise RuleBroken(f"node '{parent.id}' lists an empty child id")
        child = self._node(child_id)
        if child_id in parent.children:
            return
        if child_id == parent.id or self._reaches(child_id, parent.id):
            raise RuleBroken(f"node '{parent.id}' -> '{child_id}' closes a cycle (a node cannot include itself)")
        depth = self._depth_above(parent.id, {}) + 1 + self._height(child_id, {})
        if depth > self.limits.max_depth:
            raise RuleBroken(f"node '{parent.id}' -> '{child_id}' nests {depth} levels deep, more than "
                             f"{self.limits.max_depth} (--evergreen-max-depth)")
        parent.children.add(child_id)
        child.parents.add(parent.id)

    def _reaches(self, start: NodeId, goal: NodeId) -> bool:
        stack, seen = [start], {start}
        while stack:
            for child in self._nodes[stack.pop()].children:
                if child == goal:
                    return True
                if child not in seen:
                    seen.add(child)
                    stack.append(child)
        return False

    def _height(self, node_id: NodeId, memo: dict[NodeId, int]) -> int:
        # Longest chain of links below node_id (the graph is acyclic: edges are checked on entry).
        if node_id not in memo:
            memo[node_id] = max((1 + self._height(c, memo) for c in self._nodes[node_id].children), default=0)
        return memo[node_id]

    def _depth_above(self, node_id: NodeId, memo: dict[NodeId, int]) -> int:
        if node_id not in memo:
            memo[node_id] = max((1 + self._depth_above(p, memo) for p in self._nodes[node_id].parents), default=0)
        return memo[node_id]

    # -- actions ---------------------------------------------------------------------------------
    def _add_action(self, action: Action) -> None:
        action_id = str(self._num_actions)
        label = f"action {action_id} ({action.name or 'unnamed'})"
        if action.name != GENERATE:
            raise RuleBroken(f"{label}: unknown action name '{action.name}' (rill runs {GENERATE})")
        target = action.target_spec.id if action.target_spec is not None else ""
        if target and target != self.model.name:
            raise UnknownTarget(f"{label}: target_spec.id '{target}' is not served here (this server runs "
                                f"'{self.model.name}'; leave it empty for the default)")
        config = self._config(action, label)
        max_id = self.limits.max_id_bytes
        input_id = self._one_param(action.inputs, INPUT_NAMES, "input", label, required=True, max_id_bytes=max_id)
        output_id = self._one_param(action.outputs, OUTPUT_NAMES, "output", label, required=False, max_id_bytes=max_id)
        if self.num_open_actions >= self.limits.max_actions:
            raise SessionLimit(f"{label}: {self.limits.max_actions} actions are already open "
                               "(--evergreen-max-actions)")
        assert input_id is not None
        self._node(input_id)
        if output_id is not None:
            self._claim_output(output_id, input_id, action_id, label)
        self._num_actions += 1
        if output_id is not None:  # no output wanted: nothing to compute
            self._add_bytes(ACTION_COST_BYTES + sum(_utf8_len(c.type_url) + len(c.value) for c in action.configs))
            self._waiting[action_id] = _Action(action_id, input_id, output_id, config)

    def _config(self, action: Action, label: str) -> GenerateConfig:
        merged: dict[str, Any] = {}
        for any_config in action.configs:
            config = codec.decode_config(any_config)
            if config is None:
                raise RuleBroken(f"{label}: unknown config type '{any_config.type_url}' (rill takes "
                                 "type.googleapis.com/rill.evergreen.v1.GenerateConfig)")
            merged.update({k: v for k, v in _fields(config).items() if v is not None and v != ()})
        return GenerateConfig(**merged)

    @staticmethod
    def _one_param(params: tuple[Any, ...], names: tuple[str, ...], what: str, label: str, *, required: bool,
                   max_id_bytes: int) -> NodeId | None:
        found = None
        for param in params:
            if param.name not in names:
                raise RuleBroken(f"{label}: unknown {what} name '{param.name}' (use {' or '.join(names)})")
            if not param.id:
                raise RuleBroken(f"{label}: {what} '{param.name}' has an empty node id")
            if _utf8_len(param.id) > max_id_bytes:
                raise SessionLimit(f"{label}: {what} '{param.name}' names a node id longer than {max_id_bytes} "
                                   "bytes (--evergreen-max-id-bytes)")
            if found is not None:
                raise RuleBroken(f"{label}: more than one {what} ({' and '.join(names)} name the same parameter)")
            found = param.id
        if found is None and required:
            raise RuleBroken(f"{label}: no input named {' or '.join(names)}")
        return found

    def _claim_output(self, output_id: NodeId, input_id: NodeId, action_id: ActionId, label: str) -> None:
        node = self._node(output_id)
        if node.fragments or node.output_of is not None or output_id == input_id:
            raise RuleBroken(f"{label}: output node id '{output_id}' is not new (output ids must not be reused)")
        if self._reaches(input_id, output_id):
            raise RuleBroken(f"{label}: output node '{output_id}' is part of the action's own input")
        node.output_of = action_id
        node.kind = "leaf"

    def _start_ready(self) -> list[Command]:
        commands: list[Command] = []
        for action in list(self._waiting.values()):
            if self._is_ready(action.input_id, {}):
                del self._waiting[action.id]
                self._running[action.id] = action
                action.is_running = True
                items, num_inline_bytes = self._flatten(action.input_id)
                commands.append(Generate(action.id, tuple(items), action.config, num_inline_bytes))
        return commands

    def _is_ready(self, node_id: NodeId, memo: dict[NodeId, bool]) -> bool:
        # Completeness only ever grows (a complete node takes no more fragments, so no more
        # children), hence whole complete subtrees are remembered for the session: each
        # check only walks the part of the graph that is still incomplete.
        if node_id in self._complete_subtrees:
            return True
        if node_id not in memo:
            node = self._nodes[node_id]
            memo[node_id] = node.is_complete and all(self._is_ready(c, memo) for c in node.children)
            if memo[node_id]:
                self._complete_subtrees.add(node_id)
        return memo[node_id]

    def _missing_client_node(self, node_id: NodeId, seen: set[NodeId]) -> NodeId | None:
        # The first incomplete node of the graph that only the client could still complete.
        if node_id in seen:
            return None
        seen.add(node_id)
        node = self._nodes[node_id]
        if node.output_of is not None:
            return None  # a running or waiting action will complete it (or its own check fails)
        if not node.is_complete:
            return node_id
        for child in node.children:
            missing = self._missing_client_node(child, seen)
            if missing is not None:
                return missing
        return None

    # -- prompt ------------------------------------------------------------------------------------
    def _flatten(self, root_id: NodeId) -> tuple[list[PromptItem], int]:
        # No byte is copied here (items refer to the stored fragments' data); the budgets
        # bound the walk (uses of nodes) and the prompt it describes (bytes per use).
        items: list[PromptItem] = []
        budget = [self.limits.max_nodes, self.limits.max_prompt_bytes]
        self._flatten_into(root_id, items, budget)
        return items, self.limits.max_prompt_bytes - budget[1]

    def _flatten_into(self, node_id: NodeId, items: list[PromptItem], budget: list[int]) -> None:
        node = self._nodes[node_id]
        budget[0] -= 1
        if budget[0] < 0:
            raise SessionLimit(f"the prompt flattens to more than {self.limits.max_nodes} nodes (shared nodes count "
                               "once per use)")
        if node.kind == "parent":
            for f in node.ordered():
                for child_id in f.child_ids:
                    self._flatten_into(child_id, items, budget)
            return
        if node.output_of is not None:
            text = "".join(node.output_text).encode()
            self._spend_prompt_bytes(budget, len(text))
            items.append(TextLeaf(node_id, ROLES["model"], (text,)))
            return
        if node.kind is None:
            return  # an empty node contributes nothing
        metadata = node.fragments[0].chunk_fragment.metadata  # type: ignore[union-attr]
        assert metadata is not None  # checked on arrival of seq 0
        chunks = [f.chunk_fragment for f in node.ordered() if f.chunk_fragment is not None]
        item = leaf_item(node_id, metadata, chunks, self.model, self.limits.file_roots)
        if isinstance(item, TextLeaf):
            self._spend_prompt_bytes(budget, sum(len(p) for p in item.pieces if isinstance(p, bytes)))
        items.append(item)

    def _spend_prompt_bytes(self, budget: list[int], num_bytes: int) -> None:
        budget[1] -= num_bytes
        if budget[1] < 0:
            raise SessionLimit(f"the prompt expands to more than {self.limits.max_prompt_bytes} bytes "
                               "(--evergreen-max-prompt-bytes; a shared node counts once per use)")

    def ref_budget(self, command: Generate) -> int:
        """Most bytes the adapter may read through ``command``'s file refs (each file once):
        what is left of the session's ``max_bytes`` and of the action's prompt budget."""
        return max(0, min(self.limits.max_bytes - self._num_bytes,
                          self.limits.max_prompt_bytes - command.num_inline_bytes))

    def count_refs(self, command: Generate, contents: dict[str, bytes], num_read_bytes: int) -> None:
        """Count what the adapter read for ``command``: ``num_read_bytes`` (each file once)
        against the session's ``max_bytes``, and the prompt with each ref's content once per
        use against ``max_prompt_bytes``. Call it before ``request_for``.

        Raises:
            SessionLimit: either bound is passed.
        """
        num_prompt_bytes = command.num_inline_bytes + sum(len(contents[ref.path]) for ref in command.refs)
        if num_prompt_bytes > self.limits.max_prompt_bytes:
            raise SessionLimit(f"action {command.action_id}: the prompt expands to {num_prompt_bytes} bytes with "
                               f"its file refs, more than {self.limits.max_prompt_bytes} "
                               "(--evergreen-max-prompt-bytes; a file counts once per ref)")
        self._add_bytes(num_read_bytes)

    def request_for(self, command: Generate, ref_bytes: dict[str, bytes]) -> GenerateRequest:
        """The engine request of a started action, its file refs' contents given by path
        (see ``prompt.build_request`` for the rules and errors).

        It reads only ``command``, ``ref_bytes`` and the session's frozen limits and model
        facts, so the adapter may run it in a worker thread: a large prompt is joined and
        decoded there, not on the event loop.
        """
        return build_request(command.action_id, command.items, command.config, ref_bytes, self.model,
                             deadline_s=self.limits.request_timeout_s)


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
        node = self._nodes[action.output_id]
        commands: list[Command] = []
        if text or finished:
            self._count_fragment()
            self._add_bytes(FRAGMENT_COST_BYTES + len(text.encode()))
            seq = len(node.fragments)
            chunk = Chunk(metadata=OUTPUT_METADATA if seq == 0 else None, data=text.encode())
            fragment = NodeFragment(id=node.id, seq=seq, continued=not finished, chunk_fragment=chunk)
            node.fragments[seq] = fragment
            node.output_text.append(text)
            commands.append(Send(SessionMessage(node_fragments=(fragment,))))
        if finished:
            node.output_done = True
            node.final_seq = len(node.fragments) - 1
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
            raise InputMissing(f"action {stuck.id} waits for outputs of actions that can never run "
                               "(an action's input includes its own output)")
        self._is_over = True
        return [Close()]


def fragment_bytes(f: NodeFragment) -> int:
    """What a stored client fragment counts against ``max_bytes``: its chunk data, ref, ids and
    metadata, ``FRAGMENT_COST_BYTES`` and ``ID_COST_BYTES`` per child id."""
    num_bytes = FRAGMENT_COST_BYTES + _utf8_len(f.id) + sum(ID_COST_BYTES + _utf8_len(c) for c in f.child_ids)
    chunk = f.chunk_fragment
    if chunk is not None:
        num_bytes += len(chunk.data or b"") + _utf8_len(chunk.ref or "")
        meta = chunk.metadata
        if meta is not None:
            num_bytes += _utf8_len(meta.mimetype) + _utf8_len(meta.role) + _utf8_len(meta.original_file_name)
            num_bytes += sum(_utf8_len(a.type_url) + len(a.value) for a in meta.experimental)
    return num_bytes


def _utf8_len(text: str) -> int:
    # surrogatepass: a count must not fail on text the codec let through
    return len(text.encode("utf-8", "surrogatepass"))


def _fields(struct: object) -> dict[str, Any]:
    return {name: getattr(struct, name) for name in struct.__struct_fields__}  # type: ignore[attr-defined]
