"""What the operator sees: live progress per host, then the summary table (rich), or JSON."""

from __future__ import annotations

import json
import os
import sys
import time

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import job as jobs
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import outcomes
from driver import exitcodes
from driver.events import NOT_BEGUN, WAITS, Tracker

# Results shown green: the host ended well, or the instance serves (a restart's rollback shows yellow).
GOOD = outcomes.SUCCESS | {outcomes.ROLLED_BACK, "ok"}
# Output that is no terminal's (a pipe, a file, CI): as wide as the widest line, so no cell is cut to fit
# 80 columns; rich's own width where there is a terminal (or $COLUMNS says).
WIDE = 1000
# The SVG picture's width when there is no terminal to take it from.
SVG_WIDTH = 140


def console(stderr: bool = False, record: bool = False, width: int | None = None):
    """A rich Console that never truncates a table to fit a pipe."""
    from rich.console import Console

    c = Console(stderr=stderr, record=record, width=width)
    if width is None and not c.is_terminal and not os.environ.get("COLUMNS"):
        c = Console(stderr=stderr, record=record, width=WIDE)
    return c


def table(title: str, columns, **kw):
    """A rich Table whose cells fold rather than end in "…" on a narrow terminal: nothing is lost."""
    from rich.table import Table

    t = Table(title=title, **kw)
    for col in columns:
        name, justify = col if isinstance(col, tuple) else (col, "left")
        t.add_column(name, justify=justify, overflow="fold")
    return t


class Progress:
    """Live per-host phase and time in it, on a terminal; one line per phase change elsewhere."""

    def __init__(self, tracker: Tracker, quiet: bool = False):
        self.tracker = tracker
        self.quiet = quiet
        self.live = None
        self.seen: dict[str, str] = {}
        self.t0 = time.monotonic()
        self.since: dict[str, float] = {}
        if not quiet and sys.stderr.isatty():
            from rich.console import Console
            from rich.live import Live

            self.live = Live(
                self.render(),
                console=Console(stderr=True),
                refresh_per_second=4,
                transient=True,
                get_renderable=self.render,
            )

    def __enter__(self) -> Progress:
        if self.live:
            self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.live:
            self.live.__exit__(*exc)

    def say(self, message: str) -> None:
        """A line for the operator now (an interruption), above the live display where there is one."""
        if self.live:
            self.live.console.print(message, markup=False, highlight=False)
        else:
            print(f"\n{message}", file=sys.stderr, flush=True)

    def update(self) -> None:
        """Called after each event."""
        for h in self.tracker.hosts.values():
            now = progress_line(h)
            key = f"{h.phase}/{h.status}/{now}"
            if self.seen.get(h.name) != key:
                self.seen[h.name] = key
                self.since[h.name] = time.monotonic()
                if not self.live and not self.quiet:
                    wait = f" (waiting for: {WAITS[h.phase]})" if h.phase in WAITS and h.status == "running" else ""
                    if now:
                        wait = f": {now}"
                    print(
                        f"[{time.monotonic() - self.t0:6.1f}s] {h.name}: {h.phase} {h.status}{wait}",
                        file=sys.stderr,
                        flush=True,
                    )

    def render(self):
        from rich.table import Table

        table = Table(title=f"sglang-deploy {self.tracker.command}", expand=False)
        for col in ("host", "phase", "for", "doing"):
            table.add_column(col)
        for h in sorted(self.tracker.hosts.values(), key=lambda x: x.name):
            for_s = time.monotonic() - self.since.get(h.name, time.monotonic())
            doing = WAITS.get(h.phase, h.task) if h.status == "running" else h.status
            if h.status == "running" and h.phase in WAITS:
                doing = f"{h.task}: {doing}"
            line = progress_line(h) if h.status == "running" else ""
            if line:
                doing = line
            table.add_row(h.name, h.phase, f"{for_s:.0f}s", doing)
        return table


