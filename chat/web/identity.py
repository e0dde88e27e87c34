"""Client identity: the ``chat_client`` cookie, and which proxy headers to believe."""
from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets

COOKIE = "chat_client"
_VALID = re.compile(r"^[A-Za-z0-9_-]{16,64}$")
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


def client_id(request, secret: str = "") -> str | None:
    """The identity in the request's cookie, or None when absent, malformed or badly signed."""
    value = request.cookies.get(COOKIE, "")
    client, _, sig = value.partition(".")
    if not _VALID.match(client):
        return None
    if secret and not hmac.compare_digest(sig, _signature(client, secret)):
        return None
    return client


def _forwarded(request, header: str, trusted_proxies: int) -> str | None:
    """The value the outermost trusted hop saw, from ``X-Forwarded-<header>``."""
    if trusted_proxies <= 0:
        return None
    raw = request.headers.get(f"X-Forwarded-{header}")
    values = [v.strip() for v in (raw or "").split(",") if v.strip()]
    if not values:
        return None
    # Each trusted proxy appends one entry; anything further left came from the client.
    return values[-min(trusted_proxies, len(values))]


def is_https(request, trusted_proxies: int) -> bool:
    """Whether the user's connection is https (directly, or per a trusted proxy)."""
    proto = _forwarded(request, "Proto", trusted_proxies)
    return (proto or request.scheme).lower() == "https"


def remote_ip(request, trusted_proxies: int) -> str:
    """The client's IP: ``X-Forwarded-For`` only as far as trusted hops vouch for it."""
    return _forwarded(request, "For", trusted_proxies) or request.remote_addr or "?"


def public_host(request, trusted_proxies: int) -> str:
    """The Host the user asked for (``X-Forwarded-Host`` from a trusted proxy, else Host)."""
    return _forwarded(request, "Host", trusted_proxies) or request.host


def set_cookie(response, value: str, secure: bool) -> None:
    """Attach the identity cookie (HttpOnly, SameSite=Lax, Secure over https)."""
    response.set_cookie(COOKIE, value, max_age=ONE_YEAR, httponly=True,
                        samesite="Lax", secure=secure, path="/")


def current_client() -> str | None:
    """The identity of the Flask request being served."""
    from flask import current_app, request
    return client_id(request, current_app.extensions["chat"].settings.api_key)
