"""Log probabilities over the WebSocket: ``params.logprobs`` / ``top_logprobs`` put each token's entry on
the delta frame that carries its text; bad values are ``bad_message`` and the connection goes on."""
from __future__ import annotations

import math

import pytest

from fakes import AppServer
from helpers import WS, make_app, make_engine, text_of


@pytest.fixture(scope="module")
def live(tiny_model, tmp_path_factory):
    engine = make_engine(tiny_model, tmp_path_factory.mktemp("wslp"))
    server = AppServer(make_app(engine, max_new_tokens=64))
    yield server
    server.close()
    engine.shutdown()


def test_delta_frames_carry_their_tokens_log_probabilities(live):
    client = WS(live.ws_url)
    frames = client.chat("Hello there", params={"temperature": 0, "max_new_tokens": 12, "logprobs": True,
                                                "top_logprobs": 3})
    plain = client.chat("Hello there", rid="r2", params={"temperature": 0, "max_new_tokens": 12})
    client.close()
    assert frames[-1]["type"] == "done"
    deltas = [f for f in frames if f["type"] == "delta"]
    entries = [e for f in deltas for e in f.get("logprobs", [])]
    assert len(entries) == frames[-1]["usage"]["completion_tokens"]
    assert bytes(b for e in entries for b in e["bytes"]).decode() == text_of(frames)  # each token once, in order
    for entry in entries:
        assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 3
        assert entry["top_logprobs"][0]["logprob"] >= entry["logprob"] - 1e-6
        assert sum(math.exp(a["logprob"]) for a in entry["top_logprobs"]) <= 1 + 1e-6
    assert all("logprobs" not in f for f in plain)
    assert text_of(plain) == text_of(frames)


@pytest.mark.parametrize("params", [{"logprobs": "yes"}, {"logprobs": True, "top_logprobs": 21},
                                    {"top_logprobs": 2}])
def test_bad_log_probability_params(live, params):
    client = WS(live.ws_url)
    frames = client.chat("Hi", params=params)
    assert frames[-1]["type"] == "error" and frames[-1]["code"] == "bad_message"
    assert "logprobs" in frames[-1]["message"]
    assert client.ping()["type"] == "pong"
    client.close()
