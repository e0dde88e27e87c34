"""GET / and GET /c/<id> (the chat page) with the identity cookie, and the security headers of every page."""
from __future__ import annotations

from flask import Blueprint, Response, current_app, render_template, request

from ..app_state import app_state
from . import identity

bp = Blueprint("pages", __name__)

CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; font-src 'self'; object-src 'none'; base-uri 'self'; "
       "frame-ancestors 'none'; form-action 'self'")


@bp.get("/")
@bp.get("/c/<conv_id>")
def index(conv_id: str | None = None) -> Response:
    """The chat page (at /c/<id> it opens that conversation); gives a new visitor a random identity
    cookie. The same page for every id: whether a conversation is the caller's is the API's to say."""
    settings = app_state().settings
    starters = [s.strip()[:200] for s in settings.starters.split("|") if s.strip()][:8]
    response = current_app.make_response(render_template("index.html", sharing=settings.sharing,
                                                          starters=starters))
    if identity.browser_client() is None:
        value = identity.cookie_value(identity.new_client_id(), settings.api_key)
        identity.set_cookie(response, value, identity.is_https(request, settings.trusted_proxies))
    response.headers["Cache-Control"] = "no-store"
    return response


_proxy_warning = identity.ProxyWarning()


@bp.before_app_request
def warn_about_untrusted_proxy() -> None:
    """Tell the operator once that a proxy's X-Forwarded-For is being ignored."""
    _proxy_warning.check(request, app_state().settings.trusted_proxies)


@bp.after_app_request
def security_headers(response: Response) -> Response:
    """CSP and the usual hardening headers on every response."""
    headers = response.headers
    headers.setdefault("X-Content-Type-Options", "nosniff")
    headers.setdefault("Referrer-Policy", "same-origin")
    if response.mimetype == "text/html":
        headers.setdefault("Content-Security-Policy", CSP)
        headers.setdefault("X-Frame-Options", "DENY")
        headers.setdefault("Permissions-Policy", "camera=(), microphone=(), geolocation=()")
    return response
