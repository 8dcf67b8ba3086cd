"""``gpu-arbiter simulate``: one trace, every policy, one comparison (table or JSON) and plots."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.table import Table

from ..core import InvalidInput
from ..sim import (
    KINDS,
    POLICIES,
    PRESETS,
    compare,
    dump_trace,
    generate,
    load_trace,
    parse_cluster,
    parse_policies,
    summarize,
)
from ..sim.report import targets

GENERATE_HELP = f"Generate a seeded trace of this kind ({', '.join(KINDS)}; join with +)."
CLUSTER_HELP = (
    "Groups of W workers with N GPUs of SIZE (1x24G, 4w:2x24G, 2w:8x80G@sm_90) joined "
    f"by +, or a preset ({', '.join(PRESETS)})."
)
POLICY_HELP = f"'all' or names joined by ',' ({', '.join(POLICIES)})."


def _fail(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    raise typer.Exit(2)


def _number(name: str, text: str, *, low: float, high: float, integer: bool = False) -> float:
    try:
        value = int(text) if integer else float(text)
    except ValueError:
        _fail(f"{name}: {text!r} is not {'an integer' if integer else 'a number'}")
    if not math.isfinite(value) or not low <= value <= high:
        _fail(f"{name}: {text!r} is outside {low:g}..{high:g}")
    return value


def simulate(
    trace: str = typer.Argument(None, help="A JSON-lines trace file (or use --generate)."),
    generate_kind: str = typer.Option(None, "--generate", "-g", help=GENERATE_HELP),
    seed: str = typer.Option("1", help="Seed of the generated trace."),
    cluster: str = typer.Option("single", help=CLUSTER_HELP),
    policy: str = typer.Option("all", help=POLICY_HELP),
    hours: str = typer.Option("4", help="Hours of generated arrivals."),
    keep_alive: str = typer.Option("300", help="Seconds a holder keeps an idle model warm."),
    stop: str = typer.Option("2", help="Seconds a preempted holder takes to stop."),
    output: str = typer.Option("table", "--output", "-o", help="table or json."),
    plots: str = typer.Option(None, help="Write wait_cdf.png and memory_utilization.png here."),
    save_trace: str = typer.Option(None, help="Also write the trace used to this file."),
) -> None:
    """Compare ours with the baselines on one trace: waits, memory use, safety."""
    if output not in ("table", "json"):
        _fail(f"output: {output!r} is not table or json")
    if trace is not None and generate_kind is not None:
        _fail("give a TRACE file or --generate, not both")
    options = {
        "keep_alive_s": _number("keep-alive", keep_alive, low=0, high=86400),
        "stop_s": _number("stop", stop, low=0, high=3600),
    }
    try:
        spec = parse_cluster(cluster)
        names = parse_policies(policy)
        if trace is not None:
            requests = load_trace(trace)
            source: dict[str, Any] = {"trace": trace}
        else:
            kind = generate_kind or "mixed"
            number = int(_number("seed", seed, low=0, high=2**63, integer=True))
            span = _number("hours", hours, low=0.001, high=720)
            requests = generate(kind, number, spec, span)
            source = {"generate": kind, "seed": number, "hours": span}
        if save_trace is not None:
            Path(save_trace).write_text(dump_trace(requests), encoding="utf-8")
        recordings = compare(requests, spec, names, **options)
    except InvalidInput as exc:
        _fail(str(exc))
    except OSError as exc:
        _fail(f"cannot write: {exc}")
    summaries = [summarize(rec) for rec in recordings]
    result = {
        **source,
        "cluster": spec.spec,
        "requests": len(requests),
        "policies": summaries,
        "targets": targets(summaries),
    }
    if plots is not None:
        from ..sim.plots import write_plots

        title = f"{generate_kind or 'mixed' if trace is None else Path(trace).name} on {spec.spec}"
        try:
            result["plots"] = [str(p) for p in write_plots(recordings, Path(plots), title)]
        except OSError as exc:
            _fail(f"plots: {exc}")
    if output == "json":
        print(json.dumps(result, indent=2, sort_keys=True))
    else:
        _render(Console(highlight=False, width=None if sys.stdout.isatty() else 160), result)


def _fmt_wait(summary: dict[str, Any], cls: str, *figures: str) -> str:
    wait = summary["wait"].get(cls)
    if wait is None:
        return "-"
    return " / ".join(_seconds(wait[f]) for f in figures)


def _seconds(value: float) -> str:
    return f"{value:.0f}" if value >= 10 else f"{value:.1f}"


def _render(console: Console, result: dict[str, Any]) -> None:
    what = (
        f"trace {result['trace']}"
        if "trace" in result
        else f"--generate {result['generate']} --seed {result['seed']} --hours {result['hours']:g}"
    )
    table = Table(title=f"{what} on {result['cluster']}: {result['requests']} requests")
    columns = (
        "policy",
        "interactive wait s\np50 / p95 / p99",
        "normal wait s\np50 / p99",
        "batch wait s\np99 / max",
        "mem\nutil",
        "busy\nmem",
        "GPU-h\nper h",
        "preempted\n(wasted GPU-s)",
        "over-\ncommit",
        "concurrent\nloads",
        "violations",
        "unfinished",
    )
    for column in columns:
        table.add_column(column, justify="left" if column == "policy" else "right")
    for s in result["policies"]:
        table.add_row(
            s["policy"],
            _fmt_wait(s, "interactive", "p50_s", "p95_s", "p99_s"),
            _fmt_wait(s, "normal", "p50_s", "p99_s"),
            _fmt_wait(s, "batch", "p99_s", "max_s"),
            f"{s['mem_util']:.0%}",
            f"{s['busy_mem_util']:.0%}",
            f"{s['work_per_hour']:.2f}",
            f"{s['preemptions']} ({s['wasted_run_s']:.0f})",
            str(s["overcommits"]),
            str(s["concurrent_loads"]),
            str(s["violations"]) if s["policy"] == "ours" else "-",
            str(s["unfinished"]),
        )
    console.print(table)
    _render_targets(console, result["targets"])
    for path in result.get("plots", []):
        console.print(f"wrote {path}")


def _verdict(met: bool | None) -> str:
    return "[green]met[/green]" if met else "[red]not met[/red]"


def _render_targets(console: Console, t: dict[str, Any]) -> None:
    if not t:
        return
    p99 = t.get("interactive_p99")
    if p99 is not None and "best_baseline" in p99:
        line = (
            f"interactive p99 <= 1/10 of best baseline: ours {_seconds(p99['ours_s'])} s vs "
            f"{p99['best_baseline']} {_seconds(p99['best_s'])} s: {_verdict(p99['met_vs_best'])}"
        )
        if "best_safe_baseline" in p99:
            line += (
                f"; vs best safe baseline {p99['best_safe_baseline']} "
                f"{_seconds(p99['best_safe_s'])} s: {_verdict(p99['met_vs_best_safe'])}"
            )
        console.print(line)
    util = t["mem_util"]
    if "best_baseline" in util:
        console.print(
            f"memory utilization >= 95 % of best baseline: ours {util['ours']:.1%} vs "
            f"{util['best_baseline']} {util['best']:.1%}: {_verdict(util['met_vs_best'])}"
        )
    safety = t["safety"]
    console.print(
        f"zero over-commit, concurrent loads, violations: {safety['overcommits']}, "
        f"{safety['concurrent_loads']}, {safety['violations']}: {_verdict(safety['met'])}"
    )
    batch = t.get("batch_wait")
    if batch is not None:
        console.print(
            f"longest batch wait (bounded: every batch request started): ours "
            f"{_seconds(batch['ours_longest_s'])} s: {_verdict(batch['met'])}"
        )