def progress_line(h) -> str:
    """What a host's detached restarts say now: "main: start, loading weights 1/2 (50%) for 12s", flagged when
    stalled ("no change for 4m10s, last line: ..."); "" when none is running."""
    parts = []
    for name, p in sorted(h.progress.items()):
        if p.get("done") or not p.get("phase"):
            continue
        what = f"{name}: {p['phase']}"
        if p.get("step"):
            what += f", {p['step']}" + (f" {p['detail']}" if p.get("detail") else "")
        if p.get("stalled_s"):
            what += f" - NO CHANGE for {duration(p['stalled_s'])}, last line: {p.get('last_line') or 'none'}"
        parts.append(what)
    return "; ".join(parts)


def number(value: float | None, digits: int) -> str:
    """One column, one format: `digits` after the point ("4.4" and "4.291" never side by side); "-" for none."""
    return "-" if value is None else f"{value:.{digits}f}"


def duration(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m}m{s:02d}s" if m else f"{s}s"


def status_table(tracker: Tracker, exit_code: int):
    t = table(
        f"sglang-deploy status (exit {exit_code})",
        (
            "host",
            "instance",
            "unit",
            "running profile",
            "drift",
            "GPU memory",
            "health",
            "accept len",
            "tok/s (known-good)",
        ),
    )
    for h in sorted(tracker.hosts.values(), key=lambda x: x.name):
        for name, res in sorted(h.instances.items()):
            mem = res.get("gpu_memory_mib") or {}
            used = sum(v or 0 for v in mem.values())
            kg = res.get("known_good") or {}
            health = res.get("health")
            if res.get("outcome") == NOT_BEGUN:
                t.add_row(h.name, name, f"[yellow]{NOT_BEGUN}[/yellow]", *["-"] * 6)
                continue
            t.add_row(
                h.name,
                name,
                res.get("state", "?"),
                res.get("running_profile") or "-",
                "[red]DRIFT[/red]" if res.get("drift") else "no",
                f"{used / 1024:.1f} GiB on {len(mem)} GPUs",
                "-" if health is None else "[green]ok[/green]" if health else "[red]down[/red]",
                str(res.get("accept_length") if res.get("accept_length") is not None else "-"),
                str(kg.get("tokens_per_s") or "-"),
            )
        if not h.instances:
            t.add_row(h.name, "-", h.status, "-", "-", "-", "-", "-", "-")
    return t


def summary(tracker: Tracker, exit_code: int, run_id: int | None, svg: str | None = None) -> None:
    out = console()
    _summary(out, tracker, exit_code, run_id)
    if svg:
        import io

        from rich.console import Console

        width = out.width if out.is_terminal or os.environ.get("COLUMNS") else SVG_WIDTH
        picture = Console(record=True, file=io.StringIO(), width=width)
        _summary(picture, tracker, exit_code, run_id)
        picture.save_svg(svg, title=f"python -m driver {tracker.command}")


def gateway_table(tracker: Tracker):
    """What every gateway thinks of each instance (the status playbook's VIEW_FACT); None when none was read."""
    if not tracker.gateway_view:
        return None
    t = table("what every gateway thinks", ("host", "instance", "gateway", "listed", "healthy", "in flight", "circuit", "note"))  # fmt: skip

    def said(value, yes="yes", no="[red]no[/red]"):
        return "-" if value is None else yes if value is True else no if value is False else str(value)

    for r in tracker.gateway_view:
        circuit = r.get("circuit")
        t.add_row(
            str(r.get("host", "?")),
            str(r.get("instance", "?")),
            str(r.get("gateway", "?")),
            said(r.get("listed"), no="[red]NOT LISTED[/red]"),
            said(r.get("healthy"), yes="[green]ok[/green]", no="[red]unhealthy[/red]")
            + (f" ({r['status']})" if r.get("status") else ""),
            "-" if r.get("in_flight") is None else f"{r['in_flight']:g}",
            "-" if circuit is None else circuit if circuit == "closed" else f"[red]{circuit}[/red]",
            str(r.get("why") or ""),
        )
    return t


def _summary(console, tracker: Tracker, exit_code: int, run_id: int | None) -> None:
    """The run's summary on console: the terminal's, or the one an SVG picture is recorded from."""
    if tracker.command == "status":
        _status_summary(console, tracker, exit_code)
    else:
        _results_summary(console, tracker, exit_code)
    if run_id is not None:
        console.print(f"run {run_id} recorded in the ledger (python -m driver history)", style="dim")


