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
import re
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.async_api import BrowserContext, Page, Request, async_playwright, expect

from gpu_arbiter.core import format_mb
from tests.integration.conftest import Server, register, wait_for
from tests.integration.gateways import GatewayProcess, model_entry
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


async def test_before_a_token_the_page_says_where_the_admin_token_is_and_hides_actions(
    server: Server, admin: httpx.Client, dashboard: Dashboard
) -> None:
    page = dashboard.page
    await page.goto(server.url + "/")
    notice = page.locator("#notice")
    await expect(notice).to_contain_text("Enter a token")
    token_file = server.state_dir / "admin.token"
    await expect(notice.locator(".token-file")).to_have_text(str(token_file))
    await expect(notice).to_contain_text("gpu-arbiter token create --role client")
    await expect(page.locator(".worker")).to_have_count(0)
    for action in ("#pause", "#resume"):
        await expect(page.locator(action)).to_be_hidden()

    # The token in that file is the admin's: the actions show.
    await page.fill("#token", token_file.read_text().strip())
    await page.click("#login button[type=submit]")
    await expect(page.locator("body[data-loaded=true]")).to_have_count(1)
    await expect(page.locator("#role")).to_have_text("admin")
    await expect(page.locator("#pause")).to_be_visible()
    await expect(dashboard.worker_button("local", "drain")).to_be_visible()
    dashboard.assert_clean()


async def test_the_badge_says_a_token_is_needed_while_the_controller_is_up(
    server: Server, dashboard: Dashboard
) -> None:
    """A 401 means the controller is up and wants a token: the badge says so, never
    offline; offline is for a controller that does not answer at all."""
    page = dashboard.page
    await page.goto(server.url + "/")
    conn = page.locator("#conn")
    await expect(page.locator("#notice")).to_contain_text("Enter a token")
    await expect(conn).to_have_text("token needed")
    await expect(conn).to_have_attribute("data-conn", "token")
    await page.fill("#token", "gat_not-a-token")
    await page.click("#login button[type=submit]")
    await expect(page.locator("#notice")).to_contain_text("refused this token")
    await expect(conn).to_have_text("token needed")

    await page.fill("#token", server.admin_token)
    await page.click("#login button[type=submit]")
    await expect(conn).to_have_text("live")
    dashboard.assert_clean()
    server.stop()
    await expect(conn).to_have_text("offline")
    await expect(conn).to_have_attribute("data-conn", "offline")


async def test_a_token_of_another_role_reads_everything_and_sees_no_actions(
    server: Server, admin: httpx.Client, dashboard: Dashboard
) -> None:
    held = lease(admin, "4G")
    await dashboard.open(server.token("client"))
    page = dashboard.page
    await expect(page.locator("#role")).to_have_text("client: read only")
    await expect(page.locator(f'#leases tr[data-id="{held["id"]}"]')).to_contain_text("alice")
    await expect(page.locator(".gpu")).to_have_count(2)
    for hidden in ("#pause", "#resume", "button[data-action=release]"):
        await expect(page.locator(hidden)).to_be_hidden()
    await expect(dashboard.worker_button("local", "drain")).to_be_hidden()

    # A token the controller does not know.
    await page.fill("#token", "gat_not-a-token")
    await page.click("#login button[type=submit]")
    await expect(page.locator("#notice")).to_contain_text("refused this token")
    await expect(page.locator("#notice .token-file")).to_have_text(
        str(server.state_dir / "admin.token")
    )
    await expect(page.locator(".worker")).to_have_count(0)
    await expect(page.locator("#pause")).to_be_hidden()
    dashboard.assert_clean()


