"""Who may connect: the origin check, the API key, and the client identity a request carries."""
from __future__ import annotations

from collections.abc import Collection

from flask import Blueprint, Response, request

from ..config import Settings
from ..errors import RequestError
from . import identity
from ..limits import address_of


def origin_allowed(origin: str, host: str, scheme: str, allowed: Collection[str]) -> bool:
    """The page's own origin (exactly its scheme + Host) or one listed in CHAT_ALLOWED_ORIGINS."""
    origin = origin.rstrip("/")
    return origin == f"{scheme}://{host}" or origin in allowed or "*" in allowed


def bearer_ok(key: str, socket: bool = True) -> bool:
    """Whether the request carries the API key (``Authorization: Bearer``; on the socket also a
    ``bearer.`` subprotocol or ``?token=``)."""
    return identity.has_key(request, key, socket)


def check_origin(settings: Settings, what: str = "WebSocket") -> None:
    """Refuse a cross-origin request (403) unless its origin is allowed; no Origin is fine."""
    origin = request.headers.get("Origin")
    if origin is None:
        return
    scheme = "https" if identity.is_https(request, settings.trusted_proxies) else "http"
    host = identity.public_host(request, settings.trusted_proxies)
    if not origin_allowed(origin, host, scheme, settings.allowed_origins):
        raise RequestError("forbidden", f"cross-origin {what} refused", 403)


WRITES = ("POST", "PUT", "PATCH", "DELETE")


def check_write(settings: Settings, code: str = "bad_message") -> None:
    """A request that changes something: from the page's own origin (or an allowed one) when it
    says where it comes from, and its body JSON, declared as such. A page elsewhere can post only
    "simple" bodies (text/plain, forms) without the browser asking this server first: 403 or 400
    (``code``) for it, never a planted conversation."""
    if request.method not in WRITES:
        return
    check_origin(settings, "request")
    if (request.method != "DELETE" or request.content_length) and request.mimetype != "application/json":
        raise RequestError(code, "the body must be JSON, sent as Content-Type: application/json", 400)


def key_ok(settings: Settings, socket: bool) -> bool:
    """Without CHAT_API_KEY, always; with it, whether the request has the key (or, on the socket,
    the page's signed identity cookie)."""
    key = settings.api_key
    return not key or (socket and identity.browser_client() is not None) or bearer_ok(key, socket)


def socket_client() -> str:
    """The identity of a WebSocket client: its cookie (a key-holder's own namespace), else a fresh
    anonymous one, whose conversations are deleted when the connection ends."""
    return identity.current_client() or identity.ANONYMOUS + identity.new_client_id()


def remote_ip(settings: Settings) -> str:
    """The caller's address, as far as trusted proxies vouch for it."""
    return identity.remote_ip(request, settings.trusted_proxies)


def address(settings: Settings) -> str:
    """The address the caller's limits count against (IPv6 by its /64)."""
    return address_of(remote_ip(settings))


def private_api(bp: Blueprint) -> None:
    """Hooks of a blueprint serving one client's own data: writes only as same-origin JSON (never from
    another site's form), answers kept out of shared caches."""
    from ..app_state import app_state  # the app's state: reached per request

    @bp.before_request
    def _same_origin_json() -> None:
        check_write(app_state().settings)

    @bp.after_request
    def _private(response: Response) -> Response:
        response.headers["Cache-Control"] = "no-store"
        return response
