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
    SleepTier,
    compare,
    dump_trace,
    generate,
    load_trace,
    parse_cluster,
    parse_policies,
    summarize,
)
from ..sim.azure import AzureMapping, convert, parse_batch, parse_pair, parse_service, read_azure
from ..sim.report import offered_load, targets

AZURE_CLUSTER = "2x24G"  # --azure's default cluster: its default mapping fits there

GENERATE_HELP = f"Generate a seeded trace of this kind ({', '.join(KINDS)}; join with +)."
CLUSTER_HELP = (
    "Groups of W workers with N GPUs of SIZE (1x24G, 4w:2x24G, 2w:8x80G@sm_90) joined "
    f"by +, or a preset ({', '.join(PRESETS)}). Default: single; with --azure, "
    f"{AZURE_CLUSTER} (the trace's defaults fit it; on single they ask for about twice what "
    "it holds)."
)
POLICY_HELP = (
    f"'all' (ours and the baselines), 'tiers' (ours, ours-sleep, ours-stop) or names joined "
    f"by ',' ({', '.join(POLICIES)})."
)
SLEEP_HELP = "ours-sleep: {}"
AZURE_HELP = (
    "Replay the Azure LLM inference trace (2023, CC-BY 4.0): a folder holding "
    "AzureLLMInferenceTrace_conv.csv and/or _code.csv. Mapping: the --azure-* options; "
    "--seed seeds the thinning and the batch jobs."
)
SERVICE_HELP = "MODEL:SIZE:PRIORITY:LOAD_S the {} service maps to, or 'none'."


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
    cluster: str = typer.Option(None, help=CLUSTER_HELP),
    policy: str = typer.Option("all", help=POLICY_HELP),
    hours: str = typer.Option("4", help="Hours of generated arrivals."),
    keep_alive: str = typer.Option("300", help="Seconds a holder keeps an idle model warm."),
    stop: str = typer.Option("2", help="Seconds a preempted holder takes to stop."),
    output: str = typer.Option("table", "--output", "-o", help="table or json."),
    plots: str = typer.Option(None, help="Write wait_cdf.png and memory_utilization.png here."),
    save_trace: str = typer.Option(None, help="Also write the trace used to this file."),
    azure: str = typer.Option(None, help=AZURE_HELP),
    azure_load: str = typer.Option(
        "0.01", help="Fraction of the trace's requests kept (0..1]; 1 replays every one."
    ),
    azure_conv: str = typer.Option(
        "chat-14b:16G:interactive:12", help=SERVICE_HELP.format("conversation")
    ),
    azure_code: str = typer.Option("code-14b:16G:normal:12", help=SERVICE_HELP.format("code")),
    azure_tokens: str = typer.Option(
        "4000:40", help="PREFILL:DECODE tokens/s of one request on a replica."
    ),
    azure_concurrency: str = typer.Option("16", help="Requests one replica serves at once."),
    azure_gap: str = typer.Option(
        "30", help="Requests closer than this (s) join one busy period of a replica."
    ),
    azure_batch: str = typer.Option(
        "1200:20G:30:600-2400",
        help="Synthetic batch jobs EVERY_S:SIZE:LOAD_S:MIN_S-MAX_S (mean seconds between "
        "arrivals, size, load, run), or 'none'.",
    ),
    sleep_after: str = typer.Option(
        "60", help=SLEEP_HELP.format("seconds an idle-warm model waits before it sleeps.")
    ),
    sleep_resident: str = typer.Option(
        "0.15", help=SLEEP_HELP.format("fraction of its size a sleeping model keeps (0..1).")
    ),
    sleep_s: str = typer.Option(
        "2", help=SLEEP_HELP.format("seconds until the probe shows a sleeping model's memory free.")
    ),
    wake_s: str = typer.Option(
        "1", help=SLEEP_HELP.format("seconds a woken model takes to run once its memory is back.")
    ),
) -> None:
    """Compare ours with the baselines on one trace: waits, memory use, safety."""
    if output not in ("table", "json"):
        _fail(f"output: {output!r} is not table or json")
    if sum(x is not None for x in (trace, generate_kind, azure)) > 1:
        _fail("give one of a TRACE file, --generate or --azure")
    options = {
        "keep_alive_s": _number("keep-alive", keep_alive, low=0, high=86400),
        "stop_s": _number("stop", stop, low=0, high=3600),
    }
    tier = SleepTier(
        after_s=_number("sleep-after", sleep_after, low=0, high=86400),
        resident=_number("sleep-resident", sleep_resident, low=1e-9, high=1 - 1e-9),
        sleep_s=_number("sleep-s", sleep_s, low=0, high=3600),
        wake_s=_number("wake-s", wake_s, low=0, high=3600),
    )
    try:
        spec = parse_cluster(cluster or (AZURE_CLUSTER if azure is not None else "single"))
        names = parse_policies(policy)
        if trace is not None:
            requests = load_trace(trace)
            source: dict[str, Any] = {"trace": trace}
        elif azure is not None:
            number = int(_number("seed", seed, low=0, high=2**63, integer=True))
            mapping = _azure_mapping(
                number,
                azure_load,
                (azure_conv, azure_code),
                azure_tokens,
                azure_concurrency,
                azure_gap,
                azure_batch,
            )
            requests = convert(read_azure(azure), mapping)
            source = {"azure": azure, "seed": number, "load": mapping.load}
        else:
            kind = generate_kind or "mixed"
            number = int(_number("seed", seed, low=0, high=2**63, integer=True))
            span = _number("hours", hours, low=0.001, high=720)
            requests = generate(kind, number, spec, span)
            source = {"generate": kind, "seed": number, "hours": span}
        if save_trace is not None:
            Path(save_trace).write_text(dump_trace(requests), encoding="utf-8")
        recordings = compare(requests, spec, names, tier=tier, **options)
    except InvalidInput as exc:
        _fail(str(exc))
    except OSError as exc:
        _fail(f"cannot write: {exc}")
    summaries = [summarize(rec) for rec in recordings]
    offered = offered_load(requests, spec.total_mb)
    result = {
        **source,
        "cluster": spec.spec,
        **({"sleep": _tier_json(tier)} if "ours-sleep" in names else {}),
        "requests": len(requests),
        "offered_load": round(offered, 3),
        "policies": summaries,
        "targets": targets(summaries, offered),
    }
    if plots is not None:
        from ..sim.plots import write_plots

        title = f"{_source(result)} on {spec.spec}"
        try:
            result["plots"] = [str(p) for p in write_plots(recordings, Path(plots), title)]
        except OSError as exc:
            _fail(f"plots: {exc}")
    if output == "json":
        print(json.dumps(result, indent=2, sort_keys=True))
    else:
        _render(Console(highlight=False, width=None if sys.stdout.isatty() else 160), result)


