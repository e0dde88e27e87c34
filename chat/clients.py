"""Client ids as every layer sees them: opaque strings, in namespaces the web layer hands out."""
from __future__ import annotations

ANONYMOUS = "anon:"  # a connection without a cookie; ':' never occurs in a cookie id
KEY_HOLDER = "key:"  # programs that proved the API key name identities in their own namespace
