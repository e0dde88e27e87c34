"""The benchmark's own logic, without a model: phase selection, the peer's OpenAI-compatible client,
its workloads, and the side-by-side report rows."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from bench import peer, report, run, targets, workloads


class LlamaLike(BaseHTTPRequestHandler):
    """Streams like llama.cpp's server: a role chunk, one chunk per token, a last chunk with its
    ``timings``, a usage chunk (``stream_options.include_usage``), then ``[DONE]``."""

    protocol_version = "HTTP/1.1"
    bodies: list = []

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.bodies.append(body)
        words = [f"w{i} " for i in range(body["max_tokens"])]
        prompt = sum(len(m["content"].split()) for m in body["messages"])
        events = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}]}]
        events += [{"choices": [{"index": 0, "delta": {"content": w}, "finish_reason": None}]} for w in words]
        events += [{"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
                    "timings": {"prompt_n": 3, "cache_n": prompt - 3, "prompt_ms": 1.5}},
                   {"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": len(words)}}]
        payload = b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


@pytest.fixture
def llama_like():
    handler = type("Handler", (LlamaLike,), {"bodies": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_port, handler
    server.shutdown()
    server.server_close()


def args(**overrides):
    base = dict(tokens=6, reps=2, history_tokens=200, multiturn_reps=1, timeout=30)
    return SimpleNamespace(**{**base, **overrides})


def test_the_peer_client_times_a_stream_and_keeps_the_conversation(llama_like):
    port, handler = llama_like
    client = peer.PeerClient(port, "Be brief.")
    first = client.request("a", "hello there", workloads.params(5))
    assert first["tokens"] == 5 and first["reason"] == "length" and len(first["delta_times"]) == 5
    assert first["sent"] < first["first"] <= first["done"] and first["tok_s"] > 0
    second = client.request("b", "and again", workloads.params(4), conversation_id=first["conversation_id"])
    client.close()
    sent = handler.bodies[-1]
    assert [m["role"] for m in sent["messages"]] == ["system", "user", "assistant", "user"]
    assert sent["messages"][2]["content"] == "w0 w1 w2 w3 w4 " and sent["stream"] is True
    assert sent["temperature"] == 0 and sent["seed"] == 1 and sent["max_tokens"] == 4
    assert second["prompt_tokens"] == second["reused_tokens"] + 3


def test_the_same_workloads_run_against_the_peer(llama_like):
    port, _ = llama_like
    peer.PeerClient.conversations = {}

    def connect(user=None):  # streams: user i
        return peer.PeerClient(port, "Be brief.")

    one = workloads.single(connect, args())
    assert one["n"] == 2 and one["tokens"] == [6, 6] and one["paired"] == []
    eight = workloads.streams(connect, 8, args(), "peer")
    assert eight["streams"] == 8 and eight["tokens_total"] == 48 and eight["ttfd_p95_s"] >= eight["ttfd_p50_s"]
    talk = workloads.multiturn(connect, args())
    assert talk["turn6_prompt_tokens"] > talk["turn1_prompt_tokens"]
    assert talk["turn6_reused_tokens"] == talk["turn6_prompt_tokens"] - 3  # the client's own figure kept


def parse(*argv):
    parser = run.build_parser()
    a = parser.parse_args(list(argv))
    run.resolve(a, parser)
    return a


def test_phase_selection():
    assert parse().phases == list(run.PHASES) and parse().concurrency == [1, 2, 4, 8, 16]
    a = parse("--only", "peer", "--quick")
    assert a.phases == ["single", "concurrency", "multiturn", "peer"] and a.concurrency == [8] and a.tokens == 16
    assert parse("--skip-drafts", "--skip-restart").phases[-1] == "peer"
    assert parse("--skip-peer", "--skip-webtier", "--skip-drafts", "--skip-restart").phases[-1] == "structured"
    assert parse("--skip-peer", "--skip-webtier", "--skip-drafts", "--skip-restart",
                 "--skip-structured").phases[-1] == "quality"
    assert parse("--skip-peer", "--skip-webtier", "--skip-drafts", "--skip-restart", "--skip-structured",
                 "--skip-quality").phases[-1] == "v1-big"
    assert parse("--only-webtier").only_webtier and parse("--only-webtier").name == "webtier"
    assert parse("--only", "single,inprocess").phases == ["inprocess", "single"]
    with pytest.raises(SystemExit):
        parse("--only", "nonsense")


def test_sampled_runs_send_the_same_settings_to_both_servers(llama_like):
    port, handler = llama_like
    try:
        a = parse("--only", "peer", "--temperature", "0.7", "--top-p", "0.9")
        assert workloads.params(5, seed=3) == {"temperature": 0.7, "top_p": 0.9, "top_k": 0, "min_p": 0.0,
                                               "max_new_tokens": 5, "seed": 3}
        assert "temperature 0.7, top_p 0.9" in report.sampling(vars(a))
        peer.PeerClient(port, "Be brief.").request("s", "hello", workloads.params(3, seed=3))
        sent = handler.bodies[-1]  # llama.cpp's own top_k 40 / min_p 0.05 defaults off: the same filters as ours
        assert (sent["temperature"], sent["top_p"], sent["top_k"], sent["min_p"], sent["seed"]) == (0.7, 0.9, 0, 0.0, 3)
        parse("--temperature", "1.5")
        assert workloads.params(5)["top_p"] == 1.0 and workloads.params(5)["temperature"] == 1.5
        a = parse("--temperature", "1.0", "--unseeded")
        assert "seed" not in workloads.params(5) and report.sampling(vars(a)).endswith("no seed")
        with pytest.raises(SystemExit):
            parse("--top-k", "40")  # a filter without a temperature
        with pytest.raises(SystemExit):
            parse("--unseeded")
    finally:
        parse()
    assert workloads.params(5) == {"temperature": 0, "max_new_tokens": 5, "seed": 1}
    assert report.sampling(vars(parse())).startswith("greedy")


def result(with_peer: bool) -> dict:
    """A run's results, as the phases leave them (numbers made up)."""
    res = {"date": "today", "args": {"tokens": 16, "quick": True}, "machine": {"cores": 2, "loadavg_before": 0},
           "single": {"tok_s_p50": 60.0, "ttfd_p50_s": 0.05, "ttfd_p95_s": 0.06, "aggregate_tok_s_p50": 50.0},
           "concurrency": [{"streams": 8, "aggregate_tok_s": 150.0, "stream_tok_s_p50": 19.0, "ttfd_p50_s": 0.2,
                            "ttfd_p95_s": 0.3, "tokens_total": 128, "tokens_min": 16, "tokens_max": 16,
                            "rss_peak_mib": 700.0, "reasons": {"length": 8}}],
           "multiturn": {"ttfd_turn1_s": 0.1, "ttfd_turn6_s": 0.4, "ratio": 4.0, "turn6_prompt_tokens": 2600,
                         "turn6_reused_tokens": 2200},
           "startup": {"ready_s": 5.0}}
    if with_peer:
        res["peer"] = {"args": " ".join(peer.LLAMA_ARGS), "gguf": "/x/model.gguf", "build": "b1", "ready_s": 1.0,
                       "single": {"tok_s_p50": 75.0, "ttfd_p50_s": 0.04},
                       "streams": {"aggregate_tok_s": 120.0, "stream_tok_s_p50": 15.0, "ttfd_p50_s": 1.1,
                                   "ttfd_p95_s": 1.3},
                       "multiturn": {"ttfd_turn1_s": 1.5, "ttfd_turn6_s": 2.0, "turn6_prompt_tokens": 2600,
                                     "turn6_reused_tokens": 2100}}
    else:
        res["peer"] = {"skipped": "LLAMA_SERVER is not set (it names a llama-server binary)"}
    return res


