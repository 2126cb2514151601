"""python -m driver: deploy, restart, verify, validate, status, rollback, history.

Only argparse is imported at start-up: `--help` answers at once (bench/driver_help.py).
"""

from __future__ import annotations

import argparse
import sys

from driver import exitcodes

PLAYBOOKS = {
    "deploy": (
        "playbooks/deploy.yml",
        "install and configure GPU nodes: CUDA, ml-env, SGLang and its patches, the units",
    ),
    "restart": (
        "playbooks/restart.yml",
        "safe restart: validate, stop, clean GPUs, start, generate, verify; roll back on failure",
    ),
    "verify": (
        "playbooks/verify.yml",
        "verify running servers: unit, drift, GPU processes, generation, accept length, tok/s",
    ),
    "validate": (
        "playbooks/validate.yml",
        "check the configuration with SGLang's own parser on each host; changes nothing",
    ),
    "status": (
        "playbooks/status.yml",
        "every instance at a glance: unit, profile, drift, GPU memory, health, accept length",
    ),
    "rollback": ("playbooks/rollback.yml", "put the last-known-good configuration back, restart and verify it"),
}

EPILOG = "exit codes:\n" + "\n".join(f"  {code:>3}  {meaning}" for code, meaning in sorted(exitcodes.MEANING.items()))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m driver",
        description="Deploy and operate SGLang servers (sglang-deploy).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-i", "--inventory", help="inventory (default: the local lab, inventory/lab/hosts.yml)")
    common.add_argument("--limit", help="hosts or groups to act on (Ansible's --limit)")
    common.add_argument("--profile", help="the named profile to run (sets sglang_profile)")
    common.add_argument(
        "-e",
        "--extra-vars",
        action="append",
        default=[],
        metavar="VARS",
        help="extra variables, as ansible-playbook -e takes them (repeatable)",
    )
    common.add_argument("--instance", action="append", default=[], help="act on this instance only (repeatable)")
    common.add_argument("--check", action="store_true", help="dry run: report what would change, change nothing")
    common.add_argument("--json", action="store_true", help="print one machine-readable result, no progress")
    common.add_argument("-v", "--verbose", action="count", default=0, help="Ansible verbosity (-v, -vv, ...)")
    common.add_argument("--svg", metavar="FILE", help="also save the summary as an SVG picture")
    for name, (_, text) in PLAYBOOKS.items():
        sp = sub.add_parser(
            name,
            parents=[common],
            help=text,
            description=text,
            epilog=EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        if name == "restart":
            sp.add_argument(
                "--no-rollback", action="store_true", help="leave a failed restart stopped instead of rolling back"
            )
            sp.add_argument(
                "--force-stop",
                action="store_true",
                help="also kill other users' processes holding the instance's GPUs (never done otherwise)",
            )
    h = sub.add_parser(
        "history", help="the run ledger; --compare puts profiles side by side", description="The run ledger."
    )
    h.add_argument("--compare", action="store_true", help="profiles side by side from the recorded measurements")
    h.add_argument("-n", "--last", type=int, default=20, help="how many runs to list")
    h.add_argument("--json", action="store_true", help="machine-readable output")
    return p


def extravars(args: argparse.Namespace) -> list[str]:
    import json

    out = list(args.extra_vars)
    if args.profile:
        out.append(json.dumps({"sglang_profile": args.profile}))
    if args.instance:
        out.append(json.dumps({"sglang_service_instances_selected": args.instance}))
    if getattr(args, "no_rollback", False):
        out.append(json.dumps({"sglang_service_rollback": False}))
    if getattr(args, "force_stop", False):
        out.append(json.dumps({"sglang_service_stop_policy": "force"}))
    return out


def run_playbook(args: argparse.Namespace, argv: list[str]) -> int:
    import signal
    import time

    from driver import display, events, ledger, runner

    tracker = events.Tracker(args.command)
    book = ledger.Ledger()
    run_id = book.start(args.command, argv, args.inventory, args.profile)
    record = book.events_dir(run_id) / "events.jsonl"
    interrupted = {"flag": False}

    def on_sigint(signum, frame):
        if interrupted["flag"]:
            raise KeyboardInterrupt
        interrupted["flag"] = True
        print("\ninterrupt: stopping the run (Ctrl-C again to abandon it)...", file=sys.stderr)

    previous = signal.signal(signal.SIGINT, on_sigint)
    t0 = time.monotonic()
    job = runner.Job(
        playbook=PLAYBOOKS[args.command][0],
        inventory=args.inventory,
        limit=args.limit,
        extravars=extravars(args),
        check=args.check,
        verbosity=args.verbose,
    )
    try:
        with display.Progress(tracker, quiet=args.json) as progress:

            def on_event(event: dict) -> None:
                tracker.handle(event)
                progress.update()

            outcome = runner.run(job, on_event, lambda: interrupted["flag"], record=record)
    finally:
        signal.signal(signal.SIGINT, previous)
    code = tracker.exit_code(outcome.status, outcome.rc, interrupted["flag"])
    book.finish(
        run_id,
        code,
        exitcodes.MEANING.get(code, "?"),
        round(time.monotonic() - t0, 1),
        list(tracker.hosts),
        tracker.measurements(),
        str(record),
    )
    book.close()
    if args.json:
        display.as_json(tracker, code, run_id)
    else:
        display.summary(tracker, code, run_id, svg=args.svg)
        if code == exitcodes.INTERRUPTED:
            print("interrupted; hosts were left so:", file=sys.stderr)
            for line in tracker.left_in():
                print(f"  {line}", file=sys.stderr)
    return code


def history(args: argparse.Namespace) -> int:
    import json

    from driver import ledger

    book = ledger.Ledger()
    data = book.compare() if args.compare else book.runs(args.last)
    book.close()
    if args.json:
        print(json.dumps(data, default=str))
        return exitcodes.OK
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if args.compare:
        table = Table(title="profiles, from the recorded measurements")
        for col in (
            "profile",
            "measurements",
            "median tok/s",
            "best tok/s",
            "median accept len",
            "verified running",
            "config hashes",
            "last measured",
        ):
            table.add_column(col)
        for r in data:
            table.add_row(
                r["profile"],
                str(r["measurements"]),
                str(r["median_tokens_per_s"]),
                str(r["best_tokens_per_s"]),
                str(r["median_accept_length"]),
                r["verified_running"],
                ", ".join(r["config_hashes"]) or "-",
                r["last_measured"],
            )
    else:
        table = Table(title=f"last {args.last} runs")
        for col in (
            "run",
            "started",
            "user",
            "command",
            "hosts",
            "profile",
            "config",
            "exit",
            "outcome",
            "s",
            "tok/s",
            "accept",
        ):
            table.add_column(col)
        for r in data:
            ms = r["measurements"]
            tok = ", ".join(f"{m['tokens_per_s']}" for m in ms if m["tokens_per_s"] is not None) or "-"
            acc = ", ".join(f"{m['accept_length']}" for m in ms if m["accept_length"] is not None) or "-"
            table.add_row(
                str(r["id"]),
                r["started_at"],
                r["user"],
                r["command"],
                r["hosts"] or "-",
                r["profile"] or "-",
                r["config_hash"] or "-",
                str(r["exit_code"]),
                r["outcome"] or "-",
                str(r["duration_s"]),
                tok,
                acc,
            )
    console.print(table)
    return exitcodes.OK


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    if args.command == "history":
        return history(args)
    return run_playbook(args, argv)
