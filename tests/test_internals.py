"""The private parts of simple-websocket, wsproto and gevent the transport leans on are all still
there in the installed versions; a new version that moves one fails here, naming the library."""
from __future__ import annotations

from chat.web import internals


def test_every_private_part_the_transport_leans_on_is_there():
    missing = internals.problems()
    assert not missing, ("a library changed what the transport leans on (chat/web/internals.py); adapt the "
                         "code or keep requirements.txt's bound:\n" + "\n".join(missing))


def test_a_moved_part_is_reported_with_its_library(monkeypatch):
    monkeypatch.setattr(internals, "LEANS_ON", internals.LEANS_ON + (
        ("simple-websocket", "simple_websocket.ws:Base", "_gone_in_a_new_version"),
        ("gevent", "gevent._socket3:socket.__init__", "self._renamed"),
        ("wsproto", "wsproto.no_such_module:X", "y")))
    found = internals.problems()
    assert len(found) == 3
    assert found[0].startswith("simple-websocket ") and "_gone_in_a_new_version" in found[0]
    assert found[1].startswith("gevent ") and "self._renamed" in found[1]
    assert found[2].startswith("wsproto ") and "ModuleNotFoundError" in found[2]


def test_the_accessors_read_what_the_libraries_hold():
    import gevent.socket
    import wsproto
    from wsproto import ConnectionType
    sock = gevent.socket.socket()
    try:
        assert internals.gevent_socket(sock) is not None and internals.gevent_socket(object()) is None
    finally:
        sock.close()
    from wsproto.connection import Connection
    assert internals.frame_protocol(Connection(ConnectionType.SERVER)).extensions == []
    assert internals.frame_protocol(wsproto.WSConnection(ConnectionType.SERVER).connection) is None  # no handshake



def test_no_other_web_module_touches_a_private_part():
    """What the transport leans on is reached through chat/web/internals.py only: no other module of the web
    layer names one of the libraries' private members (a method it overrides or an attribute it reads)."""
    import re
    from pathlib import Path
    private = {what.removeprefix("self.") for _, _, what in internals.LEANS_ON}
    private = {name for name in private if name.startswith("_")}
    assert {"_thread", "_handle_events", "_proto", "_sock"} <= private
    pattern = re.compile(r"\b(?:def |\.)(" + "|".join(map(re.escape, sorted(private))) + r")\b")
    web = Path(internals.__file__).parent
    found = {p.name: pattern.findall(p.read_text()) for p in web.glob("*.py") if p.name != "internals.py"}
    assert {name: uses for name, uses in found.items() if uses} == {}