def test_the_report_puts_the_peer_beside_this_server():
    res = result(with_peer=True)
    res["targets"], res["figures"] = targets.targets(res), targets.figures(res)
    rows = {t["metric"]: t for t in res["targets"]}
    assert rows["one stream ÷ llama.cpp's server (delivered tok/s)"]["value"] == pytest.approx(0.8)
    assert rows["one stream ÷ llama.cpp's server (delivered tok/s)"]["ok"] is True
    assert rows["8 streams aggregate ÷ llama.cpp's server"]["value"] == pytest.approx(1.25)
    assert rows["turn 6 first delta ÷ llama.cpp's server's turn 6"]["value"] == pytest.approx(0.2)
    assert not [f for f in res["figures"] if f[0].startswith("reference")]  # measured here, not quoted
    md = report.markdown(res)
    assert "| one stream, delivered tok/s (p50) | 60 | 75 | 0.8 | ≥ 0.8 |" in md
    assert "| long conversation: turn 6 first delta ms | 400 | 2000 | 0.2 | ≤ 0.5 |" in md


def test_without_llama_server_the_report_says_the_peer_was_skipped():
    res = result(with_peer=False)
    res["targets"], res["figures"] = targets.targets(res), targets.figures(res)
    assert not [t for t in res["targets"] if "llama" in t["metric"]]
    assert "llama.cpp's server: not measured (LLAMA_SERVER is not set" in report.markdown(res)


