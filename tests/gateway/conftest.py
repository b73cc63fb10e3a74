"""A real gateway on 127.0.0.1 for the whole module."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def gateway_url(start_gateway):
    with start_gateway() as (url, _):
        yield url
