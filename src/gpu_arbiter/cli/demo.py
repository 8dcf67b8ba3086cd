"""``gpu-arbiter demo``: a short mixed workload on one simulated 24 GiB GPU, narrated."""

from __future__ import annotations

import asyncio
import sys

import typer
from rich.console import Console

from ..core import Gpu, LeasePreempted, Policy, format_mb
from ..engine import Arbiter, ArbiterEvent

SPEED_HELP = "Seconds of demo time per scripted second (smaller is faster)."


def demo(speed: float = typer.Option(0.25, min=0.01, max=10.0, help=SPEED_HELP)) -> None:
    """Replay a mixed workload on a simulated GPU and say what happened and why."""
    # Piped or redirected: one line per sentence, never wrapped at 80 columns.
    console = Console(highlight=False, soft_wrap=not sys.stdout.isatty())
    asyncio.run(_Demo(console, speed).run())


class _Demo:
    def __init__(self, console: Console, speed: float) -> None:
        self.console = console
        self.speed = speed
        self.gpu = Gpu(index=0, total_mb=24576, arch="sm_86", model="simulated RTX 4090")
        self.arbiter = Arbiter(gpus=[self.gpu], policy=Policy(), hooks=[self.on_event])
        self.names: dict[str, str] = {}
        self.start = 0.0

    def say(self, text: str) -> None:
        at = (asyncio.get_running_loop().time() - self.start) / self.speed
        self.console.print(f"[dim]{at:6.2f}s[/dim]  {text}")

    def on_event(self, event: ArbiterEvent) -> None:
        name = self.names.get(event.lease_id or "", event.lease_id)
        detail = dict(event.detail or {})
        if event.kind == "granted":
            self.say(
                f"[green]granted[/green]  {name} on {', '.join(detail['gpus'])} "
                f"(fencing token {detail['token']})"
            )
        elif event.kind == "revoked":
            self.say(
                f"[red]revoking[/red] {name}: {detail['reason']} — its memory stays "
                "committed until it has stopped"
            )
        elif event.kind == "released":
            self.say(f"released {name}")

    async def pause(self, seconds: float) -> None:
        await asyncio.sleep(seconds * self.speed)

    def why(self) -> None:
        for info in self.arbiter.pending():
            name = self.names.get(info.request.id, info.request.id)
            self.console.print(
                f"          [yellow]waiting[/yellow] #{info.position} {name}: {info.reason.message}"
            )

    async def hold(
        self,
        name: str,
        vram: str,
        priority: str,
        load_s: float,
        run_s: float,
        cleanup_s: float = 0.0,
    ) -> None:
        block = self.arbiter.lease(vram, priority=priority, holder=name)
        self.names[block._request.id] = f"{name} ({vram}, {priority})"
        try:
            async with block as lease:
                await self.pause(load_s)
                await lease.ready()
                try:
                    await self.pause(run_s)
                finally:
                    if cleanup_s:
                        self.say(f"{name} saves a checkpoint before stopping")
                        await asyncio.shield(self.pause(cleanup_s))
        except LeasePreempted:
            self.say(f"{name} was preempted and stopped cleanly")

    async def run(self) -> None:
        c = self.console
        c.print(
            f"[bold]gpu-arbiter demo[/bold]: one simulated GPU, {self.gpu.model}, "
            f"{format_mb(self.gpu.total_mb)}; one model load at a time per GPU\n"
        )
        async with self.arbiter:
            self.start = asyncio.get_running_loop().time()
            tasks: list[asyncio.Task[None]] = []

            def spawn(*args: object, **kwargs: object) -> None:
                tasks.append(asyncio.create_task(self.hold(*args, **kwargs)))  # type: ignore[arg-type]

            c.print(
                "[bold]1. The load gate[/bold]: two models arrive together; loads never overlap"
            )
            spawn("chat-model", "6G", "normal", load_s=1.0, run_s=3.0)
            spawn("embedder", "4G", "normal", load_s=0.5, run_s=3.0)
            await self.pause(0.2)
            self.why()
            await self.pause(1.6)

            c.print(
                "\n[bold]2. Preemption[/bold]: a batch fine-tune fills the GPU; "
                "an interactive request takes its place"
            )
            spawn("fine-tune", "12G", "batch", load_s=0.2, run_s=30.0, cleanup_s=0.8)
            await self.pause(0.5)
            spawn("chat-vision", "10G", "interactive", load_s=0.3, run_s=1.0)
            await self.pause(0.2)
            self.why()
            await asyncio.gather(*tasks)
            tasks.clear()

            c.print(
                "\n[bold]3. No starvation[/bold]: a 20 GiB job waits while 2 GiB jobs "
                "keep arriving; they cannot take the memory it is waiting for"
            )
            spawn("reindex-a", "8G", "normal", load_s=0.1, run_s=2.0)
            spawn("reindex-b", "8G", "normal", load_s=0.1, run_s=2.5)
            await self.pause(0.4)
            spawn("big-train", "20G", "normal", load_s=0.2, run_s=0.5)
            for i in range(6):
                await self.pause(0.5)
                spawn(f"small-{i}", "2G", "normal", load_s=0.1, run_s=0.3)
                if i == 1:
                    self.why()
            await asyncio.gather(*tasks)
            stats = self.arbiter.stats()
            c.print(
                f"\n[bold]done[/bold]: {stats.counters.get('granted', 0)} grants, "
                f"{stats.counters.get('preemptions', 0)} preemption(s), never more than "
                f"{format_mb(self.gpu.total_mb)} committed, never two loads at once."
            )
