"""Whether the writer of a 'streaming' answer may still be at work: the default, local check."""
from __future__ import annotations

import os
import socket

# Tokens of the Stores open in this process (see Store._owner).
open_stores: set[str] = set()


def owner_of(token: str) -> str:
    """The owner tag a Store writes on the answers it streams: host:pid:token."""
    return f"{socket.gethostname()}:{os.getpid()}:{token}"


def local_alive(owner: str | None, other_hosts: bool = False) -> bool:
    """Whether the Store that started a streaming answer may still be writing it: open in this
    process, or in another live process on this host (a sibling gunicorn worker). An owner on
    another host cannot be checked from here: ``other_hosts`` is returned for it (True for a
    shared database, where that host may well be alive; False for a local file, whose other
    host names can only be this machine's old ones)."""
    host, pid, token = ((owner or "").rsplit(":", 2) + ["", ""])[:3]
    if not pid.isdigit():
        return False
    if host != socket.gethostname():
        return other_hosts
    if int(pid) == os.getpid():
        return token in open_stores
    try:
        os.kill(int(pid), 0)
    except PermissionError:
        return True
    except OSError:
        return False
    try:  # a killed worker whose parent died too may linger as a zombie nobody reaps
        with open(f"/proc/{int(pid)}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True
