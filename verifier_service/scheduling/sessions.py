"""Per-client sessions: a KV slot, a position and sampling settings; idle TTL and fair eviction.

Session ids are scoped by owner (the API key that opened them): another key can neither see,
probe nor block an id. Creates count against a key's session quota from the moment they are
admitted (``reserve``), so a burst of concurrent creates cannot overshoot it.

Eviction (when the session table or the KV pool is full), for a create by key K, never touching
a session busy in the current batch:
  1. K's own sessions, least recently used first;
  2. a session that the key holding the most sessions (more than K + 1) opened and has not used
     yet - so a key that floods creates cannot lock the others out;
  3. another key's session only when it has been idle for longer than its *protection window*:
     ``max(protect_s, 4 x its mean interval between calls)``, so a live client, however slow its
     round trip, keeps its session while another key creates;
  4. otherwise the create gets 503 with Retry-After, and nobody is evicted.
Without API keys every session has the same owner, but not the same client: rules 1 and 2 do
not apply, so a create evicts only a session idle past its protection window (rule 3), and a
live client keeps its session however many others arrive (they get 503 and retry).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shared.protocol.sampling import SamplingConfig
from verifier_service.errors import VerifierError

SessionKey = tuple[str | None, str]  # (owner, session id)


@dataclass
class Session:
    slot: int  # KV pool slot holding position - 1 tokens (less ``pending``)
    position: int  # committed tokens (prompt + generated)
    config: SamplingConfig
    # Prompt tokens accepted by the create but not yet in the slot: the session's first verify
    # writes them in the same forward as its block (one forward fewer per generation).
    pending: list[int] = field(default_factory=list)
    # A reopened session: ``pending[steps_from:]`` were generated, one block at a time, before
    # the session was lost; the engine writes them as its steps did (``ForwardItem.steps_from``)
    steps_from: int | None = None
    id: str = field(default_factory=lambda: secrets.token_urlsafe(12))
    last_used: float = 0.0
    mean_gap: float | None = None  # running mean of the time between its calls
    owner: str | None = None  # the API key that opened it; other keys see 404
    create_digest: str = ""  # of the create request, so a retried create is recognised
    # The last verify answered, so a retried call (same position, same body) gets the same
    # answer without advancing the cache again.
    last_verify_position: int = -1
    last_verify_digest: str = ""
    last_reply: Any = None

    @property
    def key(self) -> SessionKey:
        return (self.owner, self.id)


def _not_found(session_id: str) -> VerifierError:
    return VerifierError(404, "session_not_found", f"session {session_id!r} is unknown, expired "
                         "or evicted; open a new one with POST /v1/sessions", "session_id")


class SessionStore:
    """Sessions by (owner, id); see the module docstring for quota and eviction. Sessions idle
    longer than ``ttl_s`` expire. Unknown, evicted and expired ids all answer 404."""

    def __init__(self, max_sessions: int, ttl_s: float,
                 clock: Callable[[], float] = time.monotonic,
                 on_drop: Callable[[Session], None] = lambda session: None,
                 max_per_owner: int = 0, protect_s: float = 2.0) -> None:
        self.max_sessions, self.ttl_s, self.clock = max_sessions, ttl_s, clock
        self.max_per_owner = max_per_owner  # 0: no per-key limit
        self.protect_s = protect_s
        self.on_drop = on_drop  # frees what a session holds (its KV slot)
        self._sessions: OrderedDict[SessionKey, Session] = OrderedDict()  # LRU first
        self._reserved: Counter[str | None] = Counter()  # admitted creates not yet added
        self._lock = threading.Lock()
        self.evicted = 0
        self.expired = 0

    def __len__(self) -> int:
        return len(self._sessions)

    # -- lookups ------------------------------------------------------------------------------
    def get(self, session_id: str, owner: str | None = None) -> Session:
        """The session, touched (it becomes the most recently used)."""
        with self._lock:
            key = (owner, session_id)
            session = self._sessions.get(key)
            now = self.clock()
            if session is not None and now - session.last_used > self.ttl_s:
                self.on_drop(self._sessions.pop(key))
                self.expired += 1
                session = None
            if session is None:
                raise _not_found(session_id)
            gap = now - session.last_used
            session.mean_gap = (gap if session.mean_gap is None
                                else 0.7 * session.mean_gap + 0.3 * gap)
            session.last_used = now
            self._sessions.move_to_end(key)
            return session

    def peek(self, session_id: str, owner: str | None = None) -> Session | None:
        with self._lock:
            return self._sessions.get((owner, session_id))

    def exists(self, session_id: str, owner: str | None = None) -> bool:
        with self._lock:
            return (owner, session_id) in self._sessions

    # -- creates ------------------------------------------------------------------------------
    def reserve(self, owner: str | None, count: int = 1) -> None:
        """Admit ``count`` creates for ``owner`` (a beam search holds one slot a beam): 429
        when its open sessions plus its creates in flight would pass ``max_per_owner``. Undo
        with ``unreserve`` unless ``add`` follows."""
        with self._lock:
            limit = self.max_per_owner
            held = sum(1 for o, _ in self._sessions if o == owner) + self._reserved[owner]
            if limit and owner is not None and held + count > limit:
                if count == 1:
                    why, field = f"this API key holds {limit} open sessions, the limit per key", \
                        "session_id"
                else:
                    why, field = (f"beam search holds a KV slot a beam: {count} beams and the "
                                  f"{held} sessions this API key holds pass the limit per key "
                                  f"of {limit}"), "num_beams"
                raise VerifierError(429, "too_many_sessions", f"{why} "
                                    "(SPECDEC_MAX_SESSIONS_PER_KEY); close one or retry later",
                                    field, retry_after_s=1)
            self._reserved[owner] += count

    def unreserve(self, owner: str | None, count: int = 1) -> None:
        with self._lock:
            self._release(owner, count)

    def _release(self, owner: str | None, count: int = 1) -> None:  # under the lock
        self._reserved[owner] -= count
        if self._reserved[owner] <= 0:
            del self._reserved[owner]

    def make_room(self, owner: str | None, keep: set[Any]) -> None:
        """Evict (fairly) until the sessions plus the creates in flight fit ``max_sessions``."""
        while True:
            with self._lock:
                if len(self._sessions) + sum(self._reserved.values()) <= self.max_sessions:
                    return
            if not self.evict_one_for(owner, keep):
                raise busy_error("every session is in use by a live client")

    def add(self, session: Session) -> None:
        """Store a created session; its create was admitted with ``reserve``."""
        with self._lock:
            session.last_used = self.clock()
            self._sessions[session.key] = session
            self._release(session.owner)

    # -- removal ------------------------------------------------------------------------------
    def remove(self, session_id: str, owner: str | None = None) -> None:
        with self._lock:
            session = self._sessions.pop((owner, session_id), None)
            if session is None:
                raise _not_found(session_id)
            self.on_drop(session)

    def discard(self, session_id: str, owner: str | None = None) -> None:
        """Remove the session if it is still there (it may have been evicted meanwhile)."""
        with self._lock:
            session = self._sessions.pop((owner, session_id), None)
            if session is not None:
                self.on_drop(session)

    def evict_one_for(self, owner: str | None, keep: set[Any], own_only: bool = False) -> bool:
        """Evict one session to make room for a create by ``owner`` (the policy in the module
        docstring); ``keep``: keys of sessions busy in the current batch; ``own_only``: only
        ``owner``'s own sessions may go, and only under an API key (beam search). False: none
        may go."""
        with self._lock:
            now = self.clock()
            free = [(key, s) for key, s in self._sessions.items() if key not in keep]  # LRU 1st
            held = Counter(key[0] for key in self._sessions)
            hog = max(held, key=lambda o: held[o]) if held else None
            # Without keys (owner None) "own" sessions are every client's: none is K's own.
            victim = (next((key for key, _ in free if key[0] == owner), None)
                      if owner is not None else None)
            if own_only and victim is None:
                return False
            if victim is None and hog is not None and held[hog] > held[owner] + 1:
                # the key holding the most sessions gives up one it never used since opening
                victim = next((key for key, s in free if key[0] == hog and s.mean_gap is None),
                              None)
            if victim is None:
                victim = next((key for key, s in free if now - s.last_used > self._window(s)),
                              None)
            if victim is None:
                return False
            self.on_drop(self._sessions.pop(victim))
            self.evicted += 1
            return True

    def _window(self, session: Session) -> float:
        """How long a session is safe from other keys after its last call."""
        return max(self.protect_s, 4 * (session.mean_gap or 0.0))

    def expire_idle(self) -> int:
        with self._lock:
            now = self.clock()
            stale = [k for k, s in self._sessions.items() if now - s.last_used > self.ttl_s]
            for key in stale:
                self.on_drop(self._sessions.pop(key))
            self.expired += len(stale)
            return len(stale)


def busy_error(why: str) -> VerifierError:
    return VerifierError(503, "capacity_exhausted", f"no room for a new session: {why}; retry "
                         "shortly", None, retry_after_s=1)
