"""Issue 45's findings that an in-process server shows: tools counted and capped before anything is
rendered, every /api string field with its own cap, titles without control or bidirectional
characters, odd inputs answered 4xx, crash leftovers of the KV folder swept at start."""
from __future__ import annotations

import os
import stat
import time

import pytest
import torch

from chat import structured
from chat.engine.kv import disk as kvdisk

ALICE = "alice-hardening4-0123456789"


@pytest.fixture(scope="module")
def srv(app_factory):
    return app_factory(max_new_tokens=8)


def _client(srv):
    client = srv.app.test_client()
    client.set_cookie("chat_client", ALICE)
    return client


def _tools(n: int, description: str) -> list:
    return [{"type": "function", "function": {"name": f"f{i}", "description": description,
                                              "parameters": {"type": "object", "properties": {}}}} for i in range(n)]


def _import(client, text: str) -> str:
    body = {"messages": [{"role": "user", "content": text}]}
    return client.post("/api/conversations/import", json=body).get_json()["id"]


def _v1(client, body: dict):
    return client.post("/v1/chat/completions", json=body)


@pytest.mark.parametrize("tools,param,status,code", [
    # 12.8 MB of descriptions: past CHAT_MAX_REQUEST_CHARS with the messages, refused before it is rendered
    (_tools(32, "x" * 400_000), "tools", 413, "too_large"),
    (_tools(1, "x" * 5000), "tools[0].function.description", 400, "tools_too_large"),
    (_tools(20, "y" * 4000), "tools", 400, "tools_too_large"),  # each within its own cap, together past the whole's
])
def test_tools_are_counted_and_capped_before_any_rendering(srv, monkeypatch, tools, param, status, code):
    rendered = []
    monkeypatch.setattr(structured, "tools_prompt", lambda listed: rendered.append(1) or "")
    t0 = time.monotonic()
    resp = _v1(_client(srv), {"messages": [{"role": "user", "content": "hi"}], "tools": tools})
    assert resp.status_code == status, resp.get_json()
    error = resp.get_json()["error"]
    assert error["code"] == code and error["param"] == param
    assert not rendered and time.monotonic() - t0 < 30


def test_tools_within_the_caps_still_work(srv):
    resp = _v1(_client(srv), {"messages": [{"role": "user", "content": "hi"}], "tools": _tools(8, "d" * 4000),
                              "tool_choice": "none", "max_tokens": 2})
    assert resp.status_code == 200


@pytest.mark.parametrize("method,path,body,code", [
    ("PATCH", "/api/conversations/{conv}", {"title": "t" * 100_000}, "bad_message"),
    ("PATCH", "/api/conversations/{conv}", {"model": "m" * 100_000}, "bad_message"),
    ("PATCH", "/api/conversations/{conv}", {"system": "s" * 100_000}, "too_large"),
    ("POST", "/api/presets", {"name": "n" * 100_000}, "bad_message"),
    ("POST", "/api/presets", {"name": "ok", "system": "s" * 100_000}, "too_large"),
    ("POST", "/api/conversations/{conv}/active", {"message_id": "i" * 100_000}, "bad_message"),
])
def test_every_api_string_field_has_its_cap(srv, method, path, body, code):
    client = _client(srv)
    conv = _import(client, "q")
    resp = client.open(path.format(conv=conv), method=method, json=body)
    assert resp.status_code in (400, 413) and resp.get_json()["error"]["code"] == code


def test_an_api_body_past_its_bound_is_refused_by_its_length(srv):
    client = _client(srv)
    resp = client.post("/api/presets", data=b"{" + b" " * 300_000 + b"}", content_type="application/json")
    assert resp.status_code == 413 and resp.get_json()["error"]["code"] == "too_large"


@pytest.mark.parametrize("raw,shown", [
    ("bad\x00title", "bad title"),
    ("line\r\nbreak", "line break"),
    ("\u202eevil.exe\u202c", "evil.exe"),
    ("tab\there \u2066iso\u2069", "tab here iso"),
])
def test_titles_lose_control_and_bidi_characters(srv, raw, shown):
    client = _client(srv)
    conv = _import(client, raw)
    assert client.get(f"/api/conversations/{conv}").get_json()["title"] == shown + " (imported)"
    resp = client.patch(f"/api/conversations/{conv}", json={"title": raw})
    assert resp.status_code == 200 and resp.get_json()["title"] == shown
    assert client.patch(f"/api/conversations/{conv}", json={"title": "\x00\u202e\r\n"}).status_code == 400
    made = client.post("/api/presets", json={"name": raw}).get_json()
    assert made["name"] == shown