async def test_an_action_the_controller_refuses_says_why(
    server: Server, admin: httpx.Client, dashboard: Dashboard
) -> None:
    await dashboard.open(server.admin_token)
    page = dashboard.page
    # The token stops being valid while the page shows the admin's buttons (in one turn
    # of the page's script: a refresh in between would take the buttons away first).
    await expect(dashboard.worker_button("local", "drain")).to_be_visible()
    await page.evaluate(
        """() => {
            state.token = "gat_not-a-token";
            document.querySelector('.worker[data-worker="local"] [data-action=drain]').click();
        }"""
    )
    toast = page.locator("#toast")
    await expect(toast).to_contain_text("drain local refused: 401")
    await expect(toast).to_contain_text("enter the admin token")
    await expect(page.locator("#notice")).to_contain_text("refused this token")
    await expect(page.locator("#pause")).to_be_hidden()
    assert worker_state(admin, "local") == "online"
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
    # measured in the page, on the element as it is then: the queue is drawn again as
    # the arbiter's events come, and a box asked for from here can find the row replaced
    left, right = await reason.evaluate(
        "cell => { const box = cell.getBoundingClientRect(); return [box.left, box.right] }"
    )
    assert left >= 0 and right <= inner, (left, right, inner)
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


# ---------------------------------------------------------------- who holds what


def lease_on(admin: httpx.Client, worker: str, vram: str, holder: str, priority: str) -> str:
    body = {
        "vram_mb": vram,
        "holder": holder,
        "priority": priority,
        "ttl_s": 300,
        "constraints": {"worker": worker},
    }
    answer = admin.post("/v1/leases", json=body)
    assert answer.status_code == 201, answer.text
    lease_id: str = answer.json()["id"]
    return lease_id


def held_on_one_gpu(admin: httpx.Client) -> dict[str, str]:
    """On ``edge:0`` (24 GiB, probe: 6 GiB in use): alice 8G normal (active), bob 4G
    batch (revoking), carol 2G interactive (active), dave 256M critical (loading)."""
    register(admin, "edge", gpus=1, total_mb=24576)
    probe = {"gpus": [{"index": 0, "used_mb": 6144}]}
    assert admin.post("/v1/workers/edge/heartbeat", json=probe).status_code == 200
    ids: dict[str, str] = {}
    for holder, vram, priority in (
        ("alice", "8G", "normal"),
        ("bob", "4G", "batch"),
        ("carol", "2G", "interactive"),
        ("dave", "256M", "critical"),
    ):
        ids[holder] = lease_on(admin, "edge", vram, holder, priority)
        if holder != "dave":  # one load at a time per GPU: the next is granted once ready
            assert admin.post(f"/v1/leases/{ids[holder]}/ready").status_code == 200
    assert admin.post(f"/v1/leases/{ids['bob']}/revoke").json()["state"] == "revoking"
    return ids


async def style_of(page: Page, lease_id: str, name: str) -> str:
    """A lease's segment's computed style ``name``, found and read in one turn of the
    page's script: an element found in one turn and read in the next may have been
    replaced by a redraw in between, and a detached element's style is empty."""
    found: str | None = await page.evaluate(
        """([lease, name]) => {
            const node = document.querySelector(`.segment[data-lease="${lease}"]`);
            return node ? getComputedStyle(node)[name] : null;
        }""",
        [lease_id, name],
    )
    assert found is not None, f"no segment for lease {lease_id}"
    return found


async def boxes(page: Page, *selectors: str) -> list[dict[str, float]]:
    """The drawn boxes of the first element of each selector, all read in one turn of the
    page's script (the page redraws as news comes: separate reads could straddle one)."""
    found: list[dict[str, float] | None] = await page.evaluate(
        """(selectors) => selectors.map((selector) => {
            const node = document.querySelector(selector);
            if (!node) return null;
            const r = node.getBoundingClientRect();
            return { x: r.x, y: r.y, width: r.width, height: r.height };
        })""",
        list(selectors),
    )
    missing = [s for s, b in zip(selectors, found, strict=True) if b is None]
    assert not missing, f"not on the page: {missing}"
    return [b for b in found if b is not None]


async def assert_segments_drawn_to_scale(page: Page, ids: dict[str, str]) -> None:
    """Each lease is a segment of the bar as wide as its share of the GPU (within a pixel
    or two), in the order of grant; the probe's reading is a line at its share."""
    shares = {"alice": 8 / 24, "bob": 4 / 24, "carol": 2 / 24, "dave": 1 / 96}
    bar, used, *segments = await boxes(
        page,
        '.gpu[data-gpu="edge:0"] .bar',
        '.gpu[data-gpu="edge:0"] .used-line',
        *(f'.segment[data-lease="{ids[holder]}"]' for holder in shares),
    )
    left = bar["x"]
    for (holder, share), segment in zip(shares.items(), segments, strict=True):
        assert segment["width"] == pytest.approx(bar["width"] * share, abs=1.5), holder
        assert segment["x"] == pytest.approx(left, abs=1.5), holder
        assert segment["height"] == pytest.approx(bar["height"], abs=1), holder
        left += segment["width"]
    middle = used["x"] + used["width"] / 2
    assert middle == pytest.approx(bar["x"] + bar["width"] / 4, abs=2)  # 6 of 24 GiB


