"""The limits registry: per client and per address, IPv6 by /64, answers counted to their end, fair share."""
import pytest

from chat.config import Settings
from chat.engine import Generation, GenParams
from chat.engine.events import Done, Refused, Started
from chat.errors import ProtocolError
from chat.limits import address_of
from chat.state.local_limits import LocalLimits as Limits

A, B = "198.51.100.7", "203.0.113.9"


def limits(**settings) -> Limits:
    base = {"rate_limit_per_min": 0, "rate_limit_per_ip_per_min": 0, "max_active_per_connection": 100,
            "max_active_per_ip": 0, "max_batch": 8}
    return Limits(Settings(**{**base, **settings}))


def refused(reg, address, client=None) -> str:
    with pytest.raises(ProtocolError) as exc:
        reg.admit(address, client, "r")
    assert exc.value.id == "r"
    return exc.value.code


def tracked(reg, address, client=None) -> Generation:
    gen = Generation(messages=[], params=GenParams())
    reg.track(reg.admit(address, client), gen)
    return gen


@pytest.mark.parametrize("ip,address", [
    ("192.0.2.1", "192.0.2.1"),
    ("2001:db8:1:2:aaaa::1", "2001:db8:1:2::/64"),
    ("2001:db8:1:2:bbbb:cccc:dddd:eeee", "2001:db8:1:2::/64"),
    ("::ffff:192.0.2.1", "192.0.2.1"),
    ("?", "?"),
])
def test_addresses_group_ipv6_by_64(ip, address):
    assert address_of(ip) == address


def test_fresh_identities_share_their_address_rate():
    reg = limits(rate_limit_per_min=3, rate_limit_per_ip_per_min=5)
    for i in range(3):  # three reconnects without a cookie: one budget
        reg.admit(A, f"anon:conn{i}").release()
    assert refused(reg, A, "anon:conn3") == "rate_limited"
    reg.admit(A, "cookie-one-0123456789").release()
    reg.admit(A, "cookie-two-0123456789").release()
    assert refused(reg, A, "cookie-three-012345678") == "rate_limited"  # new cookies: address budget
    reg.admit(B, "anon:elsewhere").release()  # another address is untouched


def test_answers_count_until_the_engine_ends_them():
    reg = limits(max_active_per_connection=2, max_active_per_ip=3)
    first, second = tracked(reg, A, "alice-0123456789abcd"), tracked(reg, A, "alice-0123456789abcd")
    assert refused(reg, A, "alice-0123456789abcd") == "busy"  # the client, across connections
    tracked(reg, A, "bob-0123456789abcdefg")
    assert refused(reg, A, "carol-0123456789abcde") == "busy"  # the address, across clients
    assert refused(reg, A) == "busy"  # /v1 from the same address
    first.emit(Started())
    first.emit(Done("stop"))
    tracked(reg, A, "alice-0123456789abcd")
    second.emit(Refused("too_large", "no"))
    assert reg.by_client == {"alice-0123456789abcd": 1, "bob-0123456789abcdefg": 1}


def test_events_emitted_before_tracking_still_count():
    reg = limits()
    gen = Generation(messages=[], params=GenParams())
    ticket = reg.admit(A)
    gen.emit(Started())
    gen.emit(Done("stop"))
    reg.track(ticket, gen)
    assert ticket.released and reg.by_address == {} and reg.waiting == {}


def test_connections_per_address():
    reg = limits(max_connections_per_ip=2)
    for _ in range(2):
        assert reg.connection_allowed("2001:db8::1")
        reg.connect(address_of("2001:db8::1"))
    assert not reg.connection_allowed(address_of("2001:db8::ffff"))  # same /64
    reg.disconnect(address_of("2001:db8::1"))
    assert reg.connection_allowed(address_of("2001:db8::2"))


def test_fair_share_while_others_wait():
    reg = limits(max_batch=4)
    hog = [tracked(reg, A, f"hog-{i}-0123456789abc") for i in range(4)]
    for gen in hog:
        gen.emit(Started())
    tracked(reg, A, "hog-4-0123456789abc")  # nobody else waits: the queue is open to it
    waiting = tracked(reg, B, "guest-0123456789abcd")  # queued behind the hog
    assert reg.fair_share() == 2
    assert refused(reg, A, "hog-5-0123456789abc") == "overloaded"
    waiting.emit(Started())  # the guest got its slot: the hog may queue again
    tracked(reg, A, "hog-5-0123456789abc")
