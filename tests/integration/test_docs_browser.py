"""The API docs (``/docs``, Swagger UI) in a real headless Chromium with every other host
cut off: its scripts and styles come from the controller itself."""

from __future__ import annotations

from playwright.async_api import BrowserContext, Route, expect

from tests.integration.conftest import Server
from tests.integration.test_dashboard_browser import browser  # noqa: F401 (the fixture)


async def test_the_api_docs_render_with_no_other_host(
    browser: BrowserContext,  # noqa: F811 (the fixture imported above)
    server: Server,
) -> None:
    elsewhere: list[str] = []

    async def only_the_controller(route: Route) -> None:
        if route.request.url.startswith(server.url + "/"):
            await route.continue_()
        else:
            elsewhere.append(route.request.url)
            await route.abort()

    await browser.route("**/*", only_the_controller)
    page = await browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    await page.goto(server.url + "/docs")
    await expect(page.locator(".swagger-ui .info .title")).to_contain_text("gpu-arbiter")
    await expect(page.locator(".opblock-summary-path").first).to_be_visible()
    paths = await page.locator(".opblock-summary-path").all_inner_texts()
    assert "/v1/leases" in paths and "/v1/workers/{name}/drain" in paths
    assert (await page.request.get(server.url + "/redoc")).status == 404  # it loads a CDN logo
    assert elsewhere == [] and errors == []
