"""Which chat template a model speaks: its own, a Jinja file, or a built-in (``CHAT_TEMPLATE``).

A base model (no template of its own) still starts: raw prompts (``/v1/completions``) need none, and chat
falls back to ChatML, whose markers such a model reads as plain text; its answers are then cut at the next
marker it writes (``stops``). What was chosen is reported on ``/readyz`` (``template``, ``base_model``).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import ConfigError

# ChatML: the template Qwen and SmolLM use, written out (Jinja as transformers renders it).
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% endif %}")
BUILT_IN = {"chatml": (CHATML, ("<|im_end|>", "<|im_start|>"))}


@dataclass(frozen=True)
class Template:
    name: str  # what /readyz reports: "model" (its own), "chatml", "file <path>"
    base_model: bool  # the model brought no template of its own
    stops: tuple[str, ...] = ()  # text that ends an answer besides the model's end token (a built-in's markers)


def choose(tokenizer: Any, setting: str) -> Template:
    """Give ``tokenizer`` the template ``CHAT_TEMPLATE`` names: ``auto`` its own, else ChatML; ``chatml`` (a
    built-in) or a Jinja file's path in place of its own."""
    base = not getattr(tokenizer, "chat_template", None)
    if setting == "auto" and not base:
        return Template("model", False)
    if setting in ("auto", *BUILT_IN):
        name = "chatml" if setting == "auto" else setting
        tokenizer.chat_template, stops = BUILT_IN[name]
        return Template(name, base, stops)
    path = Path(setting).expanduser()
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"CHAT_TEMPLATE={setting!r}: not a built-in ({', '.join(BUILT_IN)}) nor a readable "
                          f"Jinja file ({exc})") from None
    if not text.strip():
        raise ConfigError(f"CHAT_TEMPLATE={setting!r}: the file is empty")
    tokenizer.chat_template = text
    return Template(f"file {path}", base)
