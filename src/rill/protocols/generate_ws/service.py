"""What ``/generate`` keeps beyond one connection, apart from its transport.

The model's name and limits as the session sees them, the session each connection starts
with, API-key checks and principals, the feedback store (opened on first use, written in a
worker thread), the charge of the generations a connection remembers for feedback to the
server's session-memory budget, and the conversations recording a resumable generation
(``live``), which a ``resume`` from another connection takes over.

Not pure (``NOT_PURE`` in ``tests/protocols/test_purity.py``): it reads the engine client and
writes feedback to disk. The sockets and HTTP are ``adapter.py``'s.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine
from typing import Any

from rill import __version__, auth
from rill.config import parse_size
from rill.deps import Deps
from rill.errors import RillError
from rill.feedback import FeedbackStore
from rill.frontend.budget import Lease
from rill.protocols.generate_ws import session as s

log = logging.getLogger("rill.protocols.generate_ws")


class GenerateService:
    """The protocol's shared state: settings, the engine client, the feedback store."""

    def __init__(self, deps: Deps) -> None:
        self.deps = deps
        self.client = deps.client
        self.http = deps.config.http
        self.registry = deps.resumable
        self.live: dict[str, Any] = {}
        """The conversations (``adapter._Wire``) recording a resumable generation, by its id:
        one per running resumable generation, so at most the registry's ``max_streams``."""
        self._feedback: FeedbackStore | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._feedback_lock = threading.Lock()  # two first feedbacks open one store

    def spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` in a task of its own, held until it ends (from a callback that cannot await)."""
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def limits(self) -> s.Limits:
        """What the session knows of the model (it changes once the model has loaded)."""
        return s.Limits(
            model_name=self.client.served_model_name,
            model_info=self.client.model_info,
            version=__version__,
            max_feedback_per_generation=self.http.feedback_max_per_generation,
            max_feedback_per_connection=self.http.feedback_max_per_connection,
        )

    def new_session(self) -> s.GenerateSession:
        """A connection's session: it names logprob alternatives with the tokenizer and asks
        for the limits again as each generation starts."""
        return s.GenerateSession(self.limits(), token_text=self.token_text, current_limits=self.limits)

    def authorize(self, headers: Any, query: Any, subprotocols: Any = ()) -> tuple[bool, str | None]:
        """Check the API key (``rill.auth.websocket_key``: header, key subprotocol or query);
        returns (ok, key)."""
        key = auth.websocket_key(headers.get("authorization"), subprotocols, query.get("api_key"))
        return auth.is_authorized(self.deps.api_keys, key), key

    def principal(self, key: str | None, scope: Any) -> str:
        """Who asks (``rill.auth.principal``): the key when keys are on (it was checked), else
        the client's address (a key sent to a server without keys names nobody)."""
        return auth.principal(key, None) if self.deps.api_keys and key else auth.scope_principal(scope)

    def token_text(self, token_id: int) -> str:
        """Text of one token (for logprob alternatives)."""
        try:
            return self.client.decode([token_id])
        except Exception:  # noqa: BLE001 - a name for an alternative is cosmetic
            return ""

    def feedback_store(self) -> FeedbackStore:
        """The store, opened on first use (blocking: it connects to the database)."""
        with self._feedback_lock:
            if self._feedback is None:
                self._feedback = self._open_feedback_store()
            return self._feedback

    def _open_feedback_store(self) -> FeedbackStore:
        days = self.http.feedback_retention_days
        return FeedbackStore(
            self.deps.config.storage.database or self.http.data_dir,
            max_text_bytes=self.http.feedback_max_text_bytes,
            max_store_bytes=parse_size(self.http.feedback_max_store_bytes, "feedback_max_store_bytes"),
            max_principal_bytes=self.http.feedback_quota_bytes(),
            retention_s=None if days is None else days * 86400,
        )

    async def store_feedback(self, record: dict[str, Any], api_key: str | None, principal: str) -> int:
        """Store one feedback record (in a worker thread: the store commits to disk); its id.

        Raises:
            RillError: the store is full (its message says so), or storing failed (a generic
                message: storage internals are never shown).
        """
        hint = api_key[-4:] if api_key else None
        try:
            return await asyncio.to_thread(lambda: self.feedback_store().add(record, s.PROTOCOL, hint, principal))
        except RillError:
            raise
        except Exception as exc:  # never leak storage internals
            log.exception("storing feedback failed")
            raise RillError("feedback could not be stored") from exc

    def history(self, principal: str, session: s.GenerateSession) -> History:
        """The charge of what ``session`` remembers for feedback, under ``principal``."""
        memory = self.deps.memory
        return History(memory.lease(principal) if memory is not None else None, session)


class History:
    """Charges the generations a session remembers for feedback (prompts up to
    ``--max-prompt-chars`` each) to the server's session-memory budget; when it is short, the
    session forgets its oldest ones."""

    def __init__(self, lease: Lease | None, session: s.GenerateSession) -> None:
        self.lease = lease
        self.session = session

    def charge(self) -> None:
        """Bring the charge to what the session holds now (cheap when nothing changed)."""
        lease, wanted = self.lease, self.session.num_history_bytes
        if lease is None or lease.held == wanted:
            return
        held = lease.fit(wanted)
        if held < wanted:
            self.session.forget_history(held)
            lease.fit(self.session.num_history_bytes)

    def close(self) -> None:
        """Give everything back (the connection ended)."""
        if self.lease is not None:
            self.lease.close()
