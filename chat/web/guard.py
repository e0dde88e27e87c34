"""Who may connect: the origin check, the API key, and the client identity a request carries."""
from __future__ import annotations

import hmac

from flask import request

from ..errors import RequestError
from . import identity


def origin_allowed(origin: str, host: str, scheme: str, allowed) -> bool:
    """The page's own origin (scheme + Host) or one listed in CHAT_ALLOWED_ORIGINS."""
    origin = origin.rstrip("/")
    own = {f"{scheme}://{host}", f"http://{host}", f"https://{host}"} if scheme == "https" else \
        {f"{scheme}://{host}"}
    return origin in own or origin in allowed or "*" in allowed


def bearer_ok(key: str, allow_query: bool = True) -> bool:
    """Whether the request carries the API key (``Authorization: Bearer``, or ``?token=``)."""
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    given = given.strip() if scheme.lower() == "bearer" else ""
    if not given and allow_query:
        given = request.args.get("token", "")
    return bool(given) and hmac.compare_digest(given.encode(), key.encode())


def check_origin(settings) -> None:
    """Refuse a cross-origin request (403) unless its origin is allowed; no Origin is fine."""
    origin = request.headers.get("Origin")
    if origin is None:
        return
    scheme = "https" if identity.is_https(request, settings.trusted_proxies) else "http"
    host = identity.public_host(request, settings.trusted_proxies)
    if not origin_allowed(origin, host, scheme, settings.allowed_origins):
        raise RequestError("forbidden", "cross-origin WebSocket refused", 403)


def key_ok(settings, cookie: bool, query: bool) -> bool:
    """Without CHAT_API_KEY, always; with it, whether the request has the key (or, if ``cookie``,
    the page's signed identity cookie)."""
    key = settings.api_key
    return not key or (cookie and identity.current_client() is not None) or bearer_ok(key, query)


def socket_client(settings) -> str:
    """The identity of a WebSocket client: its cookie, else a fresh anonymous one."""
    client = identity.current_client()
    if client is None and settings.api_key and bearer_ok(settings.api_key):
        # A program that proved the key may name its own identity with an unsigned cookie.
        client = identity.client_id(request)
    return client or "anon-" + identity.new_client_id()


def remote_ip(settings) -> str:
    """The caller's address, as far as trusted proxies vouch for it."""
    return identity.remote_ip(request, settings.trusted_proxies)
