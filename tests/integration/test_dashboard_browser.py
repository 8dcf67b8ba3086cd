"""The dashboard in a real headless Chromium (Debian's ``chromium``, driven by Playwright)
against a real controller: what it shows, live updates, admin actions and their refusal,
a phone-width layout, and no request to any other host.

Chromium is never downloaded: the tests launch the system one (``GPU_ARBITER_CHROMIUM``,
default ``/usr/bin/chromium``) and fail, not skip, when it is missing. Screenshots go to
``GPU_ARBITER_ARTIFACTS`` (default ``test-artifacts/`` at the repository root).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.async_api import BrowserContext, Page, Request, async_playwright, expect

from gpu_arbiter.core import format_mb
from tests.integration.conftest import Server, register, wait_for
from tests.integration.test_ha import Controllers, leader_of, role

CHROMIUM = Path(os.environ.get("GPU_ARBITER_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = Path(
    os.environ.get("GPU_ARBITER_ARTIFACTS")
    or Path(__file__).resolve().parents[2] / "test-artifacts"
)
DESKTOP = {"width": 1280, "height": 900}
PHONE = {"width": 390, "height": 844}

expect.set_options(timeout=20_000)


async def eventually(predicate: Callable[[], Any], what: str, timeout_s: float = 20.0) -> Any:
    """Polls ``predicate`` (an API read) without blocking the browser's event loop."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


class Dashboard:
    """One page on the controller's dashboard; it records every request the page makes
    and every uncaught script error."""

    def __init__(self, page: Page, server: Server) -> None:
        self.page = page
        self.server = server
        self.requests: list[str] = []
        self.errors: list[str] = []
        page.on("request", self._record)
        page.on("pageerror", lambda error: self.errors.append(str(error)))

    def _record(self, request: Request) -> None:
        self.requests.append(request.url)

    async def open(self, token: str) -> None:
        """Signs in with ``token`` and waits until the page shows live data."""
        await self.page.goto(self.server.url + "/")
        await expect(self.page.locator("#notice")).to_contain_text("Enter a token")
        await self.page.fill("#token", token)
        await self.page.click("#login button[type=submit]")
        await expect(self.page.locator("body[data-loaded=true]")).to_have_count(1)
        await expect(self.page.locator("#conn")).to_have_text("live")

    def worker_button(self, worker: str, action: str) -> Any:
        return self.page.locator(f'.worker[data-worker="{worker}"] button[data-action="{action}"]')

    async def screenshot(self, name: str) -> Path:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        path = ARTIFACTS / name
        path.unlink(missing_ok=True)
        await self.page.screenshot(path=str(path), full_page=True)
        assert path.stat().st_size > 0
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        return path

    def assert_clean(self) -> None:
        """No uncaught script error; every request went to the controller."""
        assert self.errors == []
        assert self.requests, "the page made no request at all"
        strangers = [url for url in self.requests if not url.startswith(self.server.url + "/")]
        assert strangers == []


@pytest.fixture
async def browser(tmp_path: Path) -> AsyncIterator[BrowserContext]:
    """Headless Chromium with a fresh profile."""
    if not CHROMIUM.exists():
        pytest.fail(
            f"Chromium is not installed at {CHROMIUM}: install Debian's `chromium` package "
            "(.ci/run does) or point GPU_ARBITER_CHROMIUM at a Chromium binary",
            pytrace=False,
        )
    async with async_playwright() as playwright:
        context = await playwright.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"),
            executable_path=str(CHROMIUM),
            headless=True,
            args=CHROMIUM_ARGS,
            viewport=DESKTOP,
        )
        try:
            yield context
        finally:
            await context.close()


@pytest.fixture
async def dashboard(browser: BrowserContext, server: Server) -> Dashboard:
    return Dashboard(await browser.new_page(), server)


def lease(admin: httpx.Client, vram: str, holder: str = "alice") -> dict[str, Any]:
    answer = admin.post("/v1/leases", json={"vram_mb": vram, "holder": holder, "ttl_s": 300})
    assert answer.status_code in (201, 202), answer.text
    created: dict[str, Any] = answer.json()
    return created


def worker_state(admin: httpx.Client, name: str) -> str:
    state: str = admin.get(f"/v1/workers/{name}").json()["state"]
    return state


