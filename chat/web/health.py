"""Health, readiness and metrics endpoints."""
from __future__ import annotations

from flask import Blueprint, Response, jsonify
from flask.typing import ResponseReturnValue

from ..app_state import app_state
from ..metrics import CONTENT_TYPE_LATEST

bp = Blueprint("api", __name__)


@bp.get("/healthz")
def healthz() -> ResponseReturnValue:
    """Liveness: the event loop answers (200 always); ``model`` says what /readyz would, without a 503,
    so a page can follow a loading model without failed requests in its console."""
    state = app_state()
    engine = state.engine
    model = "draining" if state.stopping else "ready" if engine.ready else "failed" if engine.error else "loading"
    body: dict[str, object] = {"status": "ok", "model": model}
    if model == "ready":
        body["name"] = engine.model_name
        if engine.thinks():  # a page that connected while the model loaded learns it here
            body["thinking"] = True
    return jsonify(body)


@bp.get("/readyz")
def readyz() -> ResponseReturnValue:
    """200 once the model is loaded and warmed up, else 503."""
    engine = app_state().engine
    if engine.ready:
        ready: dict[str, object] = {"status": "ready", "model": engine.model_name}
        ready.update(engine.describe())  # the local model's weights, CPU class, decode step, ...
        return jsonify(ready)
    if engine.error:  # the reason (paths, backend URL) is in the server log, not for anyone who asks
        return jsonify({"status": "failed"}), 503
    loading: dict[str, object] = {"status": "loading"}
    if engine.loading:  # a long step under way (a GGUF converted once): how far it is
        loading["progress"] = engine.loading
    return jsonify(loading), 503


@bp.get("/metrics")
def metrics() -> Response:
    """Prometheus text format."""
    return Response(app_state().metrics.render(), mimetype=CONTENT_TYPE_LATEST)
