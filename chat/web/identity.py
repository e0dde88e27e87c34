"""Client identity: the identity cookie, the API key, and which proxy headers to believe."""
from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import re
import secrets

from werkzeug.wrappers import Request, Response

from ..clients import ANONYMOUS, KEY_HOLDER  # noqa: F401  (re-exported for the web layer)

log = logging.getLogger(__name__)

COOKIE = "chat_client"
# Over https the cookie carries the __Host- prefix: the browser then accepts it only from this
# exact host, Secure, Path=/, so a sibling subdomain cannot plant an identity.
HOST_COOKIE = "__Host-chat_client"
SUBPROTOCOL = "chat.v1"
KEY_SUBPROTOCOL = "bearer."  # Sec-WebSocket-Protocol: chat.v1, bearer.<key> (browsers cannot set headers)
_ID = re.compile(r"[A-Za-z0-9_-]{16,64}")
_SIG = re.compile(r"[A-Za-z0-9_-]{24}")
ONE_YEAR = 365 * 24 * 3600


def new_client_id() -> str:
    """A fresh random identity."""
    return secrets.token_urlsafe(24)


def _signature(value: str, secret: str) -> str:
    mac = hmac.new(secret.encode(), value.encode(), hashlib.sha256).digest()[:18]
    return base64.urlsafe_b64encode(mac).decode()


def cookie_value(client: str, secret: str = "") -> str:
    """The cookie for ``client``: signed when the server has a secret (``CHAT_API_KEY``)."""
    return f"{client}.{_signature(client, secret)}" if secret else client


def cookie_name(secure: bool) -> str:
    """``__Host-chat_client`` over https, ``chat_client`` over plain http."""
    return HOST_COOKIE if secure else COOKIE


def parse_cookie(value: str, secret: str = "") -> str | None:
    """The identity in a cookie value, or None when malformed or badly signed."""
    client, dot, sig = value.partition(".")
    if not _ID.fullmatch(client):
        return None
    if not secret:
        return client  # an unsigned server ignores a signature left from a keyed past
    # Shape first: compare_digest refuses non-ASCII str, and bytes of equal form are cheap to compare.
    if not dot or not _SIG.fullmatch(sig):
        return None
    return client if hmac.compare_digest(sig.encode(), _signature(client, secret).encode()) else None


def client_id(request: Request, secret: str = "", secure: bool = False) -> str | None:
    """The browser identity in the request's cookie (the name that fits the scheme), or None."""
    return parse_cookie(request.cookies.get(cookie_name(secure), ""), secret)


def presented_key(request: Request, socket: bool = True) -> str:
    """The API key the request carries: ``Authorization: Bearer``, or (``socket``) a ``bearer.``
    subprotocol or ``?token=``."""
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and given.strip():
        return given.strip()
    if not socket:
        return ""
    for offered in request.headers.get("Sec-WebSocket-Protocol", "").split(","):
        if offered.strip().startswith(KEY_SUBPROTOCOL):
            return offered.strip()[len(KEY_SUBPROTOCOL):]
    return request.args.get("token", "")


def has_key(request: Request, key: str, socket: bool = True) -> bool:
    """Whether the request carries the API key (see ``presented_key``)."""
    given = presented_key(request, socket)
    return bool(key) and bool(given) and hmac.compare_digest(given.encode(), key.encode())


def _forwarded(request: Request, header: str, trusted_proxies: int) -> str | None:
    """The value the outermost trusted hop saw, from ``X-Forwarded-<header>``."""
    if trusted_proxies <= 0:
        return None
    raw = request.headers.get(f"X-Forwarded-{header}")
    values = [v.strip() for v in (raw or "").split(",") if v.strip()]
    if not values:
        return None
    # Each trusted proxy appends one entry; anything further left came from the client.
    return values[-min(trusted_proxies, len(values))]


def is_https(request: Request, trusted_proxies: int) -> bool:
    """Whether the user's connection is https (directly, or per a trusted proxy)."""
    proto = _forwarded(request, "Proto", trusted_proxies)
    return (proto or request.scheme).lower() == "https"


def remote_ip(request: Request, trusted_proxies: int) -> str:
    """The client's IP: ``X-Forwarded-For`` only as far as trusted hops vouch for it."""
    return _forwarded(request, "For", trusted_proxies) or request.remote_addr or "?"


def public_host(request: Request, trusted_proxies: int) -> str:
    """The Host the user asked for (``X-Forwarded-Host`` from a trusted proxy, else Host)."""
    return _forwarded(request, "Host", trusted_proxies) or request.host


class ProxyWarning:
    """Warns once when requests carry ``X-Forwarded-For`` that CHAT_TRUSTED_PROXIES=0 ignores."""

    def __init__(self) -> None:
        self.warned = False

    def check(self, request: Request, trusted_proxies: int) -> None:
        if self.warned or trusted_proxies or "X-Forwarded-For" not in request.headers:
            return
        self.warned = True
        log.warning("a request arrived with X-Forwarded-For while CHAT_TRUSTED_PROXIES=0: every user "
                    "behind the proxy looks like %s and shares one set of per-address limits (its open "
                    "connections too: CHAT_MAX_CONNECTIONS_PER_IP per worker); set CHAT_TRUSTED_PROXIES to "
                    "the number of proxies in front", request.remote_addr)


def set_cookie(response: Response, value: str, secure: bool) -> None:
    """Attach the identity cookie (HttpOnly, SameSite=Lax; Secure with the __Host- name over https)."""
    response.set_cookie(cookie_name(secure), value, max_age=ONE_YEAR, httponly=True,
                        samesite="Lax", secure=secure, path="/")


def browser_client() -> str | None:
    """The identity of the Flask request being served, from its cookie alone."""
    from flask import request

    from ..app_state import app_state
    settings = app_state().settings
    return client_id(request, settings.api_key, is_https(request, settings.trusted_proxies))


def current_client() -> str | None:
    """The identity of the Flask request being served: its cookie, or a key-holder's own name.

    With CHAT_API_KEY set, a program holding the key may name itself with an unsigned
    cookie; that name lives in its own namespace, so it never reaches a browser's conversations.
    """
    from flask import request

    from ..app_state import app_state
    settings = app_state().settings
    client = browser_client()
    if client is None and settings.api_key and has_key(request, settings.api_key):
        named = parse_cookie(request.cookies.get(HOST_COOKIE) or request.cookies.get(COOKIE, ""))
        return KEY_HOLDER + named if named else None
    return client
