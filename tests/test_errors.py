"""Errors are converted once, at the edge: JSON on the API routes (404 and 500 included), pages untouched."""
import pytest
from fakes import FakeEngine

from chat import create_app
from chat.config import Settings
from chat.errors import PROTOCOL_STATUS, ChatError, EngineError, Overloaded, PromptTooLong, ProtocolError
from chat.store import Store


@pytest.fixture
def client(tmp_path):
    app = create_app(Settings(data_dir=str(tmp_path)), engine=FakeEngine(), store=Store(":memory:"))

    def boom():
        raise RuntimeError("a bug")

    for rule in ("/api/boom", "/v1/boom", "/boom"):
        app.add_url_rule(rule, rule, boom)
    return app.test_client()


@pytest.mark.parametrize("path, status, code", [
    ("/api/nope", 404, "not_found"), ("/api/boom", 500, "internal"),
    ("/v1/nope", 404, "not_found"), ("/v1/boom", 500, "internal"),
])
def test_api_errors_are_json(client, path, status, code):
    response = client.get(path)
    assert response.status_code == status and response.is_json
    error = response.get_json()["error"]
    assert error["code"] == code and error["message"]
    if path.startswith("/v1"):
        assert error["type"] in ("not_found_error", "server_error") and "param" in error


@pytest.mark.parametrize("path, status", [("/nope", 404), ("/boom", 500)])
def test_page_errors_stay_html(client, path, status):
    response = client.get(path)
    assert response.status_code == status and response.mimetype == "text/html"


def test_protocol_errors_carry_only_protocol_codes():
    assert ProtocolError("busy", "x").status == 409
    with pytest.raises(ValueError):
        ProtocolError("invalid_api_key", "not a protocol code")


@pytest.mark.parametrize("error, code, status", [
    (Overloaded("full"), "overloaded", 503), (PromptTooLong("long"), "too_large", 413),
])
def test_engine_errors_use_protocol_codes(error, code, status):
    assert isinstance(error, EngineError) and isinstance(error, ChatError)
    assert (error.code, error.status) == (code, status) == (code, PROTOCOL_STATUS[code])
