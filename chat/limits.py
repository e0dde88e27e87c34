"""The limits the core enforces: who may connect and start an answer, per client and per address.

A new cookie (or none) must not reset a limit, so every limit that a client could
escape by becoming someone else is also counted per address; IPv6 addresses are
grouped by /64, the block one subscriber usually gets. Answers are counted from
admission until their generation emits ``Done`` (or ``Refused``), so answers that
outlive their socket for the resume grace still count.

This module declares the interface (``Limits``, ``Ticket``) and the rules both
implementations share; the counting is ``chat.state.local_limits`` (this process)
or ``chat.state.redis_limits`` (every worker, in Redis), picked by ``chat.state.open_state``.
"""
from __future__ import annotations

import ipaddress
import time
from typing import Protocol

from .clients import ANONYMOUS
from .engine import Generation
from .engine.events import END, Event, Started
from .errors import ProtocolError


class Ticket(Protocol):
    """One admitted answer, counted until released; both methods are safe from any thread, twice."""

    def started(self) -> None:
        """The engine started the answer: it no longer waits in the queue."""

    def release(self) -> None:
        """Stop counting the answer."""


class Limits(Protocol):
    """Admission for connections and answers; shared by the WebSocket and ``/v1``."""

    max_per_client: int
    max_per_address: int  # 0: no limit

    def connection_allowed(self, address: str) -> bool:
        """Whether ``address`` may open one more socket."""

    def connect(self, address: str) -> bool:
        """Count one more open socket from ``address``, unless it already has its
        CHAT_MAX_CONNECTIONS_PER_IP (then False, and nothing counted): check and count are one step,
        so handshakes arriving together cannot all pass the check."""

    def disconnect(self, address: str) -> None:
        """Count one socket from ``address`` fewer."""

    def admit(self, address: str, client: str | None = None, rid: str | None = None) -> Ticket:
        """A ticket for one more answer, or the ProtocolError that refuses it (in protocol order).

        ``client`` None (``/v1``) counts only against the address.
        """

    def track(self, ticket: Ticket, gen: Generation) -> None:
        """Count ``ticket`` until ``gen`` ends (see ``follow_generation``)."""

    def spend(self, address: str, client: str | None, cost: int = 1) -> None:
        """Take ``cost`` requests from the client's and the address's request rates (an import
        costs more than a chat: see ``cost_of``), or raise ``rate_limited`` and take nothing."""


class TokenBucket:
    """``burst`` actions at once, then ``per_s`` a second: for one owner (one connection), so
    neither shared nor locked."""

    def __init__(self, burst: int, per_s: float) -> None:
        self.burst, self.per_s = float(burst), per_s
        self.tokens, self.at = float(burst), time.monotonic()

    def take(self) -> bool:
        """Spend one token; False (and nothing spent) when none is left."""
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.per_s)
        self.at = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


RATE_UNIT_BYTES = 64 * 1024  # an import spends one request of the rate per started 64 KiB


def cost_of(size: int) -> int:
    """The requests an import of ``size`` bytes spends from the rates (at least one)."""
    return max(1, -(-size // RATE_UNIT_BYTES))


def address_of(ip: str) -> str:
    """The address a limit counts: IPv4 as is, IPv6 by its /64 (IPv4-mapped IPv6 as IPv4)."""
    try:
        parsed = ipaddress.ip_address(ip)
    except ValueError:
        return ip
    if parsed.version == 6:
        if parsed.ipv4_mapped is not None:
            return str(parsed.ipv4_mapped)
        return str(ipaddress.ip_network(f"{parsed}/64", strict=False))
    return str(parsed)


def rate_key(client: str | None, address: str) -> str | None:
    """Whose request rate a request spends: the client's, or for a connection without a cookie
    (a new client each time) its address's; None for ``/v1`` (counted per address only)."""
    if client is None:
        return None
    return "anon@" + address if client.startswith(ANONYMOUS) else client


def refusal(reason: str, limits: Limits, rid: str | None) -> ProtocolError:
    """The error for an admission refused because of ``reason`` (client, address, rate, share)."""
    if reason == "client":
        return ProtocolError("busy", f"at most {limits.max_per_client} answers at once per client", rid)
    if reason == "address":
        return ProtocolError("busy", f"at most {limits.max_per_address} answers at once per address", rid)
    if reason == "rate":
        return ProtocolError("rate_limited", "too many requests; slow down", rid)
    return ProtocolError("overloaded", "this address has its share of the server while others wait; try "
                                       "again when one of its answers ends", rid)


def follow_generation(ticket: Ticket, gen: Generation) -> None:
    """Follow ``gen``'s events as the engine emits them: started on ``Started``, released at the end.

    Watching the engine's side (not the consumer's) keeps the count right for answers whose
    client is gone, or whose channel was closed after a failed store write.
    """
    gen.observe(lambda event: _observe(ticket, event))


def _observe(ticket: Ticket, event: Event) -> None:
    if isinstance(event, Started):
        ticket.started()
    elif isinstance(event, END):
        ticket.release()
