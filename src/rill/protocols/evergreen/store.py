"""The node store of one Evergreen session: fragments, links, completeness and the session's bounds.

``EvergreenSession`` (``session.py``) keeps one ``NodeStore``: it stores the client's
fragments (``add_fragment``), names the nodes its actions read and write (``node``,
``claim_output``), appends the text an action generates (``add_output``), asks whether an
action's input graph is complete (``is_complete``) and flattens it into prompt items
(``flatten``). Every byte the session comes to hold is counted here (``add_bytes``).

Rules (spec "Ordering", "Boundaries", "Mime type"; wire-notes §1.4):

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
* an action's output node is written by the server only, and counts as complete once the
  action finished: chains and multi-turn conversations need no re-sending;
* limits (each past its bound aborts with ``SessionLimit``, RESOURCE_EXHAUSTED):
  ``max_nodes`` node ids (referenced ones included), ``max_fragments`` stored fragments
  (generated ones included), ``max_id_bytes`` per node id, ``max_bytes`` of what the session
  holds (``fragment_bytes``: chunk data, refs, ids, metadata, plus a fixed cost per fragment
  and per child id for their memory; and what the session adds through ``add_bytes``), and
  ``max_prompt_bytes`` per flattened prompt, each use of a shared node counted.

Pure: no I/O, no ``await``, no clock, no engine import; errors are ``evergreen.errors``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from rill.protocols.evergreen.errors import RuleBroken, SessionLimit
from rill.protocols.evergreen.messages import Chunk, ChunkMetadata, NodeFragment
from rill.protocols.evergreen.prompt import ROLES, ModelFacts, PromptItem, TextLeaf, leaf_item

NodeId = str
ActionId = str
"""An action's number in the session, in order of arrival ("0", "1"...): the driver's key of its request."""

OUTPUT_METADATA = ChunkMetadata(mimetype="text/plain", role="model")
"""Metadata of seq 0 of every output node."""

FRAGMENT_COST_BYTES = 128
"""Bytes a stored fragment counts besides its content: the memory of its objects (an empty
fragment costs about this much), so that a flood of empty fragments meets ``max_bytes``."""
ID_COST_BYTES = 48
"""Bytes each child id of a fragment counts besides its text (a Python string's overhead)."""


@dataclass(frozen=True)
class SessionLimits:
    """Per-session bounds and policies (from ``EvergreenConfig`` and ``HttpConfig``): the
    store's bounds, and those of the session's actions (``max_actions``, the request time
    limit, the folders file refs may name)."""

    max_depth: int = 32
    max_nodes: int = 10000
    max_bytes: int = 64 * 1024 * 1024
    max_actions: int = 64
    max_fragments: int = 100_000
    max_id_bytes: int = 1024
    max_prompt_bytes: int = 2 * 1024 * 1024
    request_timeout_s: float | None = None
    file_roots: tuple[str, ...] = ()


@dataclass
class Node:
    """One node of the session: its fragments by ``seq`` and its links."""

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
        """Every fragment up to the final one arrived (an output node: its action finished)."""
        if self.output_of is not None:
            return self.output_done
        return self.final_seq is not None and len(self.fragments) == self.final_seq + 1

    def ordered(self) -> list[NodeFragment]:
        """The fragments held, in ``seq`` order."""
        return [self.fragments[seq] for seq in sorted(self.fragments)]


class NodeStore:
    """The nodes of one session and what they hold (see the module docstring for the rules).

    ``charge`` (optional) is told of every byte counted, after the ``max_bytes`` check and
    before the bytes are kept; an exception it raises aborts the session like a broken limit.
    """

    def __init__(self, limits: SessionLimits, charge: Callable[[int], None] | None = None) -> None:
        self.limits = limits
        self._charge = charge
        self.nodes: dict[NodeId, Node] = {}
        self.num_bytes = 0
        """What the session holds, counted against ``max_bytes``."""
        self._num_fragments = 0
        self._complete_subtrees: set[NodeId] = set()

    # -- counting ------------------------------------------------------------------------------
    def node(self, node_id: NodeId) -> Node:
        """The node ``node_id``, created (and counted against ``max_nodes``) on first mention."""
        node = self.nodes.get(node_id)
        if node is None:
            if len(self.nodes) >= self.limits.max_nodes:
                raise SessionLimit(
                    f"the session holds {self.limits.max_nodes} nodes, the most allowed (--evergreen-max-nodes)"
                )
            node = self.nodes[node_id] = Node(node_id)
        return node

    def add_bytes(self, num_bytes: int) -> None:
        """Count ``num_bytes`` more held by the session; ``SessionLimit`` past ``max_bytes``."""
        if self.num_bytes + num_bytes > self.limits.max_bytes:
            raise SessionLimit(
                f"the session would hold more than {self.limits.max_bytes} bytes (--evergreen-max-bytes)"
            )
        if self._charge is not None:
            self._charge(num_bytes)
        self.num_bytes += num_bytes

    def _count_fragment(self) -> None:
        if self._num_fragments >= self.limits.max_fragments:
            raise SessionLimit(
                f"the session holds {self.limits.max_fragments} node fragments, the most allowed "
                "(--evergreen-max-fragments)"
            )
        self._num_fragments += 1

    def _check_id(self, node_id: NodeId) -> None:
        if utf8_len(node_id) > self.limits.max_id_bytes:
            raise SessionLimit(
                f"a node id of {utf8_len(node_id)} bytes is longer than {self.limits.max_id_bytes} "
                f"bytes (--evergreen-max-id-bytes): '{node_id[:32]}…'"
            )

    # -- client fragments ----------------------------------------------------------------------
    def add_fragment(self, f: NodeFragment) -> None:
        """Store one client fragment (a retry of a stored one is ignored).

        Raises:
            RuleBroken, SessionLimit: the session must abort.
        """
        if not f.id:
            raise RuleBroken("a node fragment has an empty id")
        self._check_id(f.id)
        if f.seq < 0:
            raise RuleBroken(f"node '{f.id}': seq {f.seq} is negative")
        node = self.node(f.id)
        if node.output_of is not None:
            raise RuleBroken(f"node '{f.id}' is the output of action {node.output_of}; only the server writes it")
        if f.seq in node.fragments:
            return  # a retry: the first copy wins, no error (spec "Ordering")
        if node.final_seq is not None and f.seq > node.final_seq:
            raise RuleBroken(
                f"node '{f.id}': fragment seq {f.seq} comes after the final fragment (seq {node.final_seq})"
            )
        if not f.continued:
            if f.seq < node.max_seq:
                raise RuleBroken(
                    f"node '{f.id}': fragment seq {node.max_seq} came before seq {f.seq}, which is marked final"
                )
            node.final_seq = f.seq
        self._set_kind(node, f)
        self._check_metadata(node, f)
        for child_id in f.child_ids:
            self._check_id(child_id)
        self._count_fragment()
        self.add_bytes(fragment_bytes(f))
        node.fragments[f.seq] = f
        node.max_seq = max(node.max_seq, f.seq)
        first = node.fragments.get(0)
        if node.kind == "leaf" and first is not None and first.chunk_fragment is None:
            raise RuleBroken(f"node '{f.id}': fragment seq 0 of a leaf must carry chunk metadata with a mimetype")
        for child_id in f.child_ids:
            self._add_edge(node, child_id)

    def _set_kind(self, node: Node, f: NodeFragment) -> None:
        if f.child_ids and f.chunk_fragment is not None:
            raise RuleBroken(
                f"node '{f.id}': a fragment has both child_ids and chunk_fragment "
                "(a node is a leaf or a parent, not both)"
            )
        kind = "parent" if f.child_ids else "leaf" if f.chunk_fragment is not None else None
        if kind is None:
            return
        if node.kind is not None and node.kind != kind:
            raise RuleBroken(
                f"node '{f.id}' mixes child_ids and chunk_fragment across fragments "
                "(a node is a leaf or a parent, not both)"
            )
        node.kind = kind

    def _check_metadata(self, node: Node, f: NodeFragment) -> None:
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
            raise RuleBroken(
                f"node '{later.id}': fragment seq {later.seq} carries metadata different from "
                "seq 0's (metadata is set once, on seq 0)"
            )

    # -- links ---------------------------------------------------------------------------------
    def _add_edge(self, parent: Node, child_id: NodeId) -> None:
        if not child_id:
            raise RuleBroken(f"node '{parent.id}' lists an empty child id")
        child = self.node(child_id)
        if child_id in parent.children:
            return
        if child_id == parent.id or self.reaches(child_id, parent.id):
            raise RuleBroken(f"node '{parent.id}' -> '{child_id}' closes a cycle (a node cannot include itself)")
        depth = self._depth_above(parent.id, {}) + 1 + self._height(child_id, {})
        if depth > self.limits.max_depth:
            raise RuleBroken(
                f"node '{parent.id}' -> '{child_id}' nests {depth} levels deep, more than "
                f"{self.limits.max_depth} (--evergreen-max-depth)"
            )
        parent.children.add(child_id)
        child.parents.add(parent.id)

    def reaches(self, start: NodeId, goal: NodeId) -> bool:
        """Whether ``goal`` is below ``start`` (``start`` itself excluded)."""
        stack, seen = [start], {start}
        while stack:
            for child in self.nodes[stack.pop()].children:
                if child == goal:
                    return True
                if child not in seen:
                    seen.add(child)
                    stack.append(child)
        return False

    def _height(self, node_id: NodeId, memo: dict[NodeId, int]) -> int:
        # Longest chain of links below node_id (the graph is acyclic: edges are checked on entry).
        if node_id not in memo:
            memo[node_id] = max((1 + self._height(c, memo) for c in self.nodes[node_id].children), default=0)
        return memo[node_id]

    def _depth_above(self, node_id: NodeId, memo: dict[NodeId, int]) -> int:
        if node_id not in memo:
            memo[node_id] = max((1 + self._depth_above(p, memo) for p in self.nodes[node_id].parents), default=0)
        return memo[node_id]

    # -- outputs -------------------------------------------------------------------------------
    def claim_output(self, output_id: NodeId, input_id: NodeId, action_id: ActionId, label: str) -> None:
        """Make ``output_id`` the output node of action ``action_id`` (``label`` names it in errors).

        Raises:
            RuleBroken: the node is not new, or it is part of the action's input.
        """
        node = self.node(output_id)
        if node.fragments or node.output_of is not None or output_id == input_id:
            raise RuleBroken(f"{label}: output node id '{output_id}' is not new (output ids must not be reused)")
        if self.reaches(input_id, output_id):
            raise RuleBroken(f"{label}: output node '{output_id}' is part of the action's own input")
        node.output_of = action_id
        node.kind = "leaf"

    def add_output(self, node_id: NodeId, text: str, finished: bool) -> NodeFragment | None:
        """Append generated ``text`` to output node ``node_id`` as its next fragment (the final
        one when ``finished``); None when there is neither text nor an end to send.

        Raises:
            SessionLimit: the fragment or its bytes are past the session's bounds.
        """
        node = self.nodes[node_id]
        fragment = None
        if text or finished:
            self._count_fragment()
            self.add_bytes(FRAGMENT_COST_BYTES + len(text.encode()))
            seq = len(node.fragments)
            chunk = Chunk(metadata=OUTPUT_METADATA if seq == 0 else None, data=text.encode())
            fragment = NodeFragment(id=node.id, seq=seq, continued=not finished, chunk_fragment=chunk)
            node.fragments[seq] = fragment
            node.output_text.append(text)
        if finished:
            node.output_done = True
            node.final_seq = len(node.fragments) - 1
        return fragment

    # -- completeness --------------------------------------------------------------------------
    def is_complete(self, node_id: NodeId, memo: dict[NodeId, bool] | None = None) -> bool:
        """Whether ``node_id`` and everything below it are complete."""
        # Completeness only ever grows (a complete node takes no more fragments, so no more
        # children), hence whole complete subtrees are remembered for the session: each
        # check only walks the part of the graph that is still incomplete.
        memo = {} if memo is None else memo
        if node_id in self._complete_subtrees:
            return True
        if node_id not in memo:
            node = self.nodes[node_id]
            memo[node_id] = node.is_complete and all(self.is_complete(c, memo) for c in node.children)
            if memo[node_id]:
                self._complete_subtrees.add(node_id)
        return memo[node_id]

    def missing_client_node(self, node_id: NodeId, seen: set[NodeId] | None = None) -> NodeId | None:
        """The first incomplete node under ``node_id`` that only the client could still complete."""
        seen = set() if seen is None else seen
        if node_id in seen:
            return None
        seen.add(node_id)
        node = self.nodes[node_id]
        if node.output_of is not None:
            return None  # a running or waiting action will complete it (or its own check fails)
        if not node.is_complete:
            return node_id
        for child in node.children:
            missing = self.missing_client_node(child, seen)
            if missing is not None:
                return missing
        return None

    # -- prompt --------------------------------------------------------------------------------
    def flatten(self, root_id: NodeId, model: ModelFacts) -> tuple[list[PromptItem], int]:
        """The prompt items of the complete graph under ``root_id``, depth first, and the bytes
        of their inline text (each use of a shared node counted).

        Raises:
            SessionLimit: more than ``max_nodes`` uses of nodes, or more than
                ``max_prompt_bytes`` of inline text.
        """
        # No byte is copied here (items refer to the stored fragments' data); the budgets
        # bound the walk (uses of nodes) and the prompt it describes (bytes per use).
        items: list[PromptItem] = []
        budget = [self.limits.max_nodes, self.limits.max_prompt_bytes]
        self._flatten_into(root_id, model, items, budget)
        return items, self.limits.max_prompt_bytes - budget[1]

    def _flatten_into(self, node_id: NodeId, model: ModelFacts, items: list[PromptItem], budget: list[int]) -> None:
        node = self.nodes[node_id]
        budget[0] -= 1
        if budget[0] < 0:
            raise SessionLimit(
                f"the prompt flattens to more than {self.limits.max_nodes} nodes (shared nodes count once per use)"
            )
        if node.kind == "parent":
            for f in node.ordered():
                for child_id in f.child_ids:
                    self._flatten_into(child_id, model, items, budget)
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
        item = leaf_item(node_id, metadata, chunks, model, self.limits.file_roots)
        if isinstance(item, TextLeaf):
            self._spend_prompt_bytes(budget, sum(len(p) for p in item.pieces if isinstance(p, bytes)))
        items.append(item)

    def _spend_prompt_bytes(self, budget: list[int], num_bytes: int) -> None:
        budget[1] -= num_bytes
        if budget[1] < 0:
            raise SessionLimit(
                f"the prompt expands to more than {self.limits.max_prompt_bytes} bytes "
                "(--evergreen-max-prompt-bytes; a shared node counts once per use)"
            )


def fragment_bytes(f: NodeFragment) -> int:
    """What a stored client fragment counts against ``max_bytes``: its chunk data, ref, ids and
    metadata, ``FRAGMENT_COST_BYTES`` and ``ID_COST_BYTES`` per child id."""
    num_bytes = FRAGMENT_COST_BYTES + utf8_len(f.id) + sum(ID_COST_BYTES + utf8_len(c) for c in f.child_ids)
    chunk = f.chunk_fragment
    if chunk is not None:
        num_bytes += len(chunk.data or b"") + utf8_len(chunk.ref or "")
        meta = chunk.metadata
        if meta is not None:
            num_bytes += utf8_len(meta.mimetype) + utf8_len(meta.role) + utf8_len(meta.original_file_name)
            num_bytes += sum(utf8_len(a.type_url) + len(a.value) for a in meta.experimental)
    return num_bytes


def utf8_len(text: str) -> int:
    """Bytes of ``text`` in UTF-8, lone surrogates included."""
    # surrogatepass: a count must not fail on text the codec let through
    return len(text.encode("utf-8", "surrogatepass"))
