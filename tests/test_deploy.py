"""deploy/compose.yaml and deploy/systemd/: the scale-out wiring, checked without Docker or systemd.

Docker cannot run here, so the compose file is parsed as YAML and its wiring checked; every
service's environment and every environment file must pass the server's own Settings check.
"""
from __future__ import annotations

import configparser
import json
import re
from pathlib import Path

import pytest
import yaml

from chat.config import Settings

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
WEB_HOSTS = ("web1", "web2")
RUN = "gunicorn -c gunicorn.conf.py wsgi:app"  # what `make run` runs


def _expand(value: str) -> str:
    """Compose's ${NAME:-default} / ${NAME:?error} / ${NAME}, with a stand-in where no default is given."""
    def one(match):
        name, op, arg = match.group(1), match.group(2), match.group(3)
        return arg if op == ":-" else f"test-{name.lower()}"
    return re.sub(r"\$\{(\w+)(?:(:[-?])([^}]*))?\}", one, str(value))


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def env_of(compose: dict, service: str) -> dict:
    return {k: _expand(v) for k, v in compose["services"][service]["environment"].items()}


def settings_of(env: dict) -> Settings:
    return Settings.from_env(env)  # raises ConfigError on any invalid value


def test_compose_has_the_topology(compose):
    assert set(compose["services"]) == {"engine", *WEB_HOSTS, "redis", "postgres", "nginx"}


@pytest.mark.parametrize("web", WEB_HOSTS)
def test_each_web_host_is_wired_to_the_shared_parts(compose, web):
    env = env_of(compose, web)
    assert env["CHAT_STATE_URL"].startswith("redis://redis:")
    assert env["CHAT_DB"].startswith("postgresql://") and "@postgres:" in env["CHAT_DB"]
    engine = settings_of(env_of(compose, "engine"))
    engine_port = engine.bind.rpartition(":")[2]
    assert env["CHAT_BACKEND"] == "openai"
    assert env["CHAT_BACKEND_URL"] == f"http://engine:{engine_port}/v1"
    assert env["CHAT_BACKEND_API_KEY"] == env_of(compose, "engine")["CHAT_API_KEY"]
    settings = settings_of(env)
    assert settings.trusted_proxies == 1 and not settings.engine_only
    assert set(compose["services"][web]["depends_on"]) == {"engine", "redis", "postgres"}


def test_web_hosts_share_one_cookie_key(compose):
    keys = {env_of(compose, web)["CHAT_API_KEY"] for web in WEB_HOSTS}
    assert len(keys) == 1 and keys != {""}


def test_the_engine_serves_only_v1_from_one_model_copy(compose):
    engine = settings_of(env_of(compose, "engine"))
    assert engine.engine_only and engine.workers == 1 and engine.backend == "local"


def _upstream_calls(settings: Settings) -> int:
    """The most concurrent calls one web process makes upstream (RemoteEngine's cap)."""
    return settings.workers * (settings.max_batch + settings.max_queue)


def test_the_engine_queue_holds_what_the_web_tier_may_send(compose):
    engine = settings_of(env_of(compose, "engine"))
    sent = sum(_upstream_calls(settings_of(env_of(compose, web))) for web in WEB_HOSTS)
    assert engine.max_batch + engine.max_queue >= sent


def test_nginx_lists_both_web_hosts(compose):
    nginx = compose["services"]["nginx"]
    site = next(v.split(":")[0] for v in nginx["volumes"] if v.endswith(":/etc/nginx/conf.d/default.conf:ro"))
    text = (DEPLOY / site).read_text()
    upstream = re.search(r"upstream chat \{(.*?)\}", re.sub(r"#[^\n]*", "", text), re.S).group(1)
    listed = re.findall(r"server\s+([\w.-]+):(\d+)", upstream)
    ports = {web: settings_of(env_of(compose, web)).bind.rpartition(":")[2] for web in WEB_HOSTS}
    assert sorted(listed) == sorted(ports.items())
    assert set(nginx["depends_on"]) == set(WEB_HOSTS)
    assert any(v.startswith("../static:/srv/chat/static") for v in nginx["volumes"])


def test_the_image_runs_what_make_run_runs():
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert "make install" in dockerfile and '"wsgi:app"' in dockerfile
    assert " ".join(json.loads(re.search(r"^CMD (.*)$", dockerfile, re.M).group(1))).endswith(RUN)
    assert RUN in (ROOT / "Makefile").read_text()


# ---- systemd

def unit(name: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str
    parser.read(DEPLOY / "systemd" / name)
    return parser


def env_file(name: str) -> dict:
    lines = (DEPLOY / "systemd" / name).read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line.strip() and not line.startswith("#"))


@pytest.mark.parametrize("name,env", [("chat-engine.service", "engine.env"), ("chat-web.service", "web.env")])
def test_units_run_gunicorn_with_their_environment_file(name, env):
    service = unit(name)["Service"]
    assert service["ExecStart"].endswith(RUN) and service["WorkingDirectory"] == "/srv/chat"
    assert service["EnvironmentFile"] == f"/etc/chat/{env}"
    assert service["KillMode"] == "mixed"  # SIGTERM to the master: answers finish
    stop_s = int(service["TimeoutStopSec"])
    assert stop_s > settings_of(env_file(env)).graceful_timeout_s


def test_environment_files_describe_the_topology():
    engine, web = settings_of(env_file("engine.env")), settings_of(env_file("web.env"))
    assert engine.engine_only and engine.workers == 1
    raw = env_file("web.env")
    assert web.backend == "openai" and raw["CHAT_BACKEND_URL"].endswith(f":{engine.bind.rpartition(':')[2]}/v1")
    assert raw["CHAT_BACKEND_API_KEY"] == engine.api_key
    assert raw["CHAT_STATE_URL"].startswith("redis://") and raw["CHAT_DB"].startswith("postgresql://")
    assert engine.max_batch + engine.max_queue >= 2 * _upstream_calls(web)  # the two web hosts of the example
