"""Read-only links (CHAT_SHARING): the owner makes or revokes one for a conversation through the API,
and ``/s/<token>`` shows that conversation's current version to whoever holds the link."""
from __future__ import annotations

from flask import Blueprint, Response, current_app, jsonify, render_template, request
from flask.typing import ResponseReturnValue

from ..app_state import app_state
from ..errors import ProtocolError, RequestError
from . import guard, identity
from .identity import current_client

bp = Blueprint("sharing", __name__)


def _store():
    """The app's conversation store (this blueprint exists only where there is one)."""
    return app_state().store


def _sharing_on() -> None:
    if not app_state().settings.sharing:
        raise RequestError("sharing_off", "sharing is turned off on this server (CHAT_SHARING)", 404)


def _link(token: str | None) -> Response:
    return jsonify({"token": token, "url": f"/s/{token}" if token else None})


def _owner_request() -> None:
    """The owner's API: sharing on, and a write from the page's own origin (as every /api write)."""
    _sharing_on()
    guard.check_write(app_state().settings)


@bp.get("/api/conversations/<conv_id>/share")
def show(conv_id: str) -> ResponseReturnValue:
    """The conversation's link ({token, url}, null when it has none)."""
    _owner_request()
    token = _store().share_token(current_client(), conv_id)
    if token is False:
        raise ProtocolError("not_found", "conversation not found")
    return _link(token)


@bp.post("/api/conversations/<conv_id>/share")
def make(conv_id: str) -> ResponseReturnValue:
    """Share it: its link (the one it has, or a new one)."""
    _owner_request()
    token = _store().share(current_client(), conv_id)
    if token is None:
        raise ProtocolError("not_found", "conversation not found")
    return _link(token), 201


@bp.delete("/api/conversations/<conv_id>/share")
def revoke(conv_id: str) -> ResponseReturnValue:
    """Revoke its link: the token stops working for good (sharing again makes a new one)."""
    _owner_request()
    if not _store().unshare(current_client(), conv_id):
        raise ProtocolError("not_found", "conversation not found")
    return _link(None)


@bp.after_request
def _private(response: Response) -> Response:
    """Links and shared pages stay out of caches, search engines and other sites' Referer."""
    response.headers["Cache-Control"] = "no-store"
    response.headers["X-Robots-Tag"] = "noindex, nofollow"
    response.headers["Referrer-Policy"] = "no-referrer"
    return response


@bp.get("/s/<token>")
def page(token: str) -> ResponseReturnValue:
    """The shared conversation, read-only; the same page, saying so, for a link revoked or never made.
    A visitor without an identity gets one (as on the chat page), so Continue in my chats can work."""
    state = app_state()
    shared = _store().shared(token) if state.settings.sharing else None
    if shared is not None:
        shared["model"] = shared["model"] or state.engine.model_name
    html = render_template("shared.html", shared=shared)
    response = current_app.make_response((html, 200 if shared else 404))
    if shared is not None and identity.browser_client() is None:
        value = identity.cookie_value(identity.new_client_id(), state.settings.api_key)
        identity.set_cookie(response, value, identity.is_https(request, state.settings.trusted_proxies))
    return response


@bp.post("/s/<token>/continue")
def continue_(token: str) -> ResponseReturnValue:
    """Continue in my chats: a copy of the shared conversation (as shown: the text, no attached files)
    becomes the caller's own, titled "… (imported)": 201 {"id"}."""
    state = app_state()
    _sharing_on()
    guard.check_write(state.settings)
    client = current_client()
    if not client:
        raise ProtocolError("bad_message", "no client identity: open the page first to get one")
    shared = _store().shared(token)
    if shared is None:
        raise ProtocolError("not_found", "this link does not work")
    body = {"title": shared["title"], "model": shared["model"], "messages": [
        {"role": m["role"], "content": m["content"], "status": m["status"], "reason": m["reason"],
         "created_at": m["created_at"]} for m in shared["messages"]]}
    address = guard.address(state.settings)
    conv_id = _store().import_conversation(client, body, state.settings.max_content_chars, address)
    return jsonify(id=conv_id), 201
