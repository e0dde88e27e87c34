"""A soak: abusive clients beside 4 well-behaved users on a real gunicorn, loopback only, bounded."""
from __future__ import annotations

import json
import os
import random
import socket
import sqlite3
import threading
import time
import urllib.request

import websocket
from helpers import WS, at_rest, conv_of, http_get, metric, wait_for

USERS = 4
TURNS = 5
HOG_SOCKETS = 32
LIMIT_S = 240
SEND_TIMEOUT_S = 2  # the abusers stop when the users are done, or at this bound


def post(srv, path: str, body: bytes, address: str, method: str = "POST") -> int:
    """The status of a request with a body (the server's answer, or 0 when it hung up on us)."""
    req = urllib.request.Request(srv.url + path, data=body, method=method,
                                 headers={"Content-Type": "application/json", "X-Forwarded-For": address})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            resp.read()
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def connect(srv, address: str, **kwargs):
    """A raw websocket-client connection from ``address`` (None when refused)."""
    try:
        return websocket.create_connection(srv.ws_url, timeout=10, header=[f"X-Forwarded-For: {address}"],
                                           **kwargs)
    except (OSError, websocket.WebSocketException):
        return None


def drain(conn, seconds: float = 0.02) -> None:
    """Read whatever frames have arrived, without waiting long."""
    conn.settimeout(seconds)
    try:
        while True:
            conn.recv()
    except (OSError, websocket.WebSocketException):
        pass


class Abuse:
    """Abusive clients on their own threads until ``stop`` is set; counts what they did."""

    def __init__(self, srv, stop: threading.Event):
        self.srv, self.stop = srv, stop
        self.counts: dict = {}
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._guard, args=(f,), daemon=True) for f in (
            self.hog, self.reconnect_flood, self.slow_readers, self.bad_bodies, self.random_bytes)]

    def count(self, what: str) -> None:
        with self.lock:
            self.counts[what] = self.counts.get(what, 0) + 1

    def _guard(self, target) -> None:
        try:
            target()
        except Exception as exc:  # an abuser's own failure must not end the soak silently
            self.count(f"abuser crashed: {type(exc).__name__}: {exc}")

    def hog(self) -> None:
        """32 sockets from one address, each asking for long answers again and again."""
        conns = [c for c in (connect(self.srv, "198.51.100.1") for _ in range(HOG_SOCKETS + 1)) if c]
        self.count(f"hog sockets {len(conns)}")
        n = 0
        while not self.stop.is_set():
            for conn in conns:
                n += 1
                try:
                    conn.send(json.dumps({"type": "chat", "id": f"h{n}", "content": "hog " * 50,
                                          "params": {"max_new_tokens": 300}}))
                    self.count("hog chats")
                except (OSError, websocket.WebSocketException):
                    self.count("hog send failed")
                drain(conn, 0.01)
            time.sleep(0.2)
        for conn in conns:
            conn.close()

    def reconnect_flood(self) -> None:
        """New connections, with and without fresh cookies, each sending a chat and leaving."""
        while not self.stop.is_set():
            cookie = http_get(self.srv.url + "/", headers={"X-Forwarded-For": "198.51.100.2"})[1]["Set-Cookie"]
            for kwargs in ({}, {"cookie": cookie.split(";")[0]}):
                conn = connect(self.srv, "198.51.100.2", **kwargs)
                if conn is None:
                    self.count("flood refused")
                    continue
                conn.send(json.dumps({"type": "chat", "id": "f", "content": "flood",
                                      "params": {"max_new_tokens": 200}}))
                conn.close()
                self.count("flood chats")
            time.sleep(0.05)

    def slow_readers(self) -> None:
        """Connections that ask for answers and floods of pongs, then never read."""
        while not self.stop.is_set():
            conn = connect(self.srv, "198.51.100.3", sockopt=((socket.SOL_SOCKET, socket.SO_RCVBUF, 4096),))
            if conn is None:
                self.count("slow refused")
                time.sleep(0.5)
                continue
            conn.send(json.dumps({"type": "chat", "id": "s", "content": "slow", "params": {"max_new_tokens": 300}}))
            conn.settimeout(5)
            try:
                for _ in range(60):
                    conn.send(json.dumps({"type": "ping", "t": "x" * 60_000}))
                time.sleep(SEND_TIMEOUT_S + 3)  # still connected, still not reading
                for _ in range(10):
                    conn.send(json.dumps({"type": "ping"}))
                    time.sleep(0.3)
                self.count("slow reader never cut")
            except (OSError, websocket.WebSocketException):
                self.count("slow reader cut")
            conn.close()

    def bad_bodies(self) -> None:
        """Oversized, deeply nested and random bodies over HTTP and the socket."""
        rng = random.Random(7)
        while not self.stop.is_set():
            address = "198.51.100.4"
            self.count(f"v1 oversized {post(self.srv, '/v1/chat/completions', b' ' * (17 * 2**20), address)}")
            self.count(f"v1 nested {post(self.srv, '/v1/chat/completions', b'[' * 100_000, address)}")
            self.count(f"v1 random {post(self.srv, '/v1/chat/completions', rng.randbytes(2000), address)}")
            renamed = post(self.srv, "/api/conversations/" + "a" * 32, b"{" * 50_000, address, "PATCH")
            self.count(f"rename nested {renamed}")
            conn = connect(self.srv, address)
            if conn is None:
                continue
            try:
                conn.send('{"type": "chat", "id": "n", "content": ' + "[" * 100_000)
                conn.send_binary(rng.randbytes(1000))
                conn.send(rng.randbytes(500).decode("latin-1"))
                conn.send("x" * 300_000)  # over CHAT_MAX_MESSAGE_BYTES: the server closes
                drain(conn, 0.2)
                self.count("ws junk sent")
            except (OSError, websocket.WebSocketException):
                self.count("ws junk cut")
            conn.close()
            time.sleep(0.2)

    def random_bytes(self) -> None:
        """Raw TCP garbage at the HTTP port."""
        rng = random.Random(11)
        while not self.stop.is_set():
            with socket.create_connection(("127.0.0.1", self.srv.port), timeout=5) as raw:
                try:
                    raw.sendall(rng.randbytes(rng.randint(1, 4000)))
                    raw.recv(1024)
                except OSError:
                    pass
            self.count("raw garbage")
            time.sleep(0.05)


