"""Issue 22's attacks against a real gunicorn + gevent server, each shown to fail, with figures:
search over huge imports, handshake bursts, clients that send without reading, control-ping floods,
stalled request bodies, storage and import limits across fresh cookies, and a soak of all of them
beside four well-behaved users. Figures are printed (bounds that are the target itself are asserted
loosely: the box is a shared 2-core VM)."""
from __future__ import annotations

import json
import os
import re
import socket
import sqlite3
import threading
import time
import urllib.request

import pytest
from conftest import WS, conv_of, http_get

from chat.store import db_cap_mb

FIGURES: dict = {}


def figure(name: str, value) -> None:
    FIGURES[name] = value
    print(f"\nfigure {name}: {json.dumps(value)}")


def metric(srv, name: str) -> float:
    body = http_get(srv.url + "/metrics")[2].decode()
    return float(re.search(rf"^{name} (\S+)$", body, re.M).group(1))


def request(srv, method, path, body=None, headers=None, timeout=60):
    req = urllib.request.Request(srv.url + path, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def cookie(srv, address="127.0.0.1") -> str:
    return http_get(srv.url + "/", headers={"X-Forwarded-For": address})[1]["Set-Cookie"].split(";")[0]


def import_(srv, cookie_, body: bytes, address="127.0.0.1"):
    return request(srv, "POST", "/api/conversations/import", body,
                   {"Content-Type": "application/json", "Cookie": cookie_, "X-Forwarded-For": address})


class Health:
    """/healthz every 50 ms on a thread: every answer's time, and whether any failed."""

    def __init__(self, srv):
        self.srv, self.times, self.failed = srv, [], 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.is_set():
            t0 = time.monotonic()
            try:
                ok = http_get(self.srv.url + "/healthz", timeout=30)[0] == 200
            except OSError:
                ok = False
            self.times.append(time.monotonic() - t0)
            self.failed += not ok
            time.sleep(0.05)

    def done(self) -> dict:
        self.stop.set()
        self.thread.join(60)
        times = sorted(self.times)
        return {"checks": len(times), "failed": self.failed, "p50_ms": round(times[len(times) // 2] * 1000, 1),
                "max_ms": round(times[-1] * 1000, 1)}


def worker_pids(srv) -> set:
    return set(re.findall(r"Booting worker with pid: (\d+)", srv.log_path.read_text(errors="replace")))


# ---- raw WebSocket clients: nothing hidden, nothing read unless asked

def handshake_bytes(srv, address: str) -> bytes:
    return (f"GET /ws HTTP/1.1\r\nHost: 127.0.0.1:{srv.port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
            f"X-Forwarded-For: {address}\r\n\r\n").encode()


def status_of(sock) -> int:
    head = b""
    while b"\r\n\r\n" not in head:
        data = sock.recv(4096)
        if not data:
            return 0
        head += data
    return int(head.split(b" ", 2)[1])


def frame(opcode: int, payload: bytes, mask: bytes = b"\x01\x02\x03\x04") -> bytes:
    """One masked client frame."""
    n = len(payload)
    head = bytes([0x80 | opcode])
    if n < 126:
        head += bytes([0x80 | n])
    elif n < 65536:
        head += bytes([0x80 | 126]) + n.to_bytes(2, "big")
    else:
        head += bytes([0x80 | 127]) + n.to_bytes(8, "big")
    key = (mask * (n // 4 + 1))[:n]
    masked = (int.from_bytes(payload, "big") ^ int.from_bytes(key, "big")).to_bytes(n, "big") if n else b""
    return head + mask + masked


def open_raw(srv, address: str, timeout: float = 10) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=timeout)
    sock.sendall(handshake_bytes(srv, address))
    assert status_of(sock) == 101
    return sock


@pytest.fixture(scope="module")
def live(server_factory):
    return server_factory("abuse22", CHAT_TRUSTED_PROXIES=1, CHAT_MAX_CONNECTIONS_PER_IP=32, CHAT_SEND_TIMEOUT_S=5,
                          CHAT_MAX_STORAGE_MB_PER_IP=3, CHAT_RATE_LIMIT_PER_IP_PER_MIN=120)


def test_100_simultaneous_handshakes_open_at_most_the_limit(live):
    socks = [socket.create_connection(("127.0.0.1", live.port), timeout=30) for _ in range(100)]
    request_ = handshake_bytes(live, "198.51.100.50")
    barrier = threading.Barrier(100)
    statuses = []

    def go(sock):
        barrier.wait()
        sock.sendall(request_)
        statuses.append(status_of(sock))

    threads = [threading.Thread(target=go, args=(s,)) for s in socks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    figure("handshakes_101_of_100", statuses.count(101))
    assert statuses.count(101) == 32 and statuses.count(429) == 68
    for sock in socks:
        sock.close()
    deadline = time.monotonic() + 30
    while True:  # every place comes back once the sessions have ended
        try:
            open_raw(live, "198.51.100.50").close()
            break
        except AssertionError:
            assert time.monotonic() < deadline
            time.sleep(0.2)


def test_a_client_that_sends_without_reading_is_cut_and_memory_stays_bounded(live):
    base = metric(live, "process_resident_memory_bytes")
    sock = open_raw(live, "198.51.100.51", timeout=20)
    ping = frame(0x1, json.dumps({"type": "ping", "t": "x" * 250_000}).encode())
    peak = [base]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak.append(metric(live, "process_resident_memory_bytes"))
            time.sleep(0.5)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    sent, t0, cut = 0, time.monotonic(), None
    try:
        for _ in range(1200):  # 300 MB
            sock.sendall(ping)
            sent += len(ping)
    except socket.timeout:
        cut = "still open (send timed out)"
    except OSError as exc:
        cut = type(exc).__name__
    closed_s = time.monotonic() - t0
    time.sleep(1)
    stop.set()
    sampler.join(10)
    sock.close()
    grown = (max(peak) - base) / 2**20
    figure("flood", {"sent_mb": round(sent / 1e6, 1), "closed_after_s": round(closed_s, 1), "how": cut,
                     "rss_base_mib": round(base / 2**20), "rss_growth_max_mib": round(grown, 1)})
    assert cut not in (None, "still open (send timed out)"), "the server never cut the connection"
    assert sent < 100e6 and closed_s < 30
    assert grown <= 64
    assert http_get(live.url + "/healthz")[0] == 200


def test_a_control_ping_flood_is_closed(live):
    sock = open_raw(live, "198.51.100.52", timeout=20)
    t0 = time.monotonic()
    try:
        sock.sendall(frame(0x9, b"") * 44_000)
    except OSError:
        pass
    got = b""
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                break
            got += data
    except OSError:
        pass
    closed_s = time.monotonic() - t0
    figure("control_ping_flood", {"closed_after_s": round(closed_s, 2), "pongs": got.count(b"\x8a\x00")})
    assert closed_s < 15
    assert b"\x88" in got and (1008).to_bytes(2, "big") in got  # a close frame: policy violation
    assert got.count(b"\x8a\x00") <= 40


def test_stalled_bodies_are_closed_in_time(live):
    """The default CHAT_BODY_TIMEOUT_S (15 s): 20 stalled bodies, /healthz answered meanwhile."""
    def stall(path, results):
        sock = socket.create_connection(("127.0.0.1", live.port), timeout=60)
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     f"Content-Length: 100000\r\nCookie: {cookie(live)}\r\n\r\n{{".encode())
        t0 = time.monotonic()
        answer = b""
        try:
            while True:
                data = sock.recv(4096)
                if not data:
                    break
                answer += data
        except OSError:
            pass
        results.append((path, time.monotonic() - t0, answer.split(b" ", 2)[1] if answer else b""))
        sock.close()

    results: list = []
    health = Health(live)
    threads = [threading.Thread(target=stall, args=(p, results))
               for p in ["/v1/chat/completions", "/api/conversations/import"] * 10]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    checks = health.done()
    closed = sorted(s for _, s, _ in results)
    figure("stalled_bodies", {"closed_after_s_min_max": [round(closed[0], 1), round(closed[-1], 1)],
                              "statuses": sorted({r[2].decode() for r in results}), "healthz": checks})
    assert len(results) == 20 and closed[-1] < 30
    assert {r[2] for r in results} == {b"408"}
    assert checks["failed"] == 0


def test_storage_and_import_limits_hold_across_fresh_cookies(live):
    answer = "word " * (900 * 1024 // 5)  # 0.9 MiB
    body = json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": answer}]})
    statuses = [import_(live, cookie(live, "198.51.100.60"), body.encode(), "198.51.100.60")[0] for _ in range(5)]
    figure("storage_per_address_fresh_cookies", statuses)
    assert statuses[:3] == [201] * 3 and statuses[3:] == [413, 413]  # 3 MiB per address
    def sized(chars):
        return json.dumps({"messages": [{"role": "user", "content": "q"},
                                        {"role": "assistant", "content": "x" * chars}]}).encode()

    # what is left of the address's 3 MiB (0.36 MiB) is shared by every fresh cookie too
    assert import_(live, cookie(live, "198.51.100.60"), sized(300_000), "198.51.100.60")[0] == 201
    assert import_(live, cookie(live, "198.51.100.60"), sized(100_000), "198.51.100.60")[0] == 413
    assert import_(live, cookie(live, "198.51.100.60"), sized(80_000), "198.51.100.60")[0] == 201
    late = WS(live.ws_url, cookie=cookie(live, "198.51.100.60"), header=["X-Forwarded-For: 198.51.100.60"])
    try:  # about 900 characters are left: a new chat with a 1500-character system prompt does not fit
        refused = late.chat("a new conversation", params={"max_new_tokens": 2}, system="be brief. " * 150)[-1]
        assert (refused["type"], refused["code"]) == ("error", "too_large") and "address" in refused["message"], refused
        assert late.chat("a new conversation", rid="r2", params={"max_new_tokens": 2})[-1]["type"] == "done"
    finally:
        late.close()
    assert import_(live, cookie(live, "198.51.100.61"), body.encode(), "198.51.100.61")[0] == 201  # elsewhere
    small = json.dumps({"messages": [{"role": "user", "content": "hello"}]}).encode()
    rates = [import_(live, cookie(live, "198.51.100.62"), small, "198.51.100.62")[0] for _ in range(130)]
    figure("imports_per_address_per_min_fresh_cookies", {"201": rates.count(201), "429": rates.count(429)})
    assert 100 <= rates.count(201) <= 122 and rates[-1] == 429  # CHAT_RATE_LIMIT_PER_IP_PER_MIN=120
    with sqlite3.connect(live.workdir / "data" / "chat.db") as db:
        assert db.execute("SELECT count(*) FROM conversations WHERE address = '198.51.100.60'").fetchone()[0] == 6


def test_the_default_database_cap_follows_the_free_disk(tmp_path):
    import shutil
    cap = db_cap_mb(str(tmp_path / "chat.db"), -1)
    free = shutil.disk_usage(tmp_path).free / 2**20
    assert 0.7 * free <= cap <= 0.9 * free + 1
    assert db_cap_mb(str(tmp_path / "chat.db"), 40) == 40 and db_cap_mb(str(tmp_path / "chat.db"), 0) == 0


def test_search_over_huge_imports_never_blocks_the_worker(server_factory):
    """The HIGH repro: one cookie imports 20 conversations, each a 2 MiB answer of distinct words that all
    start with the searched prefix; then it searches, again and again, while /healthz is timed."""
    srv = server_factory("search22")
    pids = worker_pids(srv)
    owner = cookie(srv)
    health = Health(srv)
    t0 = time.monotonic()
    for n in range(20):
        words = " ".join(f"alpha{n}x{i}" for i in range(200_000))[:2 * 2**20 - 200]
        body = json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": words}]})
        assert import_(srv, owner, body.encode())[0] == 201
    imports_s = time.monotonic() - t0
    during_imports = health.done()
    health = Health(srv)
    searches = []
    for q in ["alpha", "alpha1", "alpha7x19", "a", "zzz", "alpha alpha"] * 3:
        t1 = time.monotonic()
        status, body = request(srv, "GET", "/api/search?q=" + q.replace(" ", "+"), headers={"Cookie": owner})
        searches.append((q, status, round(time.monotonic() - t1, 3)))
        assert status in (200, 503), body
    during_search = health.done()
    slowest = max(s for _, _, s in searches)
    figure("search_repro", {"imports_s": round(imports_s, 1), "healthz_during_imports": during_imports,
                            "healthz_during_searches": during_search, "search_s_max": slowest,
                            "search_statuses": sorted({st for _, st, _ in searches}),
                            "alpha_s": [s for q, _, s in searches if q == "alpha"]})
    assert slowest < 4  # the budget is 1.5 s; the target 2 s, measured on a loaded machine
    assert during_search["failed"] == 0 and during_imports["failed"] == 0
    assert during_search["max_ms"] < 1000  # the target is 100 ms: see the printed figure
    assert worker_pids(srv) == pids and "WORKER TIMEOUT" not in srv.log_path.read_text(errors="replace")
    status, body = request(srv, "GET", "/api/search?q=alpha3x5", headers={"Cookie": owner})
    assert status == 200 and json.loads(body)["results"][0]["snippet"].count("alpha3x5") == 1


def test_abusers_beside_four_users(server_factory, capsys):
    """Every abuse of the issue at once, beside 4 users chatting: every answer delivered."""
    srv = server_factory("soak22", CHAT_TRUSTED_PROXIES=1, CHAT_MAX_BATCH=4, CHAT_MAX_QUEUE=16,
                         CHAT_MAX_ACTIVE_PER_IP=4, CHAT_RATE_LIMIT_PER_MIN=60, CHAT_RATE_LIMIT_PER_IP_PER_MIN=120,
                         CHAT_MAX_CONNECTIONS_PER_IP=32, CHAT_SEND_TIMEOUT_S=3, CHAT_BODY_TIMEOUT_S=3,
                         CHAT_RESUME_GRACE_S=2, CHAT_MAX_NEW_TOKENS=400, CHAT_MAX_STORAGE_MB_PER_IP=8)
    base_rss = metric(srv, "process_resident_memory_bytes")
    stop = threading.Event()
    counts: dict = {}
    lock = threading.Lock()

    def count(what):
        with lock:
            counts[what] = counts.get(what, 0) + 1

    def guard(fn):
        def run():
            while not stop.is_set():
                try:
                    fn()
                except Exception as exc:  # an abuser's failure is counted, never fatal
                    count(f"abuser error {type(exc).__name__}")
                    time.sleep(0.2)
        return threading.Thread(target=run, daemon=True)

    def bursts():
        socks = [socket.create_connection(("127.0.0.1", srv.port), timeout=20) for _ in range(60)]
        for sock in socks:
            sock.sendall(handshake_bytes(srv, "198.51.100.70"))
        count(f"burst open {[status_of(s) for s in socks].count(101)}")
        time.sleep(1)
        for sock in socks:
            sock.close()

    def flood():
        sock = open_raw(srv, "198.51.100.71", timeout=10)
        ping = frame(0x1, json.dumps({"type": "ping", "t": "x" * 200_000}).encode())
        try:
            for _ in range(500):
                sock.sendall(ping)
            count("flood never cut")
        except OSError:
            count("flood cut")
        sock.close()

    def control_pings():
        sock = open_raw(srv, "198.51.100.72", timeout=10)
        try:
            sock.sendall(frame(0x9, b"") * 5000)
            while sock.recv(65536):
                pass
            count("ping flood closed")
        except OSError:
            count("ping flood cut")
        sock.close()

    def stalled():
        sock = socket.create_connection(("127.0.0.1", srv.port), timeout=20)
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"X-Forwarded-For: 198.51.100.73\r\nContent-Length: 100000\r\n\r\n{")
        count(f"stalled {sock.recv(100).split(b' ', 2)[1].decode() if True else ''}")
        sock.close()

    def resumes():
        client = WS(srv.ws_url, header=["X-Forwarded-For: 198.51.100.74"], timeout=30)
        client.chat("finish me", rid="r", params={"max_new_tokens": 300})
        for _ in range(200):
            client.send({"type": "resume", "id": "r", "from": 0})
        last = client.until(lambda f: f.get("code") == "rate_limited")
        count(f"resume refused after {sum(1 for f in last if f['type'] == 'done')}")
        client.close()

    owner = cookie(srv, "198.51.100.75")
    words = " ".join(f"alpha{i}" for i in range(250_000))[:2 * 2**20 - 200]
    heavy = json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": words}]})

    def search_spam():
        status = import_(srv, owner, heavy.encode(), "198.51.100.75")[0]
        count(f"heavy import {status}")
        for _ in range(5):
            headers = {"Cookie": owner, "X-Forwarded-For": "198.51.100.75"}
            count(f"search {request(srv, 'GET', '/api/search?q=alpha', headers=headers)[0]}")

    abusers = [guard(f) for f in (bursts, flood, control_pings, stalled, resumes, search_spam)]
    for thread in abusers:
        thread.start()
    time.sleep(3)
    health = Health(srv)
    answers: dict = {}

    def user(i):
        address = f"203.0.113.{i + 1}"
        client = WS(srv.ws_url, timeout=120, cookie=cookie(srv, address), header=[f"X-Forwarded-For: {address}"])
        conv, got = None, []
        for turn in range(5):
            t0 = time.monotonic()
            frames = client.chat(f"user {i} turn {turn}", rid=f"u{turn}", conversation_id=conv,
                                 params={"max_new_tokens": 30})
            conv = conv or conv_of(frames)
            got.append((frames[-1]["type"], frames[-1].get("reason") or frames[-1].get("code"),
                        round(time.monotonic() - t0, 2)))
        client.close()
        answers[i] = got

    users = [threading.Thread(target=user, args=(i,)) for i in range(4)]
    t0 = time.monotonic()
    for thread in users:
        thread.start()
    for thread in users:
        thread.join(300)
    users_s = time.monotonic() - t0
    stop.set()
    for thread in abusers:
        thread.join(60)
    checks = health.done()
    rss = metric(srv, "process_resident_memory_bytes")
    latencies = sorted(s for got in answers.values() for _, _, s in got)
    figures = {"users_s": round(users_s, 1), "answers": len(latencies),
               "answer_s_p50_max": [latencies[len(latencies) // 2], latencies[-1]] if latencies else None,
               "healthz": checks, "rss_mib": [round(base_rss / 2**20), round(rss / 2**20)],
               "abuse": dict(sorted(counts.items()))}
    with capsys.disabled():
        print("\nsoak22 figures:", json.dumps(figures))
    if os.environ.get("CHAT_SOAK_FIGURES"):
        with open(os.environ["CHAT_SOAK_FIGURES"] + ".22", "w") as f:
            json.dump(figures, f, indent=1)
    assert sorted(answers) == [0, 1, 2, 3]
    for got in answers.values():
        assert [(kind, reason in ("stop", "length")) for kind, reason, _ in got] == [("done", True)] * 5, got
    assert checks["failed"] == 0
    assert srv.proc.poll() is None and "Traceback" not in srv.log_path.read_text(errors="replace")
    assert not counts.get("flood never cut")
    assert not [k for k in counts if k.startswith("burst open") and int(k.split()[-1]) > 32]