def _azure_mapping(
    seed: int,
    load: str,
    services: tuple[str, str],
    tokens: str,
    concurrency: str,
    gap: str,
    batch: str,
) -> AzureMapping:
    prefill, decode = parse_pair(tokens, "azure-tokens")
    chosen = {
        name: parse_service(text)
        for name, text in zip(("conv", "code"), services, strict=True)
        if text.strip().lower() != "none"
    }
    return AzureMapping(
        services=chosen,
        load=_number("azure-load", load, low=1e-9, high=1),
        seed=seed,
        prefill_tps=prefill,
        decode_tps=decode,
        concurrency=int(_number("azure-concurrency", concurrency, low=1, high=10**6, integer=True)),
        gap_s=_number("azure-gap", gap, low=0, high=86400),
        batch=parse_batch(batch),
    )


def _tier_json(tier: SleepTier) -> dict[str, float]:
    return {
        "after_s": tier.after_s,
        "resident": tier.resident,
        "sleep_s": tier.sleep_s,
        "wake_s": tier.wake_s,
    }


def _fmt_wait(summary: dict[str, Any], cls: str, *figures: str) -> str:
    wait = summary["wait"].get(cls)
    if wait is None:
        return "-"
    return " / ".join(_seconds(wait[f]) for f in figures)


def _seconds(value: float) -> str:
    return f"{value:.0f}" if value >= 10 else f"{value:.1f}"


def _source(result: dict[str, Any]) -> str:
    if "trace" in result:
        return f"trace {result['trace']}"
    if "azure" in result:
        return f"--azure {result['azure']} --azure-load {result['load']:g} --seed {result['seed']}"
    return f"--generate {result['generate']} --seed {result['seed']} --hours {result['hours']:g}"


def _render(console: Console, result: dict[str, Any]) -> None:
    title = f"{_source(result)} on {result['cluster']}: {result['requests']} requests"
    table = Table(title=f"{title}, offered load {result['offered_load']:.2f}x capacity")
    columns = (
        "policy",
        "interactive wait s\np50 / p95 / p99",
        "normal wait s\np50 / p99",
        "batch wait s\np99 / max",
        "busy\nmem",
        "mem util\n(no idle)",
        "GPU-h\nper h",
        "cold loads\n(sleeps, wakes)",
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
            f"{s['busy_mem_util']:.0%}",
            f"{s['mem_util']:.0%} ({s['mem_util_no_idle']:.0%})",
            f"{s['work_per_hour']:.2f}",
            f"{s['loads']} ({s['sleeps']}, {s['wakes']})",
            f"{s['preemptions']} ({s['wasted_run_s']:.0f})",
            str(s["overcommits"]),
            str(s["concurrent_loads"]),
            str(s["violations"]) if s["policy"].startswith("ours") else "-",
            str(s["unfinished"]),
        )
    console.print(table)
    _render_targets(console, result["targets"])
    for path in result.get("plots", []):
        console.print(f"wrote {path}")


def _verdict(met: bool | None) -> str:
    return "[green]met[/green]" if met else "[red]not met[/red]"


_GOAL_LINES = {
    "interactive_p99": ("interactive p99 wait <= best safe baseline's", "{:.1f} s"),
    "normal_p99": ("normal p99 wait <= best safe baseline's", "{:.1f} s"),
    "batch_max": ("longest batch wait <= 1.5 x best safe baseline's", "{:.1f} s"),
    "busy_mem": ("busy memory >= 95 % of best safe baseline's", "{:.1%}"),
}


def _render_targets(console: Console, t: dict[str, Any]) -> None:
    if not t:
        return
    if "not_judged" in t:
        console.print(
            f"goals [red]not judged[/red]: {t['not_judged']['why']}: the trace asks for more "
            "busy memory-seconds than the cluster holds until its last run could end; no "
            "policy keeps up, every queue grows, and the waits measure the backlog"
        )
    for name, (label, unit) in _GOAL_LINES.items():
        goal = t.get(name)
        if goal is None:
            continue
        console.print(
            f"{label}: ours {unit.format(goal['ours'])} vs {goal['baseline']} "
            f"{unit.format(goal['theirs'])}: {_verdict(goal['met'])}"
        )
    safety = t["safety"]
    console.print(
        f"zero over-commit, concurrent loads, violations: {safety['overcommits']}, "
        f"{safety['concurrent_loads']}, {safety['violations']}: {_verdict(safety['met'])}"
    )
