"""``python -m bench.stub_upstream``: a fast OpenAI-compatible upstream that streams tokens on a fixed schedule.

So the model is not the limit when measuring the web tier: ``GET /v1/models`` and ``POST
/v1/chat/completions`` (SSE with ``stream: true``, one JSON object otherwise). Each stream waits
``--first-delay`` seconds, then sends one token every ``1 / --rate`` seconds, ``max_tokens`` of
them (default ``--tokens``). A token's text is ``t<monotonic µs> `` stamped as it is sent, so a
client on the same host (CLOCK_MONOTONIC is system-wide) reads each delta's latency off its text.

One gevent process with raw sockets and prebuilt byte templates: a few µs of CPU per token,
so it is not what saturates first (``bench.webtier`` measures its CPU anyway).
"""
from __future__ import annotations

from gevent import monkey

monkey.patch_all()

import argparse  # noqa: E402  (after patching)
import json  # noqa: E402
import time  # noqa: E402

import gevent  # noqa: E402
from gevent.server import StreamServer  # noqa: E402

MODEL = "stub"
_HEAD = b'data: {"id":"chatcmpl-stub","object":"chat.completion.chunk","created":0,"model":"stub","choices":'
_FIRST = _HEAD + b'[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n'
_TOKEN = _HEAD + b'[{"index":0,"delta":{"content":"t%d "},"finish_reason":null}]}\n\n'
_FINISH = _HEAD + b'[{"index":0,"delta":{},"finish_reason":"%s"}]}\n\n'
_USAGE = _HEAD + b'[],"usage":{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}}\n\n'
_SSE_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
             b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")


def _chunk(data: bytes) -> bytes:
    """One HTTP/1.1 chunk: SSE servers (llama.cpp, vLLM) stream chunked, one event a chunk."""
    return b"%x\r\n%s\r\n" % (len(data), data)


def stamp() -> int:
    """Now on the system-wide monotonic clock, in µs (what token texts carry)."""
    return time.monotonic_ns() // 1000


def _reply(sock, status: str, body: dict) -> None:
    data = json.dumps(body).encode()
    sock.sendall(f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
                 f"Connection: close\r\n\r\n".encode() + data)


def _read_request(sock):
    """(method, path, body) of one HTTP/1.1 request, or None when the peer closed."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        body += chunk
    return method, path, body


class Stub:
    """The server's schedule: tokens/s per stream, tokens per answer, delay before the first."""

    def __init__(self, rate: float, tokens: int, first_delay: float):
        self.rate, self.tokens, self.first_delay = rate, tokens, first_delay

    def handle(self, sock, _address) -> None:
        try:
            request = _read_request(sock)
            if request is None:
                return
            method, path, body = request
            if method == "GET" and path.rstrip("/").endswith("/models"):
                _reply(sock, "200 OK", {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
            elif method == "POST" and path.endswith("/chat/completions"):
                self.complete(sock, json.loads(body or b"{}"))
            else:
                _reply(sock, "404 Not Found", {"error": {"message": f"no route {path}"}})
        except OSError:
            pass  # the client went away mid-stream (a cancel)
        finally:
            sock.close()

    def complete(self, sock, req: dict) -> None:
        n = int(req.get("max_tokens") or self.tokens)
        finish = "length"
        if req.get("stream"):
            sock.sendall(_SSE_HEAD + _chunk(_FIRST))
            for _ in self.schedule(n):
                sock.sendall(_chunk(_TOKEN % stamp()))
            tail = _FINISH % finish.encode()
            if (req.get("stream_options") or {}).get("include_usage"):
                tail += _USAGE % (1, n, n + 1)
            sock.sendall(_chunk(tail + b"data: [DONE]\n\n") + b"0\r\n\r\n")
        else:
            text = "".join(f"t{stamp()} " for _ in self.schedule(n))
            _reply(sock, "200 OK", {"id": "chatcmpl-stub", "object": "chat.completion", "created": 0,
                                    "model": MODEL, "choices": [{"index": 0, "finish_reason": finish,
                                    "message": {"role": "assistant", "content": text}}],
                                    "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}})

    def schedule(self, n: int):
        """Yields at each token's due time: first_delay, then every 1/rate on a fixed schedule."""
        due = time.monotonic() + self.first_delay
        step = 1.0 / self.rate if self.rate > 0 else 0.0
        for _ in range(n):
            wait = due - time.monotonic()
            if wait > 0:
                gevent.sleep(wait)
            yield
            due += step


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.stub_upstream", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8099)
    parser.add_argument("--rate", type=float, default=50.0, help="tokens per second per stream (0: no pause)")
    parser.add_argument("--tokens", type=int, default=200, help="tokens per answer when max_tokens is not given")
    parser.add_argument("--first-delay", type=float, default=0.0, help="seconds before the first token")
    args = parser.parse_args(argv)
    stub = Stub(args.rate, args.tokens, args.first_delay)
    server = StreamServer((args.host, args.port), stub.handle, backlog=1024)
    print(f"stub upstream on http://{args.host}:{args.port}/v1", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