async def test_each_gpu_bar_is_split_per_lease_to_scale_with_its_holder(
    server: Server, admin: httpx.Client, dashboard: Dashboard
) -> None:
    ids = held_on_one_gpu(admin)
    await dashboard.open(server.admin_token)
    page = dashboard.page
    segments = page.locator('.gpu[data-gpu="edge:0"] .segment')
    await expect(segments).to_have_count(4)
    await assert_segments_drawn_to_scale(page, ids)

    alice = page.locator(f'.segment[data-lease="{ids["alice"]}"]')
    await expect(alice.locator(".label")).to_have_text("alice")
    await expect(alice.locator(".label")).to_be_visible()
    await expect(alice).to_have_attribute("title", re.compile(r"^alice: 8\.0 GiB on edge:0"))
    dave = page.locator(f'.segment[data-lease="{ids["dave"]}"]')
    await expect(dave.locator(".label")).to_be_hidden()  # 1/96 of the bar: no room
    await expect(dave).to_have_attribute("title", re.compile(r"^dave: 256 MiB"))

    # Colour by priority class; hatched while loading; outlined while revoking.
    colours = {}
    for holder, priority in (("alice", "normal"), ("bob", "batch"), ("carol", "interactive")):
        segment = page.locator(f'.segment[data-lease="{ids[holder]}"]')
        await expect(segment).to_have_attribute("data-class", priority)
        colours[holder] = await style_of(page, ids[holder], "backgroundColor")
    await expect(dave).to_have_attribute("data-class", "critical")
    colours["dave"] = await style_of(page, ids["dave"], "backgroundColor")
    assert len(set(colours.values())) == 4, colours
    assert "repeating-linear-gradient" in await style_of(page, ids["dave"], "backgroundImage")
    assert "gradient" not in await style_of(page, ids["alice"], "backgroundImage")
    assert await style_of(page, ids["bob"], "outlineStyle") == "dashed"
    assert await style_of(page, ids["alice"], "outlineStyle") == "none"

    # Released: its segment goes, the others keep their sizes.
    assert admin.delete(f"/v1/leases/{ids['carol']}").status_code == 200
    await expect(segments).to_have_count(3)
    left, right = await boxes(
        page, f'.segment[data-lease="{ids["bob"]}"]', f'.segment[data-lease="{ids["dave"]}"]'
    )
    assert right["x"] == pytest.approx(left["x"] + left["width"], abs=1.5)

    await page.set_viewport_size(PHONE)
    await expect(segments).to_have_count(3)
    bar, alice_box = await boxes(
        page, '.gpu[data-gpu="edge:0"] .bar', f'.segment[data-lease="{ids["alice"]}"]'
    )
    assert bar["width"] < PHONE["width"]
    assert alice_box["width"] == pytest.approx(bar["width"] / 3, abs=1.5)
    dashboard.assert_clean()


