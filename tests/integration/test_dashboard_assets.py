"""The dashboard is served by the controller itself, with no external resource."""

from __future__ import annotations

import re

import httpx

from tests.integration.conftest import Server


def test_dashboard_and_its_assets_are_served_without_a_token(server: Server) -> None:
    base = server.url
    page = httpx.get(base + "/")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assets = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert sorted(assets) == ["dashboard/app.js", "dashboard/favicon.svg", "dashboard/style.css"]
    assert "default-src 'self'" in page.text  # the browser itself refuses other hosts
    for asset in assets:
        answer = httpx.get(f"{base}/{asset}")
        assert answer.status_code == 200
        if asset.endswith(".svg"):  # an SVG names its namespace by URL; it loads nothing
            assert "href" not in answer.text
            continue
        assert "http://" not in answer.text
        assert "https://" not in answer.text
    # the data itself still needs a token
    assert httpx.get(base + "/v1/workers").status_code == 401
