"""Interactive slash commands that go beyond chatting: /edit, /continue, /search, /open."""
from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from .session import Session

HELP = ("/new: new conversation; /edit TEXT: replace your last message and ask again (the old one stays "
        "as a version); /continue: extend an answer that was cut off; /search WORDS: search your "
        "conversations; /open N: continue search result N; /quit: quit. Ctrl-C stops an answer, twice quits")


@dataclass
class Open:
    """Switch the interactive session to this conversation."""

    conversation_id: str


def http_base(ws_url: str) -> str:
    """The server's HTTP origin for its WebSocket URL."""
    parts = urllib.parse.urlsplit(ws_url)
    return urllib.parse.urlunsplit(({"wss": "https"}.get(parts.scheme, "http"), parts.netloc, "", "", ""))


def highlighted(snippet: str, spans: list) -> str:
    """The snippet with each match in [brackets] (plain text: no markup from the server)."""
    out, at = [], 0
    for start, end in spans:
        out += [snippet[at:start], "[", snippet[start:end], "]"]
        at = end
    return "".join(out + [snippet[at:]])


class Commands:
    """Turns a typed line into a request frame, or runs a command that needs none."""

    def __init__(self, session: Session, say: Callable[[str], None]) -> None:
        self.session, self.say = session, say
        self.results: list[dict] = []

    def get(self, path: str, **query) -> dict:
        """GET a JSON API path as this session's client (same cookie and key as the socket)."""
        url = http_base(self.session.url) + path + ("?" + urllib.parse.urlencode(query) if query else "")
        # Both cookie names: the server reads the __Host- one over https, the plain one otherwise.
        cookie = f"chat_client={self.session.client_id}; __Host-chat_client={self.session.client_id}"
        headers = {"Cookie": cookie}
        if self.session.api_key:
            headers["Authorization"] = f"Bearer {self.session.api_key}"
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                        timeout=self.session.timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            try:
                message = json.loads(exc.read())["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = f"HTTP {exc.code}"
            raise LookupError(message) from None
        except OSError as exc:
            raise LookupError(f"cannot reach {url}: {exc}") from None

    def request_for(self, line: str, conversation: str | None) -> dict | Open | None:
        """A request frame for ``line``, an ``Open``, or None when the command was handled here."""
        name, _, rest = line.partition(" ") if line.startswith("/") else ("", "", "")
        handler = {"/edit": self._edit, "/continue": self._continue, "/search": self._search,
                   "/open": self._open}.get(name)
        if handler is None:
            return {"type": "chat", "content": line}
        try:
            return handler(rest.strip(), conversation)
        except LookupError as exc:
            self.say(str(exc))
            return None

    def _edit(self, text: str, conversation: str | None):
        if not text or not conversation:
            self.say("usage: /edit NEW TEXT, in a conversation with a message to replace")
            return None
        messages = self.get(f"/api/conversations/{conversation}")["messages"]
        last = next((m for m in reversed(messages) if m["role"] == "user"), None)
        if last is None:
            self.say("this conversation has no message of yours to edit")
            return None
        return {"type": "edit", "message_id": last["id"], "content": text}

    def _continue(self, _rest: str, conversation: str | None):
        if not conversation:
            self.say("nothing to continue yet")
            return None
        return {"type": "continue"}

    def _search(self, words: str, _conversation: str | None) -> None:
        if not words:
            self.say("usage: /search WORDS")
            return None
        self.results = self.get("/api/search", q=words)["results"]
        if not self.results:
            self.say("no match")
        for n, hit in enumerate(self.results, 1):
            self.say(f"{n}. {hit['title']} ({hit['role']}): {highlighted(hit['snippet'], hit['highlights'])}")
        return None

    def _open(self, number: str, _conversation: str | None) -> Open | None:
        if not number.isdigit() or not 1 <= int(number) <= len(self.results):
            self.say("usage: /open N, with N from the last /search")
            return None
        hit = self.results[int(number) - 1]
        self.say(f"now in: {hit['title']}")
        return Open(hit["conversation_id"])
