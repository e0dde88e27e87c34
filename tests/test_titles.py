"""Titles written by the model (CHAT_TITLES): after a new chat's first answer, off its path; a rename
wins; one title per conversation whatever version of the first message is shown; off: the old way."""
from __future__ import annotations

import json
import time
import urllib.request

import pytest

from chat.titles import clean, prompt
from fakes import FakeEngine
from helpers import WS, conv_of, cookie_for, conversation


def patch(srv, cookie, conv, body) -> int:
    req = urllib.request.Request(f"{srv.url}/api/conversations/{conv}", method="PATCH", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Cookie": cookie})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return resp.status


@pytest.mark.parametrize("written, title", [
    ("Paris trip plans", "Paris trip plans"),
    ('Title: "Baking sourdough bread."\nMore text', "Baking sourdough bread"),
    ("\n\n  **标题：** 中文介绍  \n", "中文介绍"),
    ("...", None),
    ("", None),
    ("word " * 30, ("word " * 11).strip() + "…"),
])
def test_the_title_is_the_first_line_without_quotes_leads_or_marks(written, title):
    assert clean(written) == title


@pytest.mark.parametrize("question, language", [
    ("请用中文介绍一下长城", "Chinese"), ("東京の天気はどうですか", "Japanese"), ("서울 날씨 어때요", "Korean"),
    ("Расскажи о Москве", "Cyrillic"), ("Tell me about Paris", None), ("Café au lait, s'il vous plaît", None),
])
def test_the_title_is_asked_in_the_language_the_script_says(question, language):
    system = prompt(question, "…")[0]["content"]
    if language is None:
        assert "must be in" not in system
    else:
        assert "must be in" in system and language in system.split("must be in")[1]


def test_the_prompt_asks_for_the_chat_language_and_bounds_what_it_shows():
    messages = prompt("q" * 5000, "a" * 5000)
    assert "language" in messages[0]["content"]
    assert len(messages[1]["content"]) < 1300


def test_a_new_chat_is_titled_by_the_model_after_its_first_answer(app_factory):
    engine = FakeEngine(words=["Fishing ", "trip ", "ideas ", "today "], answer_words=4)
    srv = app_factory(engine, titles=True)
    cookie = cookie_for(srv)
    client = WS(srv.ws_url, cookie=cookie)
    frames = client.chat("what should I pack for a weekend of fishing by the lake?", rid="a")
    conv = conv_of(frames)
    assert frames[-1]["type"] == "done"  # the answer ended before the title was asked for
    told = client.until(lambda f: f["type"] == "title")[-1]
    assert told == {"type": "title", "conversation_id": conv, "title": "Fishing trip ideas today"}
    asked = engine.history[-1]
    assert asked.params.temperature == 0 and asked.params.max_new_tokens <= 20
    assert "weekend of fishing" in asked.messages[-1]["content"]
    assert conversation(srv, cookie, conv)[1]["title"] == "Fishing trip ideas today"
    # One title whatever version of the first message is shown.
    first = conversation(srv, cookie, conv)[1]["messages"][0]["id"]
    client.send({"type": "edit", "id": "e", "conversation_id": conv, "message_id": first, "content": "Other topic"})
    client.until(lambda f: f["type"] == "done")
    assert conversation(srv, cookie, conv)[1]["title"] == "Fishing trip ideas today"
    # A follow-up is not titled again.
    client.chat("and bait?", rid="b", conversation_id=conv)
    assert len([g for g in engine.history if g.params.max_new_tokens <= 20]) == 1
    client.close()


def test_a_title_the_user_set_first_wins(app_factory):
    engine = FakeEngine(words=["Model ", "title "], answer_words=2, delay=0.2)
    srv = app_factory(engine, titles=True)
    cookie = cookie_for(srv)
    client = WS(srv.ws_url, cookie=cookie)
    conv = conv_of(client.chat("hello there", rid="a"))
    assert patch(srv, cookie, conv, {"title": "Mine"}) == 200  # while the model writes its title
    deadline = time.monotonic() + 10
    while len(engine.history) < 2 or not engine.history[-1].finished:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.2)
    assert conversation(srv, cookie, conv)[1]["title"] == "Mine"
    client.close()


def test_titles_off_keeps_the_first_words_and_edits_rename(app_factory):
    engine = FakeEngine(answer_words=3)
    srv = app_factory(engine, titles=False)
    cookie = cookie_for(srv)
    client = WS(srv.ws_url, cookie=cookie)
    conv = conv_of(client.chat("Write one sentence about owls", rid="a"))
    assert client.ping()["type"] == "pong"
    assert conversation(srv, cookie, conv)[1]["title"] == "Write one sentence about owls"
    first = conversation(srv, cookie, conv)[1]["messages"][0]["id"]
    client.send({"type": "edit", "id": "e", "conversation_id": conv, "message_id": first, "content": "About cats"})
    client.until(lambda f: f["type"] == "done")
    assert conversation(srv, cookie, conv)[1]["title"] == "About cats"
    assert len(engine.history) == 2  # no title asked for
    client.close()


def test_the_command_line_client_passes_over_title_frames(app_factory):
    from chat.client.session import Session
    srv = app_factory(FakeEngine(words=["Short ", "title "], answer_words=2), titles=True)
    with Session(srv.ws_url, timeout=10) as session:
        first = list(session.chat("hello there"))
        conv = next(f for f in first if f["type"] == "start")["conversation_id"]
        time.sleep(0.5)  # the title frame arrives meanwhile
        second = list(session.chat("and again", conversation_id=conv))
    assert [f["type"] for f in second if f["type"] not in ("delta", "queued")] == ["start", "done"]