def test_run_peer_skips_without_the_binary(monkeypatch, tmp_path):
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    assert "skipped" in peer.run_peer(tmp_path, args(), {"gguf": "/x/model.gguf"})
    monkeypatch.setenv("LLAMA_SERVER", str(tmp_path / "missing"))
    with pytest.raises(RuntimeError, match="not an executable"):
        peer.run_peer(tmp_path, args(), {"gguf": "/x/model.gguf"})


def test_the_structured_phase_has_its_targets():
    res = result(False)
    res["structured"] = {"compile": {"max_first_ms": 4.9},
                         "validity": {"free": {"percent": 20.0}, "json_schema": {"percent": 100.0}},
                         "mask": {"ratio_p50": 0.95}, "scoring": {"sum_diff_per_token": 4e-4}}
    rows = {t["metric"]: t for t in targets.targets(res) if "schema" in t["metric"] or "constrained" in t["metric"]
            or "echo" in t["metric"]}
    assert len(rows) == 4 and all(t["ok"] for t in rows.values()), rows
    assert any("without: 20%" in m for m in rows)


def test_the_phi_shape_files_vocabulary_has_what_llama_cpp_looks_up():
    """The bundled tokenizer cut to Phi's 32064 tokens keeps what llama.cpp's vocabulary loader looks up by name
    (else "error loading model vocabulary: unordered_map::at"): every byte's token it has, and, in a file it takes for
    Phi-3 (its name says phi3), Phi-3's <unk>, <s>, </s> and <|endoftext|>; the ordinary tokens stay in place."""
    import gguf

    from bench import model_shapes
    from chat.engine.model.loader import bundled_gguf

    src = gguf.GGUFReader(str(bundled_gguf()))

    def strings(key: str) -> list[str]:
        return [bytes(src.fields[key].parts[i]).decode("utf-8", "replace") for i in src.fields[key].data]
    kinds = src.fields["tokenizer.ggml.token_type"]
    original = strings("tokenizer.ggml.tokens")
    shape = model_shapes.SHAPES["phi3.5-mini"]
    tokens, types, merges = model_shapes.vocabulary(shape, original, [int(kinds.parts[i][0]) for i in kinds.data],
                                                    strings("tokenizer.ggml.merges"))
    assert len(tokens) == len(types) == shape.vocab == 32064 < len(original) and len(set(tokens)) == len(tokens)
    assert set(model_shapes.byte_level_alphabet()) & set(original) <= set(tokens)  # (it has no token for a few)
    for special in ("<unk>", "<s>", "</s>", "<|endoftext|>"):
        assert special in tokens and types[tokens.index(special)] == gguf.TokenType.CONTROL
    assert tokens[:32000] == original[:32000]
    kept = set(tokens)
    assert merges and all(m.replace(" ", "") in kept and all(p in kept for p in m.split(" ")) for m in merges)
    # the others are padded, not cut, and get no Phi tokens
    qwen, _, _ = model_shapes.vocabulary(model_shapes.SHAPES["qwen3-0.6b"], original, [1] * len(original), [])
    assert qwen[:len(original)] == original and "<unk>" not in qwen and len(qwen) == 151936
