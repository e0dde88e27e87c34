"""How a ``CHAT_*`` variable's text becomes a setting's value: the parsers ``config.Settings`` names (each raises
ValueError with what it expected)."""
from __future__ import annotations

from collections.abc import Callable


def boolean(raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("expected 1/0, true/false, yes/no or on/off")


def origins(raw: str) -> tuple[str, ...]:
    return tuple(o.strip().rstrip("/") for o in raw.split(",") if o.strip())


def hosts(raw: str) -> tuple[str, ...]:
    names = tuple(h.strip().lower().rstrip(".") for h in raw.split(",") if h.strip())
    for name in names:
        bare = name[2:] if name.startswith("*.") else name
        if name != "*" and (not bare or not all(c.isalnum() or c in "-._:[]" for c in bare)):
            raise ValueError(f"{name!r} is not a host name (expected names like chat.example.com, *.example.com or *)")
    return names


def choice(*allowed: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.strip().lower()
        if value not in allowed:
            raise ValueError(f"expected one of {', '.join(allowed)}")
        return value
    return parse


def mb_or_auto(raw: str) -> int:
    value = raw.strip().lower()
    return -1 if value == "auto" else int(value)


def bind(raw: str) -> str:
    host, sep, port = raw.strip().rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        if not raw.startswith("unix:"):
            raise ValueError("expected HOST:PORT or unix:PATH")
    return raw.strip()


def state_url(raw: str) -> str:
    value = raw.strip()
    if value and not value.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError("expected a redis://, rediss:// or unix:// URL")
    return value