async def test_tables_lead_with_the_holder_and_say_why_in_words(
    server: Server, admin: httpx.Client, dashboard: Dashboard
) -> None:
    held = lease(admin, "20G", holder="alice")
    lease(admin, "12G", holder="bob")
    waiting = lease(admin, "20G", holder="carol")
    assert waiting["state"] == "pending"
    await dashboard.open(server.admin_token)
    page = dashboard.page
    for table in ("#queue", "#leases"):
        await expect(page.locator(f"{table} th").first).to_have_text("holder")
    queued = page.locator(f'#queue tr[data-id="{waiting["id"]}"]')
    await expect(queued.locator("td").first).to_have_text("carol")
    await expect(page.locator(f'#leases tr[data-id="{held["id"]}"] td').first).to_have_text("alice")

    reason = admin.get(f"/v1/leases/{waiting['id']}").json()["reason"]
    cell = queued.locator("td.reason")
    await expect(cell.locator(".reason-text")).to_have_text(reason["message"])
    verdicts = cell.locator(".verdicts li")
    for verdict in reason["gpus"]:
        if verdict["code"] == "insufficient_vram":
            line = verdicts.filter(has_text=verdict["gpu"])
            await expect(line).to_contain_text("not enough free memory: needs 20.0 GiB")
            await expect(line).to_contain_text(f"{format_mb(verdict['free_mb'])} free")
    blocker = reason.get("blocked_by")  # a lease in the way: named by its holder
    await expect(verdicts).to_have_count(len(reason["gpus"]) + (1 if blocker else 0))
    if blocker:
        holders = {found["id"]: found["holder"] for found in admin.get("/v1/leases").json()}
        waits = verdicts.filter(has_text="waits on")
        await expect(waits).to_have_text(f"waits on {holders[blocker]} ({blocker})")
    for line in await verdicts.all_inner_texts():
        assert "_" not in line, line  # words, not codes
    dashboard.assert_clean()


async def test_a_blocker_sizes_and_counters_are_shown_in_words(
    server: Server, admin: httpx.Client, dashboard: Dashboard
) -> None:
    """Two loads hold both GPUs' load gates: the waiting request names whose load it waits
    on (never the blocker's raw fields); events give sizes as the CLI does; the summary
    leaves out the scheduler's own work counters."""
    alice = lease(admin, "20G", holder="alice")
    lease(admin, "20G", holder="bob")
    waiting = lease(admin, "2G", holder="carol")
    reason = admin.get(f"/v1/leases/{waiting['id']}").json()["reason"]
    assert reason["code"] == "load_in_progress" and reason["blocker"]["kind"] == "loading"
    blocker = reason["blocker"]["id"]
    holder = "alice" if blocker == alice["id"] else "bob"
    await dashboard.open(server.admin_token)
    page = dashboard.page
    lines = page.locator(f'#queue tr[data-id="{waiting["id"]}"] td.reason .verdicts li')
    await expect(lines.filter(has_text="waits on")).to_have_text(f"waits on {holder} ({blocker})")
    for line in await lines.all_inner_texts():
        assert "{" not in line and "blocker" not in line, line
    granted = page.locator('#events li[data-kind="lease.granted"]').filter(has_text=alice["id"])
    await expect(granted).to_contain_text("vram_mb=20.0GiB")
    assert "examined" in admin.get("/v1/status").json()["counters"]
    await expect(page.locator("#summary")).not_to_contain_text("examined")
    dashboard.assert_clean()


async def test_many_gpus_that_say_the_same_are_one_line(
    server: Server, admin: httpx.Client, dashboard: Dashboard
) -> None:
    register(admin, "small", gpus=6, total_mb=12288)
    used = [3000, 4000, 5000, 6000, 7000, 8000]  # 9.1 GiB free at most, each its own
    probe = {"gpus": [{"index": i, "used_mb": mb} for i, mb in enumerate(used)]}
    assert admin.post("/v1/workers/small/heartbeat", json=probe).status_code == 200
    for holder in ("alice", "bob"):
        lease_on(admin, "local", "20G", holder, "normal")
    waiting = lease(admin, "10G", holder="carol")
    assert waiting["state"] == "pending"
    await dashboard.open(server.admin_token)
    cell = dashboard.page.locator(f'#queue tr[data-id="{waiting["id"]}"] td.reason')
    full = cell.locator(".verdicts li").filter(has_text="not enough free memory")
    await expect(full).to_have_count(1)
    await expect(full).to_have_text(  # the nearest: small:0, with 9.1 GiB of its 12 GiB free
        "small:0 and 7 more not enough free memory: needs 10.0 GiB, at most 9.1 GiB free"
    )
    dashboard.assert_clean()


# ---------------------------------------------------------------- the last hour


@pytest.fixture
def quick_history(start_server: Callable[..., Server], tmp_path: Path) -> Server:
    """A controller of two simulated 24 GiB GPUs sampling its history twice a second."""
    config = tmp_path / "arbiter.toml"
    config.write_text("history_sample_s = 0.5\n")
    return start_server("--simulate", "2x24G:sm_86", "--config", str(config))


