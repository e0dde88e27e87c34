"""Which ``Host`` this server answers to (DNS rebinding), and redirects that never echo one."""
from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from flask import Flask, Response, request

from ..config import Settings
from ..errors import RequestError
from . import identity

_ANY_ADDRESS = ("", "0.0.0.0", "::", "*")


def names(settings: Settings) -> frozenset[str]:
    """The host names allowed besides IP addresses and localhost: CHAT_ALLOWED_HOSTS, CHAT_BIND's host,
    the hosts of CHAT_ALLOWED_ORIGINS."""
    out = set(settings.allowed_hosts)
    if not settings.bind.startswith("unix:"):
        bound = settings.bind.rpartition(":")[0].strip("[]").lower()
        if bound not in _ANY_ADDRESS:
            out.add(bound)
    for origin in settings.allowed_origins:
        if origin != "*":
            out.add((urlsplit(origin).hostname or "").lower())
    out.discard("")
    return frozenset(out)


def _name(host: str) -> str:
    """A Host header's name: no port, no brackets, lower case, no trailing dot."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.partition(":")[0].rstrip(".")


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def allowed(host: str, allow: frozenset[str]) -> bool:
    """Whether a request for ``host`` may be answered: an IP address (a rebinding page needs a name of
    its own), localhost, or a listed name (``*.example.com`` covers its subdomains, ``*`` any)."""
    name = _name(host)
    if not name or "*" in allow or _is_address(name) or name == "localhost" or name.endswith(".localhost"):
        return True
    return name in allow or any(p.startswith("*.") and name.endswith(p[1:]) for p in allow)


def check(allow: frozenset[str], trusted_proxies: int) -> None:
    """A Host this server does not answer to gets 403 (the request's own, and a trusted proxy's)."""
    hosts = (request.host, identity.public_host(request, trusted_proxies))
    if not all(allowed(h, allow) for h in hosts):
        raise RequestError("forbidden_host", "this server does not answer to that Host name; the operator "
                           "can allow it with CHAT_ALLOWED_HOSTS", 403)


def relative_location(response: Response) -> Response:
    """A redirect names a path on this server, never the Host a request claimed (werkzeug's own
    redirects, such as ``//`` merged to ``/``, build an absolute URL from it)."""
    location = response.headers.get("Location")
    if location:
        parts = urlsplit(location)
        if parts.netloc:
            path = "/" + parts.path.lstrip("/")  # never //host: that would be another host again
            response.headers["Location"] = path + (f"?{parts.query}" if parts.query else "")
    return response


def init_app(app: Flask, settings: Settings) -> None:
    """Check the Host before every other hook of every request (WebSocket handshakes included)."""
    allow = names(settings)
    app.before_request_funcs.setdefault(None, []).insert(0, lambda: check(allow, settings.trusted_proxies))
    app.after_request(relative_location)
