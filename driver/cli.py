"""python -m driver: the commands of driver/commands.py's table (deploy, restart, verify, validate, status, rollback,
preflight, collect, rollout, tune, history, report), parsed and dispatched; here too the run of a command's playbook
and the ledger's history.

Installed (pip install .), the same CLI is the console script sglang-deploy (console() below, pyproject.toml).
Only argparse is imported at start-up: `--help` answers at once (bench/driver_help.py).
"""

from __future__ import annotations

import argparse
import sys

from driver import commands, exitcodes


def run_playbook(args: argparse.Namespace) -> int:
    """Check the inventory, record the run (its argv, redacted), run its playbook, record how it ended, show it.

    SIGINT and SIGTERM are the driver's own from the start to the end (driver/interrupts.py): no Ctrl-C raises
    KeyboardInterrupt, and the ledger row gets its exit code whatever happens.
    """
    from driver.interrupts import Interrupts

    interrupts = Interrupts(args.command)
    previous = interrupts.install()
    try:
        return _run_playbook(args, args.argv, interrupts)
    except KeyboardInterrupt:  # raised by code that installs its own handler: the run was recorded already
        return exitcodes.INTERRUPTED
    finally:
        Interrupts.restore(previous)


def _run_playbook(args: argparse.Namespace, argv: list[str], interrupts) -> int:
    import time

    from driver import inventory

    playbook = commands.playbook_of(args)
    try:
        inventory.check(args.inventory, args.limit, playbook, args.instance, commands.extravars(args))
    except inventory.InventoryError as e:
        return commands.usage_error(args, str(e))
    if interrupts.interrupted:
        print("interrupted before anything ran", file=sys.stderr)
        return exitcodes.INTERRUPTED

    from driver import display, events, evidence, ledger, redact, runner, step

    # status --drift: a table of its own (host, its state, what moved).
    tracker = events.Tracker("drift" if getattr(args, "drift", False) else args.command)
    redactor = redact.Redactor()
    book = ledger.Ledger()
    run_id = book.start(args.command, redactor.argv(argv), args.inventory, args.profile)
    run_dir = book.events_dir(run_id)
    record = run_dir / "events.jsonl"
    interrupts.arm(run_dir / "cancel")
    job = step.job(
        playbook,
        run_dir,
        args.command,
        inventory=args.inventory,
        limit=args.limit,
        extravars=commands.extravars(args),
        redactor=redactor,
        check=args.check,
        verbosity=args.verbose,
        stall_s=getattr(args, "stall_after", 300.0),
    )
    t0 = time.monotonic()
    code = exitcodes.FAILED  # what the row says if the driver itself fails below
    outcome = None
    put_back: list[str] = []  # an abandoned rollout's put-back, line by line
    try:
        with display.Progress(tracker, quiet=args.json) as progress:
            interrupts.say = progress.say

            def on_event(event: dict) -> None:
                tracker.handle(event)
                progress.update()
                interrupts.announce()

            outcome = step.run(job, on_event, interrupts, record)
            interrupts.announce()
            if args.command == "rollout" and interrupts.abandoned and not args.check:
                from driver import putback

                progress.say("putting back into the router what serves and is out (Ctrl-C again to stop that too)")
                put_back = putback.run(job, lambda: interrupts.count >= 3, run_dir / "putback.jsonl")
                for line in put_back:
                    progress.say(line)
        code = tracker.exit_code(outcome.status, outcome.rc, interrupts.interrupted)
    finally:
        if interrupts.interrupted:  # also a signal after the runner ended, or the driver's own failure above
            code = exitcodes.worst([code, exitcodes.INTERRUPTED])
        try:
            import json  # not at start-up: only argparse is (--help answers at once)

            with runner.open_private(record) as sink:
                status, rc = (outcome.status, outcome.rc) if outcome else (None, None)
                sink.write(json.dumps(events.result_event(status, rc, interrupts.interrupted, code)) + "\n")
        except OSError as exc:
            print(f"the run's stream {record} lacks its result: {exc}", file=sys.stderr)
        bundle = None
        try:
            bundle = evidence.package(run_dir, run_id)
            if bundle:
                book.set_evidence(run_id, str(bundle))
            evidence.prune(run_dir.parent)
        except OSError as exc:
            print(f"the run's evidence bundles stay under {evidence.directory(run_dir)}: {exc}", file=sys.stderr)
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
    left = tracker.left_in(abandoned=interrupts.abandoned) + put_back if interrupts.interrupted else None
    if args.json:
        display.as_json(tracker, code, run_id, left=left, evidence=str(bundle) if bundle else None)
    else:
        display.summary(tracker, code, run_id, svg=args.svg)
        if bundle:
            print(f"crash evidence of this run: {bundle}")
    if left is not None:
        print("interrupted; hosts were left so:", file=sys.stderr)
        for line in left:
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
    from driver import display

    if args.compare:
        table = display.table(
            "profiles, from the recorded measurements",
            (
                "profile",
                "measurements",
                "median tok/s",
                "best tok/s",
                "median accept len",
                "verified running",
                "median load s",
                "median graphs s",
                "config hashes",
                "last measured",
            ),
        )
        for r in data:
            table.add_row(
                r["profile"],
                str(r["measurements"]),
                str(r["median_tokens_per_s"]),
                str(r["best_tokens_per_s"]),
                str(r["median_accept_length"]),
                r["verified_running"],
                str(r["median_load_s"] if r["median_load_s"] is not None else "-"),
                str(r["median_capture_s"] if r["median_capture_s"] is not None else "-"),
                ", ".join(r["config_hashes"]) or "-",
                r["last_measured"],
            )
    else:
        table = display.table(
            f"last {args.last} runs",
            (
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
            ),
        )
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
    display.console().print(table)
    return exitcodes.OK


def console() -> None:
    """The console script sglang-deploy (an installed driver): python -m driver under its own name."""
    commands.use_console_name()
    sys.exit(main())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = commands.parser().parse_args(argv)
        args.argv = argv  # what a run records (redacted): the arguments parsed, not sys.argv when called with others
        return commands.handler(args.command)(args)
    except KeyboardInterrupt:  # before the driver's own handler, or after it: nothing half-recorded, no traceback
        print("\ninterrupted", file=sys.stderr)
        return exitcodes.INTERRUPTED