def history_now(admin: httpx.Client, gpu: str) -> dict[str, Any]:
    kept = admin.get("/v1/history").json()
    series = {g["id"]: g for g in kept["gpus"]}[gpu]
    return {key: series[key][-1] for key in ("committed_mb", "busy_mb", "used_mb")}


async def test_a_history_strip_per_gpu_and_for_the_queue_drawn_to_scale(
    quick_history: Server, browser: BrowserContext
) -> None:
    dashboard = Dashboard(await browser.new_page(), quick_history)
    with quick_history.client() as admin:
        held = lease(admin, "8G")
        gpu = held["gpus"][0]
        other = "local:1" if gpu == "local:0" else "local:0"
        lease(admin, "20G", holder="bob")  # the other GPU
        waiting = admin.post("/v1/leases", json={"vram_mb": "20G", "priority": "batch"})
        assert waiting.json()["state"] == "pending"
        await eventually(lambda: history_now(admin, gpu)["committed_mb"] == 8192, "a sample")
        await dashboard.open(quick_history.admin_token)
        page = dashboard.page

        strip = page.locator(f'.history[data-gpu="{gpu}"] svg')
        await expect(strip).to_have_count(1)
        committed = strip.locator("path.h-committed")
        await expect(committed).to_have_attribute("d", re.compile(r"L[\d.]+ 66\.67"))
        here = f'.history[data-gpu="{gpu}"] svg'
        drawn = await boxes(
            page,
            here,
            f"{here} path.h-committed",
            f"{here} path.h-busy",
            f'.history[data-gpu="{other}"] svg path.h-committed',
        )
        height = drawn[0]["height"]
        assert drawn[1]["height"] == pytest.approx(height / 3, abs=1.5)  # 8 of 24 GiB
        assert drawn[2]["height"] == pytest.approx(height / 3, abs=1.5)
        assert drawn[3]["height"] == pytest.approx(height * 20 / 24, abs=1.5)
        busy = strip.locator("path.h-busy")

        # Kept warm: still committed, no longer busy, in the samples that follow.
        assert admin.post(f"/v1/leases/{held['id']}/ready").status_code == 200
        assert admin.post(f"/v1/leases/{held['id']}/idle").status_code == 200
        await eventually(lambda: history_now(admin, gpu)["busy_mb"] == 0, "an idle sample")
        await expect(busy).to_have_attribute("d", re.compile(r"L[\d.]+ 100\.00 L[\d.]+ 100 Z$"))
        await expect(committed).to_have_attribute("d", re.compile(r"L[\d.]+ 66\.67 L[\d.]+ 100 Z$"))

        # The queue: one batch request waiting, the peak of the strip.
        queue = page.locator("#queue-history svg")
        await expect(queue).to_have_attribute("data-peak", "1")
        whole, batch = await boxes(
            page, "#queue-history svg", '#queue-history svg path[data-class="batch"]'
        )
        assert batch["height"] == pytest.approx(whole["height"], abs=1.5)
        samples = int(await strip.get_attribute("data-samples") or 0)
        assert samples >= 2
        assert samples <= admin.get("/v1/history").json()["samples"]
    dashboard.assert_clean()


def test_the_history_route_reads_the_last_samples_and_follows_with_since(
    quick_history: Server,
) -> None:
    with quick_history.client() as admin:
        held = lease(admin, "8G")
        gpu = held["gpus"][0]
        wait_for(lambda: history_now(admin, gpu)["committed_mb"] == 8192, 20, "a sample")
        kept = admin.get("/v1/history").json()
        assert kept["sample_s"] == 0.5
        assert kept["samples"] == 360
        assert len(kept["times"]) <= kept["samples"]
        assert kept["times"] == sorted(kept["times"])
        for series in kept["gpus"]:
            assert len(series["committed_mb"]) == len(kept["times"])
            assert series["total_mb"] == 24576
            assert set(series["used_mb"]) == {None}  # a simulated GPU has no probe
        assert history_now(admin, gpu) == {"committed_mb": 8192, "busy_mb": 8192, "used_mb": None}
        assert set(kept["queue"]) == {"critical", "interactive", "normal", "background", "batch"}

        last = kept["times"][-1]
        wait_for(lambda: admin.get("/v1/history").json()["times"][-1] > last, 20, "the next")
        newer = admin.get("/v1/history", params={"since": last}).json()
        assert newer["times"] and min(newer["times"]) > last
        assert all(len(g["committed_mb"]) == len(newer["times"]) for g in newer["gpus"])

    with quick_history.client(token=None) as anonymous:
        assert anonymous.get("/v1/history").status_code == 401
        assert anonymous.get("/v1/access").json() == {
            "auth": True,
            "role": None,
            "admin_token_file": str(quick_history.state_dir / "admin.token"),
        }


