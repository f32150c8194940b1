from __future__ import annotations

import pytest

from gateway.app import create_app
from tests.helpers import gateway_settings
from tests.servers import serve


@pytest.fixture(scope="session")
def gateway_url(model_pair, engine_backend):
    settings = gateway_settings(model_pair, backend_url=engine_backend[0], backend_kind="reference")
    with serve(create_app(settings)) as url:
        yield url
