"""``chat.engine.remote.sse.Body``: an upstream's streamed body as lines, de-chunked off the socket; and
``concurrency.receiver``, which reads the socket under gevent without gevent's per-read machinery."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from helpers import ROOT

from chat.engine.remote.sse import MAX_LINE_BYTES, Body

EVENTS = [b'data: {"choices":[{"delta":{"content":"%d"}}]}\n\n' % i for i in range(5)] + [b"data: [DONE]\n\n"]
LINES = [line for event in EVENTS for line in event.split(b"\n")[:-1]]


class Buffered:
    """``read1`` of http.client's buffered reader: what it holds, else one read of the socket."""

    def __init__(self, held: bytes, recv):
        self.held, self.recv = held, recv

    def read1(self, n: int) -> bytes:
        held, self.held = self.held, b""
        return held or self.recv(n)


class Response:
    """What ``Body`` uses of an ``http.client.HTTPResponse``: ``fp`` holding what came with the headers."""

    def __init__(self, fp, chunked: bool, length: int | None = None):
        self.fp, self.chunked, self.length = fp, chunked, length


def chunked(payloads, extension=b"", trailer=b"") -> bytes:
    return b"".join(b"%X%s\r\n%s\r\n" % (len(p), extension, p) for p in payloads) + b"0\r\n" + trailer + b"\r\n"


def read_all(body_bytes: bytes, pieces, buffered: int = 0, **response) -> list[bytes]:
    """Every line ``Body`` gives: ``buffered`` bytes came with the headers, the rest in ``pieces``."""
    head, rest = body_bytes[:buffered], body_bytes[buffered:]
    parts = [rest[i:i + pieces] for i in range(0, len(rest), pieces)] if pieces else [rest]
    parts.append(b"")  # then the connection's end
    recv = lambda n: parts.pop(0)  # noqa: E731
    body = Body(Response(Buffered(head, recv), **response), recv)
    lines = []
    while (got := body.read()) is not None:
        lines += got
    return lines


@pytest.mark.parametrize("pieces", [0, 1, 2, 3, 7, 64])
def test_chunked_body_gives_the_same_lines_however_it_is_split(pieces):
    data = chunked(EVENTS)
    assert read_all(data, pieces, chunked=True) == LINES
    assert read_all(data, pieces, buffered=11, chunked=True) == LINES


def test_events_split_across_chunks_and_chunks_holding_several_events():
    joined = b"".join(EVENTS)
    payloads = [joined[:10], joined[10:11], joined[11:200], joined[200:]]
    assert read_all(chunked(payloads), 5, chunked=True) == LINES


def test_chunk_extensions_and_trailers_are_ignored_and_the_last_chunk_ends_the_body():
    data = chunked(EVENTS, extension=b";name=value", trailer=b"X-Trailer: 1\r\n") + b"junk after the end"
    assert read_all(data, 4, chunked=True) == LINES


def test_a_body_with_a_length_ends_there_and_keeps_its_last_line_without_a_newline():
    data = b"".join(EVENTS) + b"data: tail"
    assert read_all(data + b"more bytes than announced", 9, chunked=False, length=len(data)) == LINES + [b"data: tail"]


def test_a_body_until_close_ends_with_the_connection():
    assert read_all(b"".join(EVENTS), 6, chunked=False, length=None) == LINES


def test_an_empty_body_reads_nothing():
    never = lambda n: pytest.fail("read past the end")  # noqa: E731
    body = Body(Response(Buffered(b"", never), chunked=False, length=0), never)
    assert body.read() is None


@pytest.mark.parametrize("data, message", [
    (b"zz\r\ndata\r\n", "chunk size"),
    (b"-4\r\ndata\r\n", "chunk size"),
    (b"4\r\ndataXX0\r\n\r\n", "no CRLF after a chunk"),
    (b"4" * 2000, "no chunk size"),
])
def test_a_malformed_chunked_body_is_an_error_naming_what_is_wrong(data, message):
    with pytest.raises(ValueError, match=message):
        read_all(data, 3, chunked=True)


def test_a_line_too_long_is_an_error():
    with pytest.raises(ValueError, match="longer than"):
        read_all(b"data: " + b"x" * (MAX_LINE_BYTES + 10), 1 << 16, chunked=False, length=None)


SCRIPT = textwrap.dedent("""
    from gevent import monkey
    monkey.patch_all()
    import json, socket, time
    import gevent
    from chat.concurrency import receiver

    out = {}
    a, b = socket.socketpair()
    a.settimeout(None)
    recv = receiver(a)
    out["kind"] = type(recv).__name__
    failed = []
    class Counting:  # the OS socket, counting the reads that find nothing
        def __init__(self, raw):
            self.raw = raw
        def recv(self, n):
            try:
                return self.raw.recv(n)
            except BlockingIOError:
                failed.append(n)
                raise
    recv._raw = Counting(recv._raw)
    ticks = []
    ticker = gevent.spawn(lambda: [ticks.append(gevent.sleep(0.01)) for _ in range(20)])
    def writer():
        for piece in (b"one", b"two"):
            gevent.sleep(0.05)
            b.send(piece)
    gevent.spawn(writer)
    out["got"] = [recv.recv(100).decode(), recv.recv(100).decode()]
    out["others ran while it waited"] = len(ticks) > 3
    b.send(b"abcdef")
    gevent.sleep(0.05)
    out["a full read, then what is left"] = [recv.recv(3).decode(), recv.recv(3).decode()]
    b.send(b"ready before the read")
    gevent.sleep(0.05)
    out["after a short read, what arrived meanwhile"] = recv.recv(100).decode()
    out["reads that found nothing"] = len(failed)
    gevent.spawn_later(0.05, a.shutdown, socket.SHUT_RDWR)
    t = time.monotonic()
    out["after shutdown"] = recv.recv(100).decode()
    out["woke within 1 s"] = time.monotonic() - t < 1
    recv.close()
    c, d = socket.socketpair()
    c.settimeout(5)
    out["with a timeout"] = type(receiver(c)).__name__
    print(json.dumps(out))
""")


def test_green_receiver_waits_without_blocking_the_hub_and_wakes_on_shutdown():
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out == {"kind": "_GreenReceiver", "got": ["one", "two"], "others ran while it waited": True,
                   "a full read, then what is left": ["abc", "def"],
                   "after a short read, what arrived meanwhile": "ready before the read",
                   "reads that found nothing": 0,  # a short read waits for readiness before reading again
                   "after shutdown": "", "woke within 1 s": True, "with a timeout": "_PlainReceiver"}
