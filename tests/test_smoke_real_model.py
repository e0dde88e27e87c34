"""The real bundled model (SmolLM2-135M-Instruct) answering over the socket."""
from __future__ import annotations

import json

import pytest
from helpers import WS, http_get, text_of, wait_for

from chat.engine.kernels import cpu, quant


@pytest.mark.real_model
def test_bundled_model_knows_the_capital_of_france(server_factory):
    srv = server_factory("real", CHAT_MODEL="", CHAT_DTYPE="auto")
    client = WS(srv.ws_url)
    assert client.ready["model"] == "SmolLM2-135M-Instruct"
    frames = client.chat("What is the capital of France?", params={"temperature": 0, "max_new_tokens": 40})
    client.close()
    assert frames[-1]["type"] == "done" and frames[-1]["reason"] == "stop", frames[-1]
    assert "Paris" in text_of(frames)
    # The GGUF's own 4-bit blocks run the decode steps on every x86 class with AVX2 (engine/kernels/cpu.py): on the
    # C++ library's block products from the start when its build is kept, else on torch's int4 kernel until
    # it is built (while idle).
    isa = cpu.detect().isa
    quantized = quant.quantized(isa)
    ready = json.loads(http_get(srv.url + "/readyz")[2])
    assert ready["weights"] in (("int4", "blocks") if quantized else ("float32",)) and ready["cpu"] == isa
    products = ("qkv", "o", "gate_up", "down", "output")
    forms = {"int4": {**dict.fromkeys(products, "int4"), "output": "int4x2"},
             "blocks": {**dict.fromkeys(products, "q4"), "output": "q8"}, "float32": dict.fromkeys(products, "float32")}
    assert ready["formats"] == forms[ready["weights"]]
    assert f'chat_model_weights{{weights="{ready["weights"]}"}} 1.0' in http_get(srv.url + "/metrics")[2].decode()
    # While idle it builds its C++ decode step (the tests install g++) and moves the weights onto its block
    # products, then says so.
    assert wait_for(lambda: not json.loads(http_get(srv.url + "/readyz")[2])["finishing"], timeout=180)
    ready = json.loads(http_get(srv.url + "/readyz")[2])
    assert ready["decode"] == ("native" if quantized else "torch")
    assert ready["weights"] == ("blocks" if quantized else "float32") and ready["formats"] == forms[ready["weights"]]
    assert f'chat_model_weights{{weights="{ready["weights"]}"}} 1.0' in http_get(srv.url + "/metrics")[2].decode()
    client = WS(srv.ws_url)
    frames = client.chat("What is the capital of France?", params={"temperature": 0, "max_new_tokens": 40})
    client.close()
    assert "Paris" in text_of(frames)
