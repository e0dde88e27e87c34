"""Settings, read once from ``CHAT_*`` environment variables into one typed object."""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from . import config_values as read
from .errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent


def _setting(env: str, default: Any, parse: Callable[[str], Any] | None = None, *, low: float | None = None,
             high: float | None = None, doc: str = "", section: str = "", shown: str = "") -> Any:
    """A dataclass field that knows its environment variable, how to parse it and how to document it.

    ``section`` starts a new group in the docs at this field; ``shown`` replaces the default there.
    """
    return field(default=default, metadata={
        "env": env, "parse": parse, "low": low, "high": high, "doc": doc, "section": section, "shown": shown})


@dataclass(frozen=True)
class Settings:
    """Every tunable of the server; ``Settings.from_env()`` reads ``CHAT_*``."""

    model: str = _setting(
        "CHAT_MODEL", "", str, section="Model",
        doc="What to serve: a Hugging Face hub id, a local model folder or a `.gguf` file. "
            "Empty: the bundled SmolLM2-135M-Instruct. See [models.md](models.md).")
    template: str = _setting(
        "CHAT_TEMPLATE", "auto", str,
        doc="The chat template: `auto` the model's own, or ChatML for a base model that has none (its answers "
            "then end at the next ChatML marker; `/readyz` says `base_model`); `chatml` ChatML in place of the "
            "model's own; or the path of a Jinja file. `/v1/completions` takes raw prompts whatever this says.")
    model_name: str = _setting(
        "CHAT_MODEL_NAME", "", str,
        doc="Display name, shown on the page, in `ready` and as the `/v1` model id. Empty: derived from the "
            "model (hub id: the part after `/`; folder: its name; `.gguf`: the file name without extension; "
            "remote: the backend's model).")
    dtype: str = _setting(
        "CHAT_DTYPE", "auto", read.choice("auto", "float32", "bfloat16"),
        doc="Weight type: `auto`, `float32` or `bfloat16`. `auto` picks bfloat16 on CUDA and on CPUs with "
            "native bf16 (`avx512_bf16` or `amx_bf16`), and float32 elsewhere.")
    quant: str = _setting(
        "CHAT_QUANT", "auto", read.choice("auto", "int4", "off"),
        doc="Weights of a GGUF model on the CPU. `auto`: the file's blocks (Q4_0..Q8_0, Q4_K, Q5_K, Q6_K as "
            "stored, their scales as the file has them; exact) on the C++ library's block kernels with 8-bit "
            "activations, as llama.cpp multiplies them "
            "(`weights: blocks`); float types and Q2_K/Q3_K dense. Until that library is built (a first start; "
            "`CHAT_NATIVE`) and without a C++ compiler: torch's int4 kernel (`weights: int4`; s and z in bf16), "
            "with dense bf16 copies for long prefills on CPUs with native bf16. Either is checked against dense "
            "weights at start-up (dense, with a warning, if they disagree). `int4`: the quantized weights only. "
            "`off`: dense only. CPUs without AVX2 use dense weights. `/readyz` and `/metrics` say which "
            "(`weights`, `formats`, `cpu`).")
    cpu_isa: str = _setting(
        "CHAT_CPU_ISA", "auto", read.choice("auto", "avx512_bf16", "avx512", "avx2", "generic"),
        doc="The CPU class the engine uses: `auto` (this CPU's), or a lower one to test or measure that class on "
            "a better machine: the weights' policy, the C++ step's compiler flags and torch's own kernels "
            "(`ATEN_CPU_CAPABILITY`, `ONEDNN_MAX_CPU_ISA`, `MKL_ENABLE_INSTRUCTIONS`, set when the engine starts "
            "unless already set) follow it. A class above this CPU's is ignored with a warning.")
    native: bool = _setting(
        "CHAT_NATIVE", True, read.boolean,
        doc="Run each decode step on the CPU as one C++ call (`chat/engine/kernels/native.cpp`) and a GGUF's "
            "products on the same library's block kernels (`blocks.cpp`, see `CHAT_QUANT`): 2-4x torch's operators "
            "at one stream. Built with the machine's C++ compiler (`$CXX`, `c++` or `g++`) while idle after the first "
            "start, 15-25 s once, kept under `CHAT_CACHE_DIR`; checked against torch's step before use. Without "
            "a compiler, or `false`: torch's operators and int4 kernel. `/readyz` reports which (`decode`).")
    draft: str = _setting(
        "CHAT_DRAFT", "ngram", read.choice("ngram", "off"),
        doc="`ngram`: answers guess their next tokens from their own context and check them in one C++ step, "
            "several answers' together where the measured step costs say it pays (several tokens a step when one "
            "quotes or edits; the same answers as without). `off`: none.")
    device: str = _setting(
        "CHAT_DEVICE", "auto", read.choice("auto", "cpu", "cuda"),
        doc="`auto`, `cpu` or `cuda`. `auto` uses CUDA when available.")
    threads: int = _setting(
        "CHAT_THREADS", 0, int, low=0, high=512,
        doc="torch threads for the model. `0`: torch's default (all cores).")
    cache_dir: str = _setting(
        "CHAT_CACHE_DIR", "", str,
        doc="Where the engine keeps what it measured of the model (`crossovers.json`, see `CHAT_QUANT`) and the "
            "dense conversion of a GGUF whose architecture the engine does not read directly. Empty: "
            "`<CHAT_DATA_DIR>/model-cache`.")
    data_dir: str = _setting(
        "CHAT_DATA_DIR", str(ROOT / "data"), str, shown="`data/` in the checkout",
        doc="Folder for the database and the model cache.")
    db: str = _setting(
        "CHAT_DB", "", str,
        doc="Where conversations are stored: an SQLite database file, or a PostgreSQL database as a "
            "`postgresql://user:password@host:5432/dbname` URL (`postgres://` too), which several workers "
            "and hosts can share; its schema is created and migrated at startup. Empty: "
            "`<CHAT_DATA_DIR>/chat.db`.")
    warmup: bool = _setting(
        "CHAT_WARMUP", True, read.boolean,
        doc="Run a tiny generation after loading, before `/readyz` reports ready, so the first user does not "
            "pay for it.")

    max_new_tokens: int = _setting(
        "CHAT_MAX_NEW_TOKENS", 512, int, low=1, high=32768, section="Generation",
        doc="Most tokens in one answer. Clients can only ask for fewer: over WebSocket a larger "
            "`max_new_tokens` is rejected, and on `/v1` `max_tokens` is capped.")
    context_tokens: int = _setting(
        "CHAT_CONTEXT_TOKENS", 2048, int, low=64, high=1_000_000,
        doc="Token budget for prompt plus answer. A history that does not fit loses whole old turns (the system "
            "prompt and the newest turn are kept) so that the prompt leaves room for the answer (at most half the "
            "context): when it overflows, the kept part is cut to about half the budget at once, and that cut "
            "stays put for the next turns, so they reuse the cached prompt. An answer that reaches the budget "
            "ends with reason `length`. Applies to the local model.")
    generation_timeout_s: float = _setting(
        "CHAT_GENERATION_TIMEOUT_S", 300.0, float, low=0.1, high=86400,
        doc="An answer still running after this many seconds ends with reason `timeout`.")
    grammar_close: bool = _setting(
        "CHAT_GRAMMAR_CLOSE", True, read.boolean,
        doc="A constrained answer (`response_format`, tool calls) always ends as a complete, valid value: when "
            "the tokens left reach what the shortest valid ending needs, only that ending is allowed (the "
            "answer ends with reason `length`). Off: such an answer can be cut mid-value at `max_tokens`.")
    grammar_reserve: int = _setting(
        "CHAT_GRAMMAR_RESERVE", 2, int, low=0, high=64,
        doc="Tokens kept spare when a constrained answer is closed for its budget: the close starts this many "
            "tokens before the last moment.")
    json_max_digits: int = _setting(
        "CHAT_JSON_MAX_DIGITS", 17, int, low=0, high=4096,
        doc="Most digits in one number of a constrained JSON answer (17: every 64-bit float's shortest form); "
            "a small model otherwise can fill its whole answer with one number. 0: no cap.")
    json_unique_keys: bool = _setting(
        "CHAT_JSON_UNIQUE_KEYS", True, read.boolean,
        doc="A constrained JSON answer never repeats a key within one object (JSON that repeats one is "
            "ambiguous, and a small model can loop on one key). Off: keys may repeat where the schema allows.")
    system_prompt: str = _setting(
        "CHAT_SYSTEM_PROMPT", "You are a helpful assistant.", str,
        doc="System prompt for new conversations and for `/v1` requests that bring none, unless the client "
            "sends its own.")
    temperature: float = _setting(
        "CHAT_TEMPERATURE", 0.7, float, low=0.0, high=2.0,
        doc="Default sampling temperature (0–2; 0 is greedy).")
    top_p: float = _setting(
        "CHAT_TOP_P", 0.9, float, low=0.0001, high=1.0,
        doc="Default nucleus-sampling threshold (0.0001–1).")
    max_content_chars: int = _setting(
        "CHAT_MAX_CONTENT_CHARS", 16000, int, low=1, high=10_000_000,
        doc="Longest user message or system prompt, in characters. Longer gets `too_large` (WebSocket) or "
            "413 (`/v1`).")
    max_request_chars: int = _setting(
        "CHAT_MAX_REQUEST_CHARS", 262_144, int, low=1, high=100_000_000,
        doc="Most characters of all messages of one `/v1` request together, its tools (as JSON) included. "
            "More gets 413 before any tokenizing.")

    max_batch: int = _setting(
        "CHAT_MAX_BATCH", 16, int, low=1, high=256, section="Capacity",
        doc="Generations decoded together (16 measured to serve the most users at a readable speed; see "
            "the README's Benchmark section). Further requests wait in the queue. With the remote backend, the "
            "most concurrent upstream calls per worker is `CHAT_MAX_BATCH + CHAT_MAX_QUEUE`. An engine "
            "serving several workers refuses (503) what passes its own `CHAT_MAX_BATCH + CHAT_MAX_QUEUE`: give "
            "it a queue that holds what all workers may send.")
    prefill_chunk: int = _setting(
        "CHAT_PREFILL_CHUNK", 128, int, low=1, high=1_000_000,
        doc="Prompt tokens prefilled between two decode steps while other answers stream, so a long prompt "
            "joining never stalls them for its whole prefill. Chunks are also cut to about two decode steps "
            "of time, as measured (deep in a long prompt a token costs more).")
    max_queue: int = _setting(
        "CHAT_MAX_QUEUE", 64, int, low=0, high=100_000,
        doc="Requests that may wait while the batch is full. Beyond that they get `overloaded` (WebSocket) or "
            "503 (`/v1`).")
    kv_cache_mb: int = _setting(
        "CHAT_KV_CACHE_MB", 512, int, low=0, high=1_000_000,
        doc="Memory for the per-conversation KV prefix cache, with the least recently used evicted first. "
            "`0` turns prefix reuse off.")
    kv_disk_mb: int = _setting(
        "CHAT_KV_DISK_MB", 2048, int, low=0, high=10_000_000,
        doc="Disk for conversations' KV under `<CHAT_CACHE_DIR>/kv/` (oldest out first), so a turn after a restart "
            "does not prefill the history again. `0`: memory only.")
    shared_prefix: str = _setting(
        "CHAT_SHARED_PREFIX", "system", read.choice("system", "all"),
        doc="What KV one client's prompt may reuse from another's. `system`: only the preamble of the "
            "server's own system prompt (`CHAT_SYSTEM_PROMPT`); a conversation's KV, and the preamble of a "
            "system prompt a client chose, serve that client alone (`/v1` callers count as one client). "
            "`all`: any prefix held, whoever's (faster first answers for shared documents; a client could "
            "confirm by timing that someone sent the same text). See [security.md](security.md).")
    max_active_per_connection: int = _setting(
        "CHAT_MAX_ACTIVE_PER_CONNECTION", 4, int, low=1, high=1000,
        doc="Answers one client (one identity cookie; a connection without one is its own client) may run at "
            "once, across its connections and counting answers that still run for a dropped socket. More get "
            "`busy`.")
    max_active_per_ip: int = _setting(
        "CHAT_MAX_ACTIVE_PER_IP", 8, int, low=0, high=100_000,
        doc="Answers running or queued per client address (IPv6: per /64), over the WebSocket and `/v1` "
            "together. More get `busy`. `0`: unlimited.")
    resume_grace_s: float = _setting(
        "CHAT_RESUME_GRACE_S", 10.0, float, low=0.0, high=3600,
        doc="How long an answer keeps running after its socket drops, waiting for a `resume`, and how long a "
            "finished answer stays resumable.")
    max_conversations: int = _setting(
        "CHAT_MAX_CONVERSATIONS", 1000, int, low=0, high=10_000_000,
        doc="Conversations kept per client. A new one beyond that gets `too_large` until the client deletes "
            "some. `0`: unlimited.")
    max_messages: int = _setting(
        "CHAT_MAX_MESSAGES", 1000, int, low=0, high=10_000_000,
        doc="Messages (questions and answers) per conversation: a stored one that would pass it gets "
            "`too_large` (start a new conversation), a `/v1` request holding more gets 413, and a prompt "
            "is built from at most this many of the newest stored messages. `0`: unlimited.")
    db_max_mb: int = _setting(
        "CHAT_DB_MAX_MB", -1, read.mb_or_auto, low=-1, high=10_000_000, shown="`auto`",
        doc="Most the SQLite database may grow to, in MiB. Past it (or when the disk is full) new messages are "
            "refused with `overloaded` and what is stored stays intact. `auto`: what the database holds at "
            "start-up plus 80 % of the space then free on its disk (set at each start), so it never fills the "
            "disk by itself. `0`: until the disk is full. SQLite only: on PostgreSQL, the server's own disk "
            "full (SQLSTATE 53100) is refused the same way; cap its size there with the server's disk or "
            "quotas.")
    max_storage_mb_per_ip: int = _setting(
        "CHAT_MAX_STORAGE_MB_PER_IP", 256, int, low=0, high=10_000_000,
        doc="Text (messages, attachments, system prompts) that the conversations started from one client "
            "address (IPv6: per /64) may hold, in MiB, whatever cookies they use. A new conversation or an import "
            "past it gets `too_large` until some are deleted. Raise it when many users share one address. "
            "`0`: unlimited. Imports also spend from `CHAT_RATE_LIMIT_PER_MIN` and "
            "`CHAT_RATE_LIMIT_PER_IP_PER_MIN`: one request per started 64 KiB.")
    search_timeout_s: float = _setting(
        "CHAT_SEARCH_TIMEOUT_S", 1.5, float, low=0.1, high=600,
        doc="Longest a search (`/api/search`) may take, waiting for its turn included. It runs on threads of "
            "its own, never on the event loop; past this it is stopped and answered 503 `overloaded` (add "
            "words to narrow it). A worker runs at most 8 searches at once, 2 per address; more get "
            "`overloaded` at once.")

    bind: str = _setting(
        "CHAT_BIND", "127.0.0.1:8000", read.bind, section="Server",
        doc="Where gunicorn listens: `HOST:PORT` or `unix:PATH`.")
    workers: int = _setting(
        "CHAT_WORKERS", 1, int, low=1, high=64,
        doc="gunicorn worker processes. With the local backend each loads its own model copy: for several "
            "workers, run one engine process (`CHAT_ENGINE_ONLY`) and point the workers at it with "
            "`CHAT_BACKEND=openai`. See [scaling.md](scaling.md).")
    engine_only: bool = _setting(
        "CHAT_ENGINE_ONLY", False, read.boolean,
        doc="Serve only the OpenAI-compatible `/v1` API with `/healthz`, `/readyz` and `/metrics`: no page, no "
            "`/ws`, no conversations API, and no database is opened. This is the one engine process per host "
            "that web workers reach with `CHAT_BACKEND=openai`. Per-address limits "
            "(`CHAT_MAX_ACTIVE_PER_IP`, `CHAT_RATE_LIMIT_PER_IP_PER_MIN` and the fair share) are off, since "
            "every request comes from a few web hosts that limit their users themselves; `CHAT_MAX_BATCH`, "
            "`CHAT_MAX_QUEUE` and `CHAT_API_KEY` still apply.")
    graceful_timeout_s: float = _setting(
        "CHAT_GRACEFUL_TIMEOUT_S", 20.0, float, low=0.0, high=3600,
        doc="On SIGTERM, running answers get this long, less a 3 s margin, to finish (gunicorn's "
            "`graceful_timeout`). The rest end with reason `shutdown`.")
    ping_interval_s: float = _setting(
        "CHAT_PING_INTERVAL_S", 25.0, float, low=0.0, high=3600,
        doc="WebSocket ping interval. It keeps idle connections open through proxies and detects dead peers. "
            "`0` turns pings off.")
    send_timeout_s: float = _setting(
        "CHAT_SEND_TIMEOUT_S", 30.0, float, low=0.0, high=3600,
        doc="A WebSocket whose client reads nothing for this long (one frame cannot be written) is dropped; "
            "its answers then follow the resume grace. `0`: wait forever.")
    body_timeout_s: float = _setting(
        "CHAT_BODY_TIMEOUT_S", 15.0, float, low=0.0, high=3600,
        doc="A request body (an import, a `/v1` request) must keep arriving: after this many seconds of "
            "silence, or when it averages under 16 KiB/s once this much time has passed, the request gets 408 "
            "and its connection is closed. `0`: wait forever (nginx in front already reads whole bodies).")
    header_timeout_s: float = _setting(
        "CHAT_HEADER_TIMEOUT_S", 10.0, float, low=0.5, high=3600,
        doc="A new connection must send its request line and headers within this many seconds, or it is "
            "closed (an idle or trickling socket cannot hold a worker's connection). Between the requests "
            "of a kept-alive connection the wait is 75 s.")
    worker_connections: int = _setting(
        "CHAT_WORKER_CONNECTIONS", 1000, int, low=16, high=100_000,
        doc="Connections one worker holds at once, WebSockets included; more wait in the listen queue. "
            "The process's open-files limit (`ulimit -n`) must exceed it (a warning at start says when "
            "not). Without a proxy in front, one address holds at most `CHAT_MAX_CONNECTIONS_PER_IP` of "
            "them.")
    max_message_bytes: int = _setting(
        "CHAT_MAX_MESSAGE_BYTES", 256 * 1024, int, low=1024, high=64 * 1024 * 1024,
        doc="Largest WebSocket message the server accepts (256 KiB). A larger one closes the connection with "
            "code 1009.")
    control_socket: str = _setting(
        "CHAT_CONTROL_SOCKET", "", str,
        doc="A path for gunicorn's control socket (for `gunicornc -s PATH`), one per instance. Empty: none "
            "(gunicorn's default path is shared by every instance of a user, and deleted by the first to stop).")
    log_level: str = _setting(
        "CHAT_LOG_LEVEL", "info", read.choice("debug", "info", "warning", "error"),
        doc="`debug`, `info`, `warning` or `error`, for the app and for gunicorn.")

    allowed_origins: tuple = _setting(
        "CHAT_ALLOWED_ORIGINS", (), read.origins, section="Security",
        doc="Extra browser origins allowed to open `/ws`, comma-separated (for example "
            "`https://app.example.com`). The page's own origin is always allowed, and `*` allows any origin.")
    allowed_hosts: tuple = _setting(
        "CHAT_ALLOWED_HOSTS", (), read.hosts,
        doc="Host names this server answers to, comma-separated (`chat.example.com`, `*.example.com`, `*` for "
            "any). Always allowed: IP addresses, `localhost` and `*.localhost`, `CHAT_BIND`'s host and the hosts "
            "of `CHAT_ALLOWED_ORIGINS`. Any other `Host` (or trusted `X-Forwarded-Host`) gets 403, page, API and "
            "WebSocket alike: a page on another site cannot reach a server on 127.0.0.1 by rebinding its own name "
            "to that address. Behind nginx, list the `server_name` here.")
    api_key: str = _setting(
        "CHAT_API_KEY", "", str,
        doc="When set, it is required on `/v1` and on WebSocket connections that lack the page's cookie. It "
            "also signs the page's identity cookie. Programs holding it get identities of their own. See "
            "[security.md](security.md).")
    trusted_proxies: int = _setting(
        "CHAT_TRUSTED_PROXIES", 0, int, low=0, high=16,
        doc="How many reverse proxies in front are trusted for `X-Forwarded-For`, `-Proto` and `-Host`. Set "
            "`1` behind the example nginx. `0` ignores these headers, and the first request that carries "
            "`X-Forwarded-For` logs a warning.")
    rate_limit_per_min: int = _setting(
        "CHAT_RATE_LIMIT_PER_MIN", 60, int, low=0, high=1_000_000,
        doc="Chat and regenerate requests per client per minute (bursts up to the same number). Connections "
            "without a cookie share one such budget per address. `0`: unlimited.")
    rate_limit_per_ip_per_min: int = _setting(
        "CHAT_RATE_LIMIT_PER_IP_PER_MIN", 120, int, low=0, high=1_000_000,
        doc="Requests per client address (IPv6: per /64) per minute, WebSocket and `/v1` completions "
            "together, however many identities the address uses. Raise it when many users share one "
            "address. `0`: unlimited.")
    max_connections_per_ip: int = _setting(
        "CHAT_MAX_CONNECTIONS_PER_IP", 32, int, low=0, high=100_000,
        doc="Open connections per client address (IPv6: per /64). WebSockets are counted per address "
            "whatever the proxy (429 at the handshake). Without a proxy (`CHAT_TRUSTED_PROXIES=0`) every TCP "
            "connection to a worker counts too, plain HTTP and WebSocket together: one more gets 429 and is "
            "closed before its request is read. `0`: unlimited.")
    log_content: bool = _setting(
        "CHAT_LOG_CONTENT", False, read.boolean,
        doc="When on, each answer's log line also contains the text: the user's message and the answer.")
    titles: bool = _setting(
        "CHAT_TITLES", True, read.boolean,
        doc="When on, the model writes a short title (2 to 6 words, in the chat's language) for each new "
            "conversation after its first answer: a greedy generation of at most 20 tokens and 15 s, after "
            "the answer's `done`, never delaying it, and in the background: the engine starts it only while no "
            "other answer decodes or waits, so it never slows one (on a server busy for all of those 15 s the "
            "first words stay); the first words of the first message are the title "
            "until then, and the page hears the new one in a `title` frame. That title is the "
            "conversation's one title whatever version of the first message is shown; a title the user "
            "sets always wins. Off: the first message's first words are the title, and editing the first "
            "message renames the conversation (unless its user named it).")
    starters: str = _setting(
        "CHAT_STARTERS", "Explain how rainbows form, in three short sentences.|Write a short poem about the sea."
        "|Give me three ideas for a quick weeknight dinner.|Translate “Good morning, how are you?” into French.",
        str, doc="The starter prompts a new chat offers on its empty screen, separated by `|` (at most 8, each "
                 "at most 200 characters; a click sends it). Empty: none. The defaults are short tasks a small "
                 "model does well.")
    max_document_mb: int = _setting(
        "CHAT_MAX_DOCUMENT_MB", 10, int, low=1, high=15,
        doc="Largest document (PDF, DOCX, HTML, CSV) the page may attach, in MB. Each is read to text by a "
            "process of its own (at most 1 GiB of memory, 20 s, the first 300 pages of a PDF; two at once "
            "per worker), and its text counts against `CHAT_MAX_CONTENT_CHARS` like any attachment. nginx's "
            "`client_max_body_size` for `/api/documents` must allow it (deploy/nginx.conf: 11m).")
    trash_days: float = _setting(
        "CHAT_TRASH_DAYS", 30.0, float, low=0.0, high=3650,
        doc="How long a deleted conversation waits in the trash, restorable (the page's **Undo** and its "
            "**Trash** view), before it is deleted for good with its messages. In the trash it is found by "
            "nothing else: not opened, searched, answered or shown by its share link. `0`: deleting "
            "deletes at once.")
    sharing: bool = _setting(
        "CHAT_SHARING", False, read.boolean,
        doc="When on, a conversation's owner may make a read-only link to it (`/s/<token>`, from the page's "
            "**⋯ → Share link**), which anyone holding the link can read until the owner revokes it. The "
            "link shows that one conversation's current version and nothing else. Off: no links are "
            "made and existing ones stop working.")

    state_url: str = _setting(
        "CHAT_STATE_URL", "", read.state_url, section="Scaling out",
        doc="Redis for state every worker and host shares, for example `redis://127.0.0.1:6379/0`: running "
            "answers and their event streams (so `resume` and `cancel` work on any worker), busy "
            "conversations, rate limits and per-address counts. Empty: all of it in this process, which is "
            "right for one worker. See [scaling.md](scaling.md).")

    backend: str = _setting(
        "CHAT_BACKEND", "local", read.choice("local", "openai"), section="Remote backend",
        doc="`local` runs the model in this process. `openai` loads no model and sends every generation to an "
            "OpenAI-compatible server.")
    backend_url: str = _setting(
        "CHAT_BACKEND_URL", "", str,
        doc="The backend's base URL including `/v1`, for example `http://host:8000/v1`. Required with "
            "`CHAT_BACKEND=openai`.")
    backend_api_key: str = _setting(
        "CHAT_BACKEND_API_KEY", "", str,
        doc="Sent to the backend as `Authorization: Bearer`.")
    backend_model: str = _setting(
        "CHAT_BACKEND_MODEL", "", str,
        doc="Model name sent to the backend. Empty: the first model its `/v1/models` lists.")
    backend_models: str = _setting(
        "CHAT_BACKEND_MODELS", "", str,
        doc="Which of the backend's models users may pick (on the page, and as `/v1` `model`): "
            "comma-separated names, `*` and `?` as wildcards, for example `qwen*,llama3.2:3b`. Empty: every "
            "model its `/v1/models` lists. The default model (`CHAT_BACKEND_MODEL`) is always offered.")
    backend_timeout_s: float = _setting(
        "CHAT_BACKEND_TIMEOUT_S", 60.0, float, low=0.1, high=3600,
        doc="Network timeout for the backend: connecting, and the longest silence while streaming.")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides) -> "Settings":
        """Read every ``CHAT_*`` variable; a bad value raises ConfigError naming it."""
        environ = os.environ if environ is None else environ
        values = {}
        for f in dataclasses.fields(cls):
            meta = f.metadata
            raw = environ.get(meta["env"])
            if raw is None:
                continue
            try:
                value = meta["parse"](raw)
            except ValueError as exc:
                raise ConfigError(f"{meta['env']}={raw!r} is invalid: {exc}") from None
            if meta["low"] is not None and value < meta["low"]:
                raise ConfigError(f"{meta['env']}={raw!r} is invalid: must be >= {meta['low']}")
            if meta["high"] is not None and value > meta["high"]:
                raise ConfigError(f"{meta['env']}={raw!r} is invalid: must be <= {meta['high']}")
            values[f.name] = value
        values.update(overrides)
        settings = cls(**values)
        settings.check()
        return settings

    def check(self) -> None:
        """Cross-field checks that a single variable's parser cannot make."""
        if self.max_messages == 1:
            raise ConfigError("CHAT_MAX_MESSAGES=1 is invalid: a question and its answer need 2")
        if self.backend == "openai" and not self.backend_url:
            raise ConfigError("CHAT_BACKEND=openai needs CHAT_BACKEND_URL")

    def replace(self, **changes) -> "Settings":
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    @property
    def db_path(self) -> str:
        return self.db or str(Path(self.data_dir) / "chat.db")

    @property
    def model_cache_dir(self) -> str:
        return self.cache_dir or str(Path(self.data_dir) / "model-cache")
