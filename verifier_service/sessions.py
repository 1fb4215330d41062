"""Per-client sessions: a KV cache, a position and sampling settings, with LRU and idle TTL."""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shared.sampling import SamplingConfig
from verifier_service.errors import VerifierError


@dataclass
class Session:
    slot: int  # KV pool slot holding position - 1 tokens
    position: int  # committed tokens (prompt + generated)
    config: SamplingConfig
    id: str = field(default_factory=lambda: secrets.token_urlsafe(12))
    last_used: float = 0.0
    owner: str | None = None  # the API key that opened it; other keys see 404
    create_digest: str = ""  # of the create request, so a retried create is recognised
    # The last verify answered, so a retried call (same position, same body) gets the same
    # answer without advancing the cache again.
    last_verify_position: int = -1
    last_verify_digest: str = ""
    last_reply: Any = None


class SessionStore:
    """Sessions by id. Over ``max_sessions`` the least recently used is evicted; sessions idle
    longer than ``ttl_s`` expire. Unknown, evicted and expired ids all answer 404."""

    def __init__(self, max_sessions: int, ttl_s: float,
                 clock: Callable[[], float] = time.monotonic,
                 on_drop: Callable[[Session], None] = lambda session: None,
                 max_per_owner: int = 0) -> None:
        self.max_sessions, self.ttl_s, self.clock = max_sessions, ttl_s, clock
        self.max_per_owner = max_per_owner  # 0: no per-key limit
        self.on_drop = on_drop  # frees what a session holds (its KV slot)
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._lock = threading.Lock()
        self.evicted = 0
        self.expired = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def add(self, session: Session) -> None:
        with self._lock:
            session.last_used = self.clock()
            self._sessions[session.id] = session
            while len(self._sessions) > self.max_sessions:
                self.on_drop(self._sessions.popitem(last=False)[1])
                self.evicted += 1

    def get(self, session_id: str, owner: str | None = None) -> Session:
        with self._lock:
            session = self._sessions.get(session_id)
            if session is not None and session.owner != owner:
                session = None  # another key's session does not exist for this caller
            now = self.clock()
            if session is not None and now - session.last_used > self.ttl_s:
                self.on_drop(self._sessions.pop(session_id))
                self.expired += 1
                session = None
            if session is None:
                raise VerifierError(404, "session_not_found",
                                    f"session {session_id!r} is unknown, expired or evicted; "
                                    "open a new one with POST /v1/sessions", "session_id")
            session.last_used = now
            self._sessions.move_to_end(session_id)
            return session

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._sessions)

    def exists(self, session_id: str) -> bool:
        with self._lock:
            return session_id in self._sessions

    def peek(self, session_id: str) -> Session | None:
        with self._lock:
            return self._sessions.get(session_id)

    def count_owned(self, owner: str | None) -> int:
        with self._lock:
            return sum(1 for s in self._sessions.values() if s.owner == owner)

    def check_quota(self, owner: str | None) -> None:
        """429 when ``owner`` (an API key) already holds ``max_per_owner`` sessions."""
        limit = self.max_per_owner
        if limit and owner is not None and self.count_owned(owner) >= limit:
            raise VerifierError(429, "too_many_sessions", f"this API key holds {limit} open "
                                f"sessions, the limit per key (SPECDEC_MAX_SESSIONS_PER_KEY); "
                                "close one or retry later", "session_id", retry_after_s=1)

    def remove(self, session_id: str, owner: str | None = None) -> None:
        with self._lock:
            session = self._sessions.get(session_id)
            if session is not None and session.owner == owner:
                del self._sessions[session_id]
            else:
                session = None
            if session is None:
                raise VerifierError(404, "session_not_found",
                                    f"session {session_id!r} is unknown, expired or evicted",
                                    "session_id")
            self.on_drop(session)

    def discard(self, session_id: str, owner: str | None = None) -> None:
        """Remove the session if it is still there (it may have been evicted meanwhile)."""
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None or session.owner != owner:
                return
            del self._sessions[session_id]
            self.on_drop(session)

    def evict_lru(self, keep: set[str]) -> bool:
        """Evict the least recently used session not in ``keep``; False if there is none."""
        with self._lock:
            for sid in self._sessions:
                if sid not in keep:
                    self.on_drop(self._sessions.pop(sid))
                    self.evicted += 1
                    return True
            return False

    def expire_idle(self) -> int:
        with self._lock:
            now = self.clock()
            stale = [sid for sid, s in self._sessions.items() if now - s.last_used > self.ttl_s]
            for sid in stale:
                self.on_drop(self._sessions.pop(sid))
            self.expired += len(stale)
            return len(stale)