def _status_summary(console, tracker: Tracker, exit_code: int) -> None:
    """status: each instance, what every gateway thinks of it, the restart workers a host still holds, failures."""
    console.print(status_table(tracker, exit_code))
    view = gateway_table(tracker)
    if view is not None:
        console.print(view)
    for h in sorted(tracker.hosts.values(), key=lambda x: x.name):
        for name, res in sorted(h.instances.items()):
            for j in res.get("jobs") or []:  # restart workers the host still holds
                console.print(f"{h.name}/{name}: {jobs.describe(j)}", markup=False, highlight=False)
                for line in j.get("journal") or []:
                    console.print(f"    {line}", markup=False, highlight=False, style="dim")
    for h in tracker.hosts.values():
        for f in h.failures:
            console.print(f"{h.name}: {f.task}: {f.message}", markup=False, highlight=False)


def _results_summary(console, tracker: Tracker, exit_code: int) -> None:
    """Every other command: a row per host and instance, each one's detail, the playbook's report, the causes."""
    t, details = results_table(tracker, exit_code)
    console.print(t)
    for line in details:
        console.print(f"  {line}", highlight=False, markup=False)
    for line in tracker.report:  # the playbook's own account: where every replica stands, what the router lists
        console.print(line, highlight=False, markup=False)
    _causes(console, tracker)
    if (
        exit_code not in (exitcodes.OK, exitcodes.INTERRUPTED)
        and not any(h.failures for h in tracker.hosts.values())
        and tracker.messages
    ):
        console.print("Ansible said:", style="bold")
        console.print("\n".join(tracker.messages[-30:]), markup=False, highlight=False)


def results_table(tracker: Tracker, exit_code: int):
    """(the table of a command's rows, each row's detail line where it has one)."""
    t = table(
        f"sglang-deploy {tracker.command}: {exitcodes.MEANING.get(exit_code, '?')} (exit {exit_code})",
        (
            ("host", "left"),
            ("instance", "left"),
            ("roles" if tracker.command == "deploy" else "phase reached", "left"),
            ("result", "left"),
            ("seconds", "right"),
            ("tok/s", "right"),
            ("accept len", "right"),
        ),
    )
    details = []
    for row in tracker.rows():
        style = "green" if row["result"] in GOOD else "red"
        if (row["result"] == outcomes.ROLLED_BACK and tracker.command == "restart") or row["result"] == NOT_BEGUN:
            style = "yellow"
        t.add_row(
            row["host"],
            row["instance"] or "-",
            (row.get("roles") or row["phase"]) if tracker.command == "deploy" else row["phase"],
            f"[{style}]{row['result']}[/{style}]",
            number(row["seconds"], 1),
            number(row["tokens_per_s"], 1),
            number(row["accept_length"], 2),
        )
        if row["detail"]:
            details.append(f"{row['host']}{'/' + row['instance'] if row['instance'] else ''}: {row['detail']}")
    return t, details


def _causes(console, tracker: Tracker) -> None:
    """The cause, right there: each failed instance's traceback (or journal tail), each host's failures."""
    for h in tracker.hosts.values():
        for name, res in h.instances.items():
            failure = res.get("failure") or {}
            if failure.get("traceback"):
                console.print(f"\n{h.name}/{name}: traceback from the journal ({failure.get('phase')}):", style="bold")
                console.print("\n".join(failure["traceback"][-15:]), markup=False, highlight=False)
            elif failure.get("journal_tail"):
                console.print(f"\n{h.name}/{name}: journal tail ({failure.get('phase')}):", style="bold")
                console.print("\n".join(failure["journal_tail"][-8:]), markup=False, highlight=False)
        for f in h.failures:
            if not h.instances:
                console.print(f"{h.name}: {f.task}: {f.message}", markup=False, highlight=False)


def as_json(
    tracker: Tracker, exit_code: int, run_id: int | None, left: list[str] | None = None, evidence: str | None = None
) -> None:
    """The one result document, on stdout (progress and messages go to stderr)."""
    out = tracker.result(exit_code)
    out["run_id"] = run_id
    out["evidence"] = evidence
    if left is not None:
        out["left"] = left
    print(json.dumps(out, default=str), flush=True)