async def test_the_page_shows_every_gpu_of_the_controller(
    server: Server, admin: httpx.Client, dashboard: Dashboard
) -> None:
    register(admin, "edge", gpus=1, total_mb=16384)
    lease(admin, "10G")
    await dashboard.open(server.admin_token)

    workers = admin.get("/v1/workers").json()
    gpus = [gpu for worker in workers for gpu in worker["gpus"]]
    assert len(gpus) == 3
    page = dashboard.page
    await expect(page.locator(".gpu")).to_have_count(len(gpus))
    await expect(page.locator(".worker")).to_have_count(len(workers))
    for worker in workers:
        state = page.locator(f'.worker[data-worker="{worker["name"]}"] .state')
        await expect(state).to_have_text(worker["state"])
    for gpu in gpus:
        row = page.locator(f'.gpu[data-gpu="{gpu["id"]}"]')
        await expect(row).to_contain_text(gpu["id"])
        await expect(row).to_contain_text(f"committed {format_mb(gpu['committed_mb'])}")
        await expect(row).to_contain_text(
            f"free {format_mb(gpu['free_mb'])} of {format_mb(gpu['total_mb'])}"
        )
        await expect(row).to_have_attribute("data-free-mb", str(gpu["free_mb"]))
        await expect(row).to_have_attribute("data-committed-mb", str(gpu["committed_mb"]))
    assert sum(gpu["committed_mb"] for gpu in gpus) == 10240

    await dashboard.screenshot("dashboard-desktop.png")
    dashboard.assert_clean()


async def test_a_lease_appears_without_a_reload_and_goes_when_released(
    server: Server, admin: httpx.Client, dashboard: Dashboard
) -> None:
    await dashboard.open(server.admin_token)
    page = dashboard.page
    await page.evaluate("window.sameDocument = true")
    await expect(page.locator("#leases")).to_contain_text("No lease is held.")

    held = lease(admin, "20G")
    assert held["state"] != "pending"
    row = page.locator(f'#leases tr[data-id="{held["id"]}"]')
    await expect(row).to_contain_text("20.0 GiB")
    await expect(row).to_contain_text(held["gpus"][0])
    gpu = page.locator(f'.gpu[data-gpu="{held["gpus"][0]}"]')
    await expect(gpu).to_contain_text("committed 20.0 GiB")
    await expect(page.locator("#events")).to_contain_text(held["id"])

    filler = lease(admin, "20G")
    waiting = lease(admin, "20G", holder="bob")
    assert waiting["state"] == "pending"
    queued = page.locator(f'#queue tr[data-id="{waiting["id"]}"]')
    await expect(queued).to_contain_text("bob")
    await expect(queued.locator("td.reason")).to_contain_text("0/2 GPUs fit")

    assert admin.delete(f"/v1/leases/{waiting['id']}").status_code == 200
    await expect(queued).to_have_count(0)
    await expect(page.locator("#queue")).to_contain_text("Nothing is waiting.")
    for lease_id in (held["id"], filler["id"]):
        assert admin.delete(f"/v1/leases/{lease_id}").status_code == 200
    await expect(row).to_have_count(0)
    await expect(page.locator("#leases")).to_contain_text("No lease is held.")
    await expect(gpu).to_contain_text("committed 0 MiB")
    assert await page.evaluate("window.sameDocument") is True  # never reloaded
    dashboard.assert_clean()


async def test_drain_cancel_drain_and_release_from_the_page_with_the_admin_token(
    server: Server, admin: httpx.Client, dashboard: Dashboard
) -> None:
    await dashboard.open(server.admin_token)
    await dashboard.worker_button("local", "drain").click()
    await eventually(lambda: worker_state(admin, "local") != "online", "the worker to drain")
    assert worker_state(admin, "local") in ("draining", "drained")
    page = dashboard.page
    await expect(page.locator("#toast")).to_contain_text("drain local: done")
    state = page.locator('.worker[data-worker="local"] .state')
    await expect(state).to_have_text(worker_state(admin, "local"))

    await dashboard.worker_button("local", "cancel-drain").click()
    await eventually(lambda: worker_state(admin, "local") == "online", "the worker to be back")
    await expect(state).to_have_text("online")
    await expect(dashboard.worker_button("local", "drain")).to_be_visible()

    held = lease(admin, "4G")
    release = page.locator(f'#leases tr[data-id="{held["id"]}"] button[data-action=release]')
    page.once("dialog", lambda dialog: dialog.accept())  # "Release lease ...?"
    await release.click()
    await eventually(
        lambda: admin.get(f"/v1/leases/{held['id']}").json()["state"] == "released",
        "the release",
    )
    await expect(release).to_have_count(0)
    dashboard.assert_clean()