def test_abusers_beside_well_behaved_users(server_factory, capsys):
    srv = server_factory("abuse", CHAT_TRUSTED_PROXIES=1, CHAT_MAX_BATCH=4, CHAT_MAX_QUEUE=16,
                         CHAT_MAX_ACTIVE_PER_IP=4, CHAT_RATE_LIMIT_PER_MIN=60, CHAT_RATE_LIMIT_PER_IP_PER_MIN=120,
                         CHAT_MAX_CONNECTIONS_PER_IP=32, CHAT_SEND_TIMEOUT_S=SEND_TIMEOUT_S, CHAT_RESUME_GRACE_S=1,
                         CHAT_MAX_NEW_TOKENS=400)
    for i in range(3):  # warm: the first answers pay for lazy imports and allocator growth
        warm = WS(srv.ws_url, header=[f"X-Forwarded-For: 192.0.2.{i}"])
        warm.chat("warm", params={"max_new_tokens": 20})
        warm.close()
    names = ("chat_os_threads", "chat_greenlets", "process_resident_memory_bytes")
    base = at_rest(srv, hold=2)  # past the resume grace (1 s): the warm answers' runs have expired
    stop = threading.Event()
    abuse = Abuse(srv, stop)
    for thread in abuse.threads:
        thread.start()
    # The users arrive once every abuser is at work (the slow readers count only when cut, later).
    at_work = ("hog chats", "flood ", "v1 oversized", "raw garbage")
    assert wait_for(lambda: all(any(k.startswith(w) for k in abuse.counts) for w in at_work), timeout=60), \
        abuse.counts
    answers: dict = {}
    health: list = []

    def user(i):
        address = f"203.0.113.{i + 1}"
        cookie = http_get(srv.url + "/", headers={"X-Forwarded-For": address})[1]["Set-Cookie"].split(";")[0]
        client = WS(srv.ws_url, timeout=120, cookie=cookie, header=[f"X-Forwarded-For: {address}"])
        conv, got = None, []
        for turn in range(TURNS):
            t0 = time.monotonic()
            frames = client.chat(f"user {i} turn {turn}", rid=f"u{turn}", conversation_id=conv,
                                 params={"max_new_tokens": 30, "temperature": 0.7})
            started = [f for f in frames if f["type"] == "start"]
            conv = conv or (conv_of(frames) if started else None)
            got.append((frames[-1]["type"], frames[-1].get("reason") or frames[-1].get("code"),
                        time.monotonic() - t0))
        client.close()
        answers[i] = got

    users = [threading.Thread(target=user, args=(i,)) for i in range(USERS)]
    started = time.monotonic()
    for thread in users:
        thread.start()
    while any(t.is_alive() for t in users) and time.monotonic() - started < LIMIT_S:
        t0 = time.monotonic()
        health.append((http_get(srv.url + "/healthz", timeout=30)[0], time.monotonic() - t0))
        time.sleep(0.5)
    stop.set()
    for thread in users + abuse.threads:
        thread.join(60)
    users_s = time.monotonic() - started

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (metric(srv, "chat_active_generations") or
                                           metric(srv, "chat_ws_connections") or metric(srv, "chat_queue_depth")):
        time.sleep(0.5)

    def anonymous_left() -> int:
        with sqlite3.connect(srv.workdir / "data" / "chat.db") as db:
            return db.execute("SELECT count(*) FROM conversations WHERE client_id LIKE 'anon:%'").fetchone()[0]

    # Polled: the resume grace, finished-run expiry and the anonymous clean-up take a few seconds.
    wait_for(lambda: (anonymous_left() == 0 and metric(srv, "chat_os_threads") <= base["chat_os_threads"]
                      and metric(srv, "chat_greenlets") <= base["chat_greenlets"] + 2), timeout=60)
    after = {m: metric(srv, m) for m in names}
    latencies = sorted(s for got in answers.values() for _, _, s in got)
    health_s = sorted(s for _, s in health)
    figures = {"users_s": round(users_s, 1), "answers": sum(len(g) for g in answers.values()),
               "answer_s_p50": round(latencies[len(latencies) // 2], 2) if latencies else None,
               "answer_s_max": round(latencies[-1], 2) if latencies else None,
               "healthz_checks": len(health), "healthz_s_max": round(health_s[-1], 3) if health_s else None,
               "threads": (base["chat_os_threads"], after["chat_os_threads"]),
               "greenlets": (base["chat_greenlets"], after["chat_greenlets"]),
               "rss_mib": (round(base["process_resident_memory_bytes"] / 2**20),
                           round(after["process_resident_memory_bytes"] / 2**20)),
               "abuse": abuse.counts}
    with capsys.disabled():
        print("\nsoak figures:", json.dumps(figures, sort_keys=True))
    if os.environ.get("CHAT_SOAK_FIGURES"):
        with open(os.environ["CHAT_SOAK_FIGURES"], "w") as f:
            json.dump(figures, f, indent=1, sort_keys=True)

    assert sorted(answers) == list(range(USERS)), "a well-behaved user never finished"
    for got in answers.values():
        assert [(kind, reason in ("stop", "length")) for kind, reason, _ in got] == [("done", True)] * TURNS, got
    assert all(status == 200 for status, _ in health)
    assert not [k for k in abuse.counts if k.startswith("abuser crashed")], abuse.counts
    assert abuse.counts.get("hog sockets 32") == 1  # the 33rd was refused
    assert abuse.counts.get("slow reader cut", 0) >= 1 and not abuse.counts.get("slow reader never cut")
    assert srv.proc.poll() is None and "Traceback" not in srv.log_path.read_text(errors="replace")
    assert metric(srv, "chat_active_generations") == 0 and metric(srv, "chat_queue_depth") == 0
    assert metric(srv, "chat_ws_connections") == 0
    assert after["chat_os_threads"] <= base["chat_os_threads"]
    assert after["chat_greenlets"] <= base["chat_greenlets"] + 2
    grown = after["process_resident_memory_bytes"] - base["process_resident_memory_bytes"]
    assert grown < 150 * 2**20, f"resident memory grew by {grown / 2**20:.0f} MiB"
    assert anonymous_left() == 0  # nobody can reach these: none kept