@pytest.mark.parametrize("messages,param", [
    ([{"role": "user", "content": "x"},
      {"role": "assistant", "tool_calls": [{"type": "function", "function": {
          "name": "f", "arguments": "[" * 5000 + "]" * 5000}}]}], "messages[1].tool_calls[0].function.arguments"),
    ([{"role": "user", "content": "x"}, {"role": "tool", "content": [{"text": 1}]}], "messages[1].content"),
    ([{"role": "user", "content": "x"}, {"role": "tool", "content": [{"type": "text", "text": ["a"]}]}],
     "messages[1].content"),
])
def test_odd_tool_history_gets_400_not_500(srv, messages, param):
    resp = _v1(_client(srv), {"messages": messages, "max_tokens": 2})
    assert resp.status_code == 400, resp.get_json()
    assert resp.get_json()["error"]["param"] == param


def test_crash_leftovers_in_the_kv_folder_are_deleted_at_start_and_counted(tmp_path):
    folder = tmp_path / "kv"
    folder.mkdir()
    dead = folder / f"{'a' * 32}.kv.999999999.1.tmp"  # no process has that pid
    live = folder / f"{'b' * 32}.kv.{os.getpid()}.2.tmp"  # a write in progress elsewhere in this process
    dead.write_bytes(b"x" * 1000)
    live.write_bytes(b"y" * 1000)
    disk = kvdisk.DiskKV(folder, 10**9, (2, 1, 16), torch.bfloat16)
    assert disk.leftovers == 1 and not dead.exists() and live.exists()
    disk.save("k", list(range(4)), [torch.zeros(1, 1, 4, 16).bfloat16()] * 2, [torch.zeros(1, 1, 4, 16).bfloat16()] * 2)
    disk.flush()
    entry = disk.path("k")
    assert stat.S_IMODE(entry.stat().st_mode) == 0o600
    made = kvdisk.DiskKV(tmp_path / "cache" / "kv" / "model", 10**9, (2, 1, 16), torch.bfloat16)
    assert stat.S_IMODE(made.folder.stat().st_mode) == 0o700


def test_a_new_database_is_private(tmp_path):
    from chat.store import Store
    store = Store(str(tmp_path / "new" / "chat.db"))
    store.close()
    assert stat.S_IMODE((tmp_path / "new").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "new" / "chat.db").stat().st_mode) == 0o600


def test_structured_limits_are_documented():
    doc = open(os.path.join(os.path.dirname(__file__), "..", "docs", "security.md")).read()
    assert f"| one tool's `description` | {structured.MAX_DESCRIPTION_CHARS} characters |" in doc
    assert f"`parameters`), as JSON | {structured.MAX_TOOLS_CHARS // 1024} KiB |" in doc


@pytest.mark.parametrize("tokens,path", [(200, "columns"), (1600, "prefill")])
def test_a_long_scored_prompt_goes_through_the_batched_prefill(tokens, path):
    """A scored prompt's columns on the C++ step each cost a decode step (64 s for 1600 tokens): only a
    short one is fed that way, a long one through the batched prefill like any prompt."""
    from chat.engine.model import runner

    took = []

    class Job:
        score, rows, kv = 0, 1, None

        def __init__(self):
            self.tokens = torch.zeros((1, tokens), dtype=torch.long)

        def open(self, columns):
            return self.tokens[:, :columns], self.tokens[:, :columns]

        def ran(self, logits):
            return logits

    class Decoder:
        native = True

        def verify(self, ids, kv, positions):
            took.append("columns")
            return torch.zeros(ids.shape[1], 4)

    class Runner(runner.DecoderRunner):
        def __init__(self):
            self.decoder = Decoder()

        def forward(self, *args, **kwargs):
            took.append("prefill")

    Runner().prefill(Job(), 128)
    assert took == [path]


def test_tools_count_against_the_request_size(app_factory):
    srv = app_factory(max_request_chars=20_000)
    body = {"messages": [{"role": "user", "content": "q" * 15_000}], "tools": _tools(2, "d" * 3000)}
    resp = _v1(_client(srv), body)
    assert resp.status_code == 413 and resp.get_json()["error"]["param"] == "tools"
    body["messages"][0]["content"] = "q"
    assert _v1(_client(srv), {**body, "tool_choice": "none", "max_tokens": 2}).status_code == 200