def reported(admin: httpx.Client, gateway: GatewayProcess) -> dict[str, Any] | None:
    found: dict[str, Any] | None = next(
        (g for g in admin.get("/v1/gateways").json() if g["url"] == gateway.url), None
    )
    return found


async def test_the_models_panel_shows_each_gateways_models_and_pins_one(
    server: Server, admin: httpx.Client, dashboard: Dashboard, tmp_path: Path
) -> None:
    """A real gateway reports to the controller; the page shows its host, its name and
    URL, and its model with its state; Pin goes through the controller to the gateway,
    whose own API then says pinned, and the button becomes Unpin."""
    record = tmp_path / "record"
    record.mkdir()
    models = model_entry("chat", record, vram="1G", aliases=["gpt-4o-mini"])
    gateway = GatewayProcess(server.url, server.admin_token, tmp_path / "gw", models).start()
    try:
        found = await eventually(lambda: reported(admin, gateway), "the gateway's report", 30)
        await dashboard.open(server.admin_token)
        page = dashboard.page
        host = page.locator(f'.host[data-host="{found["host"]}"]')
        await expect(host.locator("h3")).to_have_text(found["host"])
        block = host.locator(f'.gateway[data-gateway="{found["name"]}"]')
        await expect(block.locator(".gateway-head")).to_contain_text(found["name"])
        await expect(block.locator(".gateway-head")).to_contain_text(gateway.url)
        row = block.locator('tr[data-id="chat"]')
        await expect(row.locator(".model-state")).to_have_attribute("data-state", "cold")
        await expect(row).to_contain_text("gpt-4o-mini")
        await expect(row.locator("td.pinned")).to_have_text("no")

        await row.locator('button[data-action="model-pin"]').click()
        await expect(page.locator("#toast")).to_contain_text("sent to the gateway")
        await eventually(lambda: gateway.model_state("chat")["pinned"], "the gateway pinned", 30)
        await expect(row.locator('button[data-action="model-unpin"]')).to_be_visible()
        await expect(row.locator("td.pinned")).to_contain_text("yes")
        await dashboard.screenshot("dashboard-models.png")
        dashboard.assert_clean()
    finally:
        gateway.stop()


async def test_the_models_panel_shows_a_front_doors_last_routes(
    server: Server, admin: httpx.Client, dashboard: Dashboard
) -> None:
    """A gateway's report carries its last routing decisions as a front door: the page
    shows the newest first, each saying where a request went and why."""
    routes = [
        {"at": 1.0, "model": "chat", "outcome": "load", "to": None,
         "why": "chat: cold, a load for the cluster (gw-2, gw-3)"},
        {"at": 2.0, "model": "chat", "outcome": "peer", "to": "gw-3",
         "why": "chat -> gw-3: warm, 0 in flight"},
    ]  # fmt: skip
    body = {
        "url": "http://127.0.0.2:8080", "host": "front", "worker": None,
        "models": [{"id": "chat", "state": "cold"}], "routes": routes,
    }  # fmt: skip
    answer = admin.put("/v1/gateways/gw-2", json=body)
    assert answer.status_code == 200, answer.text
    await dashboard.open(server.admin_token)
    shown = dashboard.page.locator('.gateway[data-gateway="gw-2"] .routes li')
    await expect(shown).to_have_count(2)
    await expect(shown.first).to_have_text("chat -> gw-3: warm, 0 in flight")
    await expect(shown.first).to_have_attribute("data-outcome", "peer")
    await expect(shown.nth(1)).to_contain_text("a load for the cluster")
    dashboard.assert_clean()
