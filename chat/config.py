"""Settings, read once from ``CHAT_*`` environment variables into one typed object."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent


def _bool(raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("expected 1/0, true/false, yes/no or on/off")


def _origins(raw: str) -> tuple[str, ...]:
    return tuple(o.strip().rstrip("/") for o in raw.split(",") if o.strip())


def _choice(*allowed: str):
    def parse(raw: str) -> str:
        value = raw.strip().lower()
        if value not in allowed:
            raise ValueError(f"expected one of {', '.join(allowed)}")
        return value
    return parse


def _bind(raw: str) -> str:
    host, sep, port = raw.strip().rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        if not raw.startswith("unix:"):
            raise ValueError("expected HOST:PORT or unix:PATH")
    return raw.strip()


def _setting(env: str, default, parse=None, *, low=None, high=None, doc=""):
    """A dataclass field that knows its environment variable and how to parse it."""
    return field(default=default, metadata={
        "env": env, "parse": parse, "low": low, "high": high, "doc": doc})


@dataclass(frozen=True)
class Settings:
    """Every tunable of the server; ``Settings.from_env()`` reads ``CHAT_*``."""

    model: str = _setting("CHAT_MODEL", "", str,
                          doc="hub id, local folder or .gguf file; empty: the bundled SmolLM2-135M-Instruct")
    model_name: str = _setting("CHAT_MODEL_NAME", "", str, doc="display name; empty: derived from the model")
    dtype: str = _setting("CHAT_DTYPE", "auto", _choice("auto", "float32", "bfloat16"))
    device: str = _setting("CHAT_DEVICE", "auto", _choice("auto", "cpu", "cuda"))
    threads: int = _setting("CHAT_THREADS", 0, int, low=0, high=512, doc="torch threads; 0: all cores")
    cache_dir: str = _setting("CHAT_CACHE_DIR", "", str, doc="converted-weights cache; empty: <CHAT_DATA_DIR>/model-cache")
    data_dir: str = _setting("CHAT_DATA_DIR", str(ROOT / "data"), str)
    db: str = _setting("CHAT_DB", "", str, doc="SQLite file; empty: <data_dir>/chat.db")
    warmup: bool = _setting("CHAT_WARMUP", True, _bool)
    max_conversations: int = _setting("CHAT_MAX_CONVERSATIONS", 1000, int, low=0, high=10_000_000,
                                      doc="conversations kept per client; 0: unlimited")
    max_messages: int = _setting("CHAT_MAX_MESSAGES", 1000, int, low=0, high=10_000_000,
                                 doc="messages kept per conversation; 0: unlimited")
    db_max_mb: int = _setting("CHAT_DB_MAX_MB", 0, int, low=0, high=10_000_000,
                              doc="most the SQLite database may grow to; 0: until the disk is full")

    max_new_tokens: int = _setting("CHAT_MAX_NEW_TOKENS", 512, int, low=1, high=32768)
    context_tokens: int = _setting("CHAT_CONTEXT_TOKENS", 2048, int, low=64, high=1_000_000)
    generation_timeout_s: float = _setting("CHAT_GENERATION_TIMEOUT_S", 300.0, float, low=0.1, high=86400)
    system_prompt: str = _setting("CHAT_SYSTEM_PROMPT", "You are a helpful assistant.", str)
    temperature: float = _setting("CHAT_TEMPERATURE", 0.7, float, low=0.0, high=2.0)
    top_p: float = _setting("CHAT_TOP_P", 0.9, float, low=0.0001, high=1.0)
    max_content_chars: int = _setting("CHAT_MAX_CONTENT_CHARS", 16000, int, low=1, high=10_000_000)

    max_batch: int = _setting("CHAT_MAX_BATCH", 8, int, low=1, high=256)
    max_queue: int = _setting("CHAT_MAX_QUEUE", 64, int, low=0, high=100_000)
    kv_cache_mb: int = _setting("CHAT_KV_CACHE_MB", 512, int, low=0, high=1_000_000)
    max_active_per_connection: int = _setting("CHAT_MAX_ACTIVE_PER_CONNECTION", 4, int, low=1, high=1000)
    resume_grace_s: float = _setting("CHAT_RESUME_GRACE_S", 10.0, float, low=0.0, high=3600)

    allowed_origins: tuple = _setting("CHAT_ALLOWED_ORIGINS", (), _origins)
    bind: str = _setting("CHAT_BIND", "127.0.0.1:8000", _bind)
    workers: int = _setting("CHAT_WORKERS", 1, int, low=1, high=64)
    graceful_timeout_s: float = _setting("CHAT_GRACEFUL_TIMEOUT_S", 20.0, float, low=0.0, high=3600)
    ping_interval_s: float = _setting("CHAT_PING_INTERVAL_S", 25.0, float, low=0.0, high=3600)
    send_timeout_s: float = _setting("CHAT_SEND_TIMEOUT_S", 30.0, float, low=0.0, high=3600,
                                     doc="a socket whose client reads nothing for this long is dropped; 0: never")
    max_message_bytes: int = _setting("CHAT_MAX_MESSAGE_BYTES", 256 * 1024, int, low=1024, high=64 * 1024 * 1024)
    api_key: str = _setting("CHAT_API_KEY", "", str)
    trusted_proxies: int = _setting("CHAT_TRUSTED_PROXIES", 0, int, low=0, high=16)
    rate_limit_per_min: int = _setting("CHAT_RATE_LIMIT_PER_MIN", 60, int, low=0, high=1_000_000,
                                       doc="chat requests per client per minute; 0: unlimited")
    rate_limit_per_ip_per_min: int = _setting("CHAT_RATE_LIMIT_PER_IP_PER_MIN", 120, int, low=0, high=1_000_000,
                                              doc="chat requests per address (IPv6: per /64) per minute; 0: unlimited")
    max_connections_per_ip: int = _setting("CHAT_MAX_CONNECTIONS_PER_IP", 32, int, low=0, high=100_000,
                                           doc="0: unlimited")
    max_active_per_ip: int = _setting("CHAT_MAX_ACTIVE_PER_IP", 8, int, low=0, high=100_000,
                                      doc="answers running or queued per address; 0: unlimited")
    log_content: bool = _setting("CHAT_LOG_CONTENT", False, _bool)
    log_level: str = _setting("CHAT_LOG_LEVEL", "info", _choice("debug", "info", "warning", "error"))

    backend: str = _setting("CHAT_BACKEND", "local", _choice("local", "openai"))
    backend_url: str = _setting("CHAT_BACKEND_URL", "", str)
    backend_api_key: str = _setting("CHAT_BACKEND_API_KEY", "", str)
    backend_model: str = _setting("CHAT_BACKEND_MODEL", "", str)
    backend_timeout_s: float = _setting("CHAT_BACKEND_TIMEOUT_S", 60.0, float, low=0.1, high=3600)

    @classmethod
    def from_env(cls, environ=None, **overrides) -> "Settings":
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


def describe() -> list[tuple[str, str, str]]:
    """(variable, default, doc) rows for the README's configuration table."""
    return [(f.metadata["env"], repr(f.default), f.metadata["doc"]) for f in dataclasses.fields(Settings)]
