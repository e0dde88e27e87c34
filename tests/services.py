"""Real services for tests, started in a temporary folder on free local ports: nginx from a deploy/ site.

    port, stop = start_nginx(ROOT / "deploy" / "nginx-scaleout.conf", [8001, 8002], tmp_path)

The site's ``upstream`` servers are replaced by the given ports (or ``host:port`` strings), keeping
the first server line's parameters (``max_fails=...``); ``listen 80`` becomes the free port and
``/srv/chat/`` this checkout.
"""
from __future__ import annotations

import http.client
import os
import re
import socket
import subprocess
import time
from pathlib import Path

from helpers import free_port

ROOT = Path(__file__).resolve().parent.parent
NGINX = os.environ.get("NGINX", "/usr/sbin/nginx")

MAIN_CONF = """\
{user}
worker_processes 1;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log info;
events {{ worker_connections 256; }}
http {{
    include {mime};
    default_type application/octet-stream;
    access_log {tmp}/access.log;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    include {tmp}/site.conf;
}}
"""
_UPSTREAM = re.compile(r"(upstream\s+\w+\s*\{)(.*?)(\n\})", re.S)
_SERVER = re.compile(r"^([ \t]*)server[ \t]+[^\s;]+([^;\n]*);[^\n]*\n", re.M)


def _address(upstream) -> str:
    return f"127.0.0.1:{upstream}" if isinstance(upstream, int) else upstream


def render_site(conf_path: Path, upstreams: list, port: int) -> str:
    """The site at ``conf_path`` with ``upstreams``, listening on 127.0.0.1:``port``, static from here."""
    text = Path(conf_path).read_text()
    for placeholder in ("listen 80;", "/srv/chat/"):
        assert placeholder in text, f"{conf_path} no longer contains {placeholder!r}"
    block = _UPSTREAM.search(text)
    assert block, f"{conf_path} has no upstream block"
    servers = list(_SERVER.finditer(block.group(2)))
    assert servers, f"{conf_path}'s upstream lists no server"
    indent, params = servers[0].group(1), servers[0].group(2)
    listed = "".join(f"{indent}server {_address(u)}{params};\n" for u in upstreams)
    body = _SERVER.sub("", block.group(2))
    body = body[:servers[0].start()] + listed + body[servers[0].start():]
    text = text[:block.start(2)] + body + text[block.end(2):]
    text = text.replace("listen 80;", f"listen 127.0.0.1:{port};").replace("listen [::]:80;", "")
    return text.replace("/srv/chat/", f"{ROOT}/")


class Nginx:
    """A real nginx serving the site ``conf_path`` in front of ``upstreams``; ``nginx -t`` checked first."""

    def __init__(self, tmp: Path, conf_path: Path, upstreams: list):
        assert os.path.exists(NGINX), (f"nginx is not installed at {NGINX} (apt-get install nginx-light, "
                                       "or set NGINX=/path/to/nginx); these tests need a real one")
        self.tmp = Path(tmp)
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ws_url = f"ws://127.0.0.1:{self.port}/ws"
        (self.tmp / "site.conf").write_text(render_site(conf_path, upstreams, self.port))
        mime = "/etc/nginx/mime.types" if os.path.exists("/etc/nginx/mime.types") else "mime.types"
        # As root, nginx's workers default to user "nobody", who may not read the checkout.
        user = "user root;" if os.geteuid() == 0 else ""
        conf = self.tmp / "nginx.conf"
        conf.write_text(MAIN_CONF.format(tmp=self.tmp, mime=mime, user=user))
        check = subprocess.run([NGINX, "-t", "-p", str(self.tmp), "-c", str(conf)], capture_output=True, text=True)
        assert check.returncode == 0, f"nginx -t rejected the config:\n{check.stderr}"
        self.proc = subprocess.Popen([NGINX, "-p", str(self.tmp), "-c", str(conf), "-g", "daemon off;"],
                                     stderr=open(self.tmp / "stderr.log", "wb"))
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                break
            except OSError:
                assert self.proc.poll() is None, f"nginx exited: {self.log()}"
                assert time.monotonic() < deadline, f"nginx did not start listening: {self.log()}"
                time.sleep(0.05)

    def log(self) -> str:
        return "".join((self.tmp / name).read_text(errors="replace")
                       for name in ("stderr.log", "error.log") if (self.tmp / name).exists())

    def request(self, method: str, path: str, body=None, headers=None) -> http.client.HTTPResponse:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        conn.request(method, path, body=body, headers=headers or {})
        return conn.getresponse()

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_nginx(conf_path: Path, upstream_ports: list, tmpdir: Path):
    """Start nginx with the site ``conf_path`` in front of ``upstream_ports``; returns (port, stop)."""
    proxy = Nginx(tmpdir, conf_path, upstream_ports)
    return proxy.port, proxy.stop
