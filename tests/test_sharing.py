"""Read-only links (CHAT_SHARING), on the whole app with a real store (SQLite and PostgreSQL): off by
default, made and revoked by the owner only, showing one conversation's active path and nothing else."""
from __future__ import annotations

import html
import json
import re

import pytest
from fakes import FakeEngine
from helpers import add_answer

from chat import create_app
from chat.config import Settings
from chat.store import Store
from chat.web.identity import COOKIE

ALICE = "alice-client-0123456789"
BOB = "bob-client-0123456789ab"


@pytest.fixture
def store(db_path):
    s = Store(db_path)
    yield s
    s.close()


def client_of(app, cookie):
    client = app.test_client()
    client.set_cookie(COOKIE, cookie)
    return client


@pytest.fixture
def app_for(tmp_path, store):
    return lambda **settings: create_app(Settings(data_dir=str(tmp_path), **settings), engine=FakeEngine(),
                                         store=store)


def conversation(store, client=ALICE, question="Where is the secret?", answer="Under the mat.") -> str:
    conv = store.create_conversation(client)["id"]
    store.add_user_message(client, conv, question)
    add_answer(store, conv, answer)
    return conv


def shown(response) -> dict:
    """The conversation a shared page carries (its JSON data block)."""
    match = re.search(r'<script type="application/json" id="shared-data">(.*?)</script>', response.text, re.S)
    return json.loads(html.unescape(match.group(1))) if match else None


def test_sharing_is_off_by_default(app_for, store):
    app = app_for()
    conv = conversation(store)
    alice = client_of(app, ALICE)
    for method in ("get", "post", "delete"):
        response = getattr(alice, method)(f"/api/conversations/{conv}/share")
        assert response.status_code == 404 and response.json["error"]["code"] == "sharing_off"
    token = store.share(ALICE, conv)  # made while it was on, say
    assert client_of(app, BOB).get(f"/s/{token}").status_code == 404


def test_a_link_shows_one_conversations_active_path_until_revoked(app_for, store):
    app = app_for(sharing=True)
    conv = conversation(store)
    other = conversation(store, question="My other chat", answer="Private too.")
    first = store.get_conversation(ALICE, conv)["messages"][0]
    store.add_user_message(ALICE, conv, "Where is the key, then?", replaces=first["id"])  # a new version
    add_answer(store, conv, "In the drawer.")
    alice = client_of(app, ALICE)
    assert alice.get(f"/api/conversations/{conv}/share").json == {"token": None, "url": None}
    made = alice.post(f"/api/conversations/{conv}/share", json={})
    assert made.status_code == 201
    token, url = made.json["token"], made.json["url"]
    assert url == f"/s/{token}" and len(token) >= 32
    assert alice.post(f"/api/conversations/{conv}/share", json={}).json["token"] == token  # the same link
    assert alice.get(f"/api/conversations/{conv}/share").json["token"] == token

    page = client_of(app, BOB).get(url)  # anyone with the link, another identity
    assert page.status_code == 200
    assert page.headers["X-Robots-Tag"] == "noindex, nofollow" and page.headers["Referrer-Policy"] == "no-referrer"
    assert page.headers["Cache-Control"] == "no-store" and "script-src 'self'" in page.headers["Content-Security-Policy"]  # noqa: E501
    data = shown(page)
    assert [(m["role"], m["content"]) for m in data["messages"]] == [
        ("user", "Where is the key, then?"), ("assistant", "In the drawer.")]
    for hidden in ("Where is the secret?", "Under the mat.", "My other chat", "Private too.", ALICE, other, conv):
        assert hidden not in page.text, hidden
    assert page.text.count("<script") == 3  # katex, shared.js, the data block; nothing from the text

    assert client_of(app, BOB).post(f"/api/conversations/{conv}/share", json={}).status_code == 404
    assert client_of(app, BOB).delete(f"/api/conversations/{conv}/share").status_code == 404
    assert client_of(app, BOB).get(url).status_code == 200  # Bob could not revoke it

    assert alice.delete(f"/api/conversations/{conv}/share").json == {"token": None, "url": None}
    gone = client_of(app, BOB).get(url)
    assert gone.status_code == 404 and shown(gone) is None and "does not work" in gone.text
    again = alice.post(f"/api/conversations/{conv}/share", json={}).json["token"]
    assert again != token  # a revoked link never comes back
    assert client_of(app, BOB).get(url).status_code == 404
    store.delete(ALICE, conv)
    assert client_of(app, BOB).get(f"/s/{again}").status_code == 404


def test_text_in_a_shared_conversation_cannot_break_out_of_its_data(app_for, store):
    app = app_for(sharing=True)
    conv = conversation(store, question="</script><script>alert(1)</script>", answer="<!-- & ' \" -->")
    token = store.share(ALICE, conv)
    page = client_of(app, BOB).get(f"/s/{token}")
    assert "</script><script>alert(1)" not in page.text
    assert [m["content"] for m in shown(page)["messages"]] == ["</script><script>alert(1)</script>", "<!-- & ' \" -->"]


@pytest.mark.parametrize("token", ["x", "../etc/passwd", "A" * 500, "%00"])
def test_odd_tokens_are_just_not_found(app_for, store, token):
    app = app_for(sharing=True)
    assert client_of(app, BOB).get(f"/s/{token}").status_code == 404


def test_a_link_is_made_only_from_the_page_s_own_origin(app_for, store):
    app = app_for(sharing=True)
    conv = conversation(store)
    response = client_of(app, ALICE).post(f"/api/conversations/{conv}/share", json={},
                                           headers={"Origin": "https://elsewhere.example"})
    assert response.status_code == 403
    assert store.share_token(ALICE, conv) is None
