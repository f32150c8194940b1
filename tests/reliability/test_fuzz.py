"""Property-based fuzzing (schemathesis) of the gateway's and the engine's OpenAPI: no 5xx, OpenAI-shaped errors
(Anthropic-shaped on the Messages API's routes)."""

from __future__ import annotations

import httpx
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from gateway.app import create_app
from tests.helpers import engine_app, gateway_settings, serve

EXAMPLES = 25


def _fuzz(app, base_url: str, headers: dict[str, str] | None = None) -> int:
    schema = schemathesis.openapi.from_dict(app.openapi())
    calls = 0
    with requests.Session() as session:
        session.headers.update(headers or {})
        for result in schema.get_all_operations():
            operation = result.ok()
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

                @given(case=operation.as_strategy(generation_mode=mode))
                @settings(
                    max_examples=EXAMPLES,
                    deadline=None,
                    database=None,
                    derandomize=True,
                    suppress_health_check=list(HealthCheck),
                )
                def check(case):
                    nonlocal calls
                    response = case.call(base_url=base_url, session=session, timeout=120)
                    calls += 1
                    assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
                    if response.status_code >= 400 and case.path.startswith("/v1/messages"):  # Anthropic's shape
                        body = response.json()
                        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
                        assert body["error"]["message"]
                    elif response.status_code >= 400:
                        error = response.json()["error"]
                        assert set(error) == {"message", "type", "param", "code"} and error["message"]

                try:
                    check()
                except Unsatisfiable:  # nothing to make invalid (an operation without inputs)
                    assert mode is GenerationMode.NEGATIVE
    return calls


def test_gateway_survives_fuzzing(model_pair, engine_backend):
    settings = gateway_settings(model_pair, backend_url=engine_backend[0], max_tokens_limit=8)
    app = create_app(settings)
    with serve(app) as url:
        assert _fuzz(app, url) > 100
        assert httpx.get(f"{url}/health").json()["status"] == "ok"


def test_engine_survives_fuzzing(model_pair):
    app = engine_app(model_pair)
    with serve(app) as url:
        assert _fuzz(app, url) > 50
        assert httpx.post(f"{url}/v1/completions", json={"prompt": [5, 6], "max_tokens": 1}).status_code == 200
