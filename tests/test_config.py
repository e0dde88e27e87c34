"""Settings from CHAT_* variables: defaults, parsing, and errors that name the variable."""
from __future__ import annotations

import dataclasses
import re
import subprocess

import pytest
from helpers import GUNICORN, ROOT

from chat import docs
from chat.config import Settings
from chat.errors import ConfigError

CLIENT_VARIABLES = {"CHAT_URL", "CHAT_CLIENT_ID"}  # read by python -m chat.client, not by the server


def test_defaults():
    s = Settings.from_env({})
    assert (s.temperature, s.top_p, s.dtype, s.bind, s.workers) == (0.7, 0.9, "auto", "127.0.0.1:8000", 1)


def test_values_are_parsed():
    s = Settings.from_env({"CHAT_MAX_NEW_TOKENS": "64", "CHAT_TEMPERATURE": "0", "CHAT_LOG_CONTENT": "yes",
                           "CHAT_ALLOWED_ORIGINS": "https://a.example, https://b.example/"})
    assert (s.max_new_tokens, s.temperature, s.log_content) == (64, 0.0, True)
    assert s.allowed_origins == ("https://a.example", "https://b.example")


@pytest.mark.parametrize("name,value", [
    ("CHAT_MAX_NEW_TOKENS", "lots"), ("CHAT_MAX_NEW_TOKENS", "0"), ("CHAT_TEMPERATURE", "3"),
    ("CHAT_TOP_P", "0"), ("CHAT_DTYPE", "float16"), ("CHAT_BIND", "nowhere"), ("CHAT_LOG_CONTENT", "maybe"),
    ("CHAT_BACKEND", "magic"),
])
def test_bad_values_name_the_variable(name, value):
    with pytest.raises(ConfigError, match=name):
        Settings.from_env({name: value})


def test_remote_backend_needs_a_url():
    with pytest.raises(ConfigError, match="CHAT_BACKEND_URL"):
        Settings.from_env({"CHAT_BACKEND": "openai"})


def test_gunicorn_refuses_to_start_with_a_bad_setting():
    out = subprocess.run([GUNICORN, "-c", "gunicorn.conf.py", "--check-config",
                          "wsgi:app"], cwd=ROOT, env={"CHAT_WORKERS": "none", "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "CHAT_WORKERS" in out.stdout + out.stderr


def test_configuration_docs_are_generated_from_the_settings():
    assert docs.CONFIGURATION.read_text(encoding="utf-8") == docs.configuration(), \
        "docs/configuration.md is stale: run `make docs`"


def test_every_setting_is_documented():
    undocumented = [f.metadata["env"] for f in dataclasses.fields(Settings) if not f.metadata["doc"].strip()]
    assert undocumented == []


def test_the_docs_name_only_real_variables():
    known = {f.metadata["env"] for f in dataclasses.fields(Settings)} | CLIENT_VARIABLES
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        named = set(re.findall(r"\bCHAT_[A-Z0-9_]*[A-Z0-9]\b", path.read_text(encoding="utf-8")))
        assert named <= known, f"{path.name} names unknown variables: {sorted(named - known)}"
