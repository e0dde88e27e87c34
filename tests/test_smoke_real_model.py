"""The real bundled model (SmolLM2-135M-Instruct) answering over the socket."""
from __future__ import annotations

import pytest

from helpers import WS, text_of


@pytest.mark.real_model
def test_bundled_model_knows_the_capital_of_france(server_factory):
    srv = server_factory("real", CHAT_MODEL="", CHAT_DTYPE="auto")
    client = WS(srv.ws_url)
    assert client.ready["model"] == "SmolLM2-135M-Instruct"
    frames = client.chat("What is the capital of France?", params={"temperature": 0, "max_new_tokens": 40})
    client.close()
    assert frames[-1]["type"] == "done" and frames[-1]["reason"] == "stop", frames[-1]
    assert "Paris" in text_of(frames)