async def test_actions_are_refused_without_the_admin_token(
    server: Server, admin: httpx.Client, dashboard: Dashboard
) -> None:
    page = dashboard.page
    toast = page.locator("#toast")

    # A valid token of another role reads everything, and may not drain or pause.
    await dashboard.open(server.token("client"))
    await dashboard.worker_button("local", "drain").click()
    await expect(toast).to_be_visible()
    await expect(toast).to_contain_text("drain local refused: 403 forbidden")
    await page.click("#pause")
    await expect(toast).to_contain_text("pause refused: 403 forbidden")
    assert worker_state(admin, "local") == "online"

    # No token: nothing to see, and the controller refuses the action.
    await page.click("#logout")
    await expect(page.locator("#notice")).to_contain_text("Enter a token")
    await expect(page.locator(".worker")).to_have_count(0)
    await page.click("#pause")
    await expect(toast).to_contain_text("pause refused: 401")
    await expect(toast).to_contain_text("enter the admin token")

    # A token the controller does not know.
    await page.fill("#token", "gat_not-a-token")
    await page.click("#login button[type=submit]")
    await expect(page.locator("#notice")).to_contain_text("refused this token")
    await page.click("#resume")
    await expect(toast).to_contain_text("resume refused: 401")

    assert worker_state(admin, "local") == "online"
    assert admin.get("/v1/status").json()["paused"] is False
    dashboard.assert_clean()


async def test_pause_and_resume_from_the_page(
    server: Server, admin: httpx.Client, dashboard: Dashboard
) -> None:
    await dashboard.open(server.admin_token)
    page = dashboard.page
    await page.click("#pause")
    await eventually(lambda: admin.get("/v1/status").json()["paused"], "the pause")
    await expect(page.locator("#paused")).to_be_visible()
    await page.click("#resume")
    await eventually(lambda: not admin.get("/v1/status").json()["paused"], "the resume")
    await expect(page.locator("#paused")).to_be_hidden()
    dashboard.assert_clean()


async def test_a_worker_being_updated_says_so_until_the_update_ends(
    server: Server, admin: httpx.Client, dashboard: Dashboard
) -> None:
    register(admin, "edge", gpus=1, total_mb=16384)
    await dashboard.open(server.admin_token)
    badge = dashboard.page.locator('.worker[data-worker="edge"] .updating')
    await expect(badge).to_have_count(0)
    started = admin.post("/v1/workers/edge/update")
    assert started.status_code == 202, started.text
    await expect(badge).to_have_text("updating: waits on update_command")  # no reload
    await expect(badge).to_have_attribute("data-operation", started.json()["id"])
    assert admin.post("/v1/workers/edge/cancel-drain").status_code == 200
    await expect(badge).to_have_count(0)
    dashboard.assert_clean()


async def test_a_phone_width_screen_needs_no_horizontal_scrolling(
    server: Server, admin: httpx.Client, dashboard: Dashboard
) -> None:
    lease(admin, "20G")
    lease(admin, "12G", holder="a-holder-with-a-rather-long-name@build-host-17")
    waiting = lease(admin, "20G", holder="bob")
    assert waiting["state"] == "pending"
    await dashboard.page.set_viewport_size(PHONE)
    await dashboard.open(server.admin_token)
    page = dashboard.page
    await expect(page.locator(f'#queue tr[data-id="{waiting["id"]}"]')).to_be_visible()
    await expect(page.locator("#leases tbody tr")).to_have_count(2)

    width = await page.evaluate("document.documentElement.scrollWidth")
    inner = await page.evaluate("window.innerWidth")
    assert inner == PHONE["width"]
    assert width <= inner
    reason = page.locator(f'#queue tr[data-id="{waiting["id"]}"] td.reason')
    await expect(reason).to_contain_text("GPUs fit")
    box = await reason.bounding_box()
    assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= inner
    await dashboard.screenshot("dashboard-phone.png")
    dashboard.assert_clean()


async def test_a_standby_says_so_and_links_to_the_leader(
    browser: BrowserContext, tmp_path: Path, postgres_dsn: str
) -> None:
    controllers = Controllers(tmp_path, postgres_dsn)
    try:
        first = controllers.start("a")
        leader_of(first)
        second = controllers.start("b")
        wait_for(lambda: role(second) == "standby", 20, "the second to stand by")
        with first.client() as admin:
            lease(admin, "2G", holder="on-the-leader")

        dashboard = Dashboard(await browser.new_page(), second)
        await dashboard.open(first.admin_token)  # the tokens are in the shared database
        page = dashboard.page
        await expect(page.locator("#standby")).to_be_visible()
        await expect(page.locator("#leader")).to_have_attribute("href", first.url + "/")
        await expect(page.locator("#leases")).to_contain_text("on-the-leader")
        dashboard.assert_clean()

        leader = Dashboard(await browser.new_page(), first)
        await leader.open(first.admin_token)
        await expect(leader.page.locator("#standby")).to_be_hidden()
        leader.assert_clean()
    finally:
        controllers.stop()
