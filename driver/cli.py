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
    from driver import inventory

    playbook = commands.playbook_of(args)
    try:
        inventory.check(args.inventory, args.limit, playbook, args.instance, commands.extravars(args))
    except inventory.InventoryError as e:
        return commands.usage_error(args, str(e))
    if interrupts.interrupted:
        print("interrupted before anything ran", file=sys.stderr)
        return exitcodes.INTERRUPTED
    run = _Run(args, argv, playbook, interrupts)
    try:
        run.play()
    finally:  # the ledger row ends whatever happened above: the driver's own failure too
        run.record()
    return run.show()


class _Run:
    """One command's run of its playbook: recorded in the ledger from the start, shown live as it goes, how it
    ended recorded (the stream's result event, the evidence bundle, the ledger row), then shown."""

    def __init__(self, args: argparse.Namespace, argv: list[str], playbook: str, interrupts):
        import time

        from driver import events, ledger, redact, step

        self.args, self.interrupts = args, interrupts
        # status --drift: a table of its own (host, its state, what moved).
        self.tracker = events.Tracker("drift" if getattr(args, "drift", False) else args.command)
        redactor = redact.Redactor()
        self.book = ledger.Ledger()
        self.run_id = self.book.start(args.command, redactor.argv(argv), args.inventory, args.profile)
        self.dir = self.book.events_dir(self.run_id)
        self.stream = self.dir / "events.jsonl"
        interrupts.arm(self.dir / "cancel")
        self.job = step.job(
            playbook,
            self.dir,
            args.command,
            inventory=args.inventory,
            limit=args.limit,
            extravars=commands.extravars(args),
            redactor=redactor,
            check=args.check,
            verbosity=args.verbose,
            stall_s=getattr(args, "stall_after", 300.0),
        )
        self.t0 = time.monotonic()
        self.code = exitcodes.FAILED  # what the row says if the driver itself fails below
        self.outcome = None
        self.put_back: list[str] = []  # an abandoned rollout's put-back, line by line
        self.bundle = None  # the run's crash evidence bundle, once packaged

    def play(self) -> None:
        """The playbook, its events shown live; after an abandoned rollout, the router's put-back."""
        from driver import display, step

        interrupts, tracker = self.interrupts, self.tracker
        with display.Progress(tracker, quiet=self.args.json) as progress:
            interrupts.say = progress.say

            def on_event(event: dict) -> None:
                tracker.handle(event)
                progress.update()
                interrupts.announce()

            self.outcome = step.run(self.job, on_event, interrupts, self.stream)
            interrupts.announce()
            if self.args.command == "rollout" and interrupts.abandoned and not self.args.check:
                from driver import putback

                progress.say("putting back into the router what serves and is out (Ctrl-C again to stop that too)")
                self.put_back = putback.run(self.job, lambda: interrupts.count >= 3, self.dir / "putback.jsonl")
                for line in self.put_back:
                    progress.say(line)
        self.code = tracker.exit_code(self.outcome.status, self.outcome.rc, interrupts.interrupted)

    def record(self) -> None:
        """How the run ended: its exit code in the stream's last event, its evidence bundle, its ledger row."""
        import time

        from driver import evidence

        if self.interrupts.interrupted:  # also a signal after the runner ended, or the driver's own failure above
            self.code = exitcodes.worst([self.code, exitcodes.INTERRUPTED])
        self._result_event()
        try:
            self.bundle = evidence.package(self.dir, self.run_id)
            if self.bundle:
                self.book.set_evidence(self.run_id, str(self.bundle))
            evidence.prune(self.dir.parent)
        except OSError as exc:
            print(f"the run's evidence bundles stay under {evidence.directory(self.dir)}: {exc}", file=sys.stderr)
        self.book.finish(
            self.run_id,
            self.code,
            exitcodes.MEANING.get(self.code, "?"),
            round(time.monotonic() - self.t0, 1),
            list(self.tracker.hosts),
            self.tracker.measurements(),
            str(self.stream),
        )
        self.book.close()

    def _result_event(self) -> None:
        """The stream's last line, the driver's result: how the run ended, as a report of the stream reads it back."""
        import json  # not at start-up: only argparse is (--help answers at once)

        from driver import events, runner

        try:
            with runner.open_private(self.stream) as sink:
                status, rc = (self.outcome.status, self.outcome.rc) if self.outcome else (None, None)
                sink.write(json.dumps(events.result_event(status, rc, self.interrupts.interrupted, self.code)) + "\n")
        except OSError as exc:
            print(f"the run's stream {self.stream} lacks its result: {exc}", file=sys.stderr)

    def show(self) -> int:
        """The summary (or the JSON document), and where an interruption left the hosts: the exit code."""
        from driver import display

        interrupts, tracker, bundle = self.interrupts, self.tracker, self.bundle
        left = tracker.left_in(abandoned=interrupts.abandoned) + self.put_back if interrupts.interrupted else None
        if self.args.json:
            display.as_json(tracker, self.code, self.run_id, left=left, evidence=str(bundle) if bundle else None)
        else:
            display.summary(tracker, self.code, self.run_id, svg=self.args.svg)
            if bundle:
                print(f"crash evidence of this run: {bundle}")
        if left is not None:
            print("interrupted; hosts were left so:", file=sys.stderr)
            for line in left:
                print(f"  {line}", file=sys.stderr)
        return self.code


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

    display.console().print(_profiles_table(data) if args.compare else _runs_table(data, args.last))
    return exitcodes.OK


def _profiles_table(data: list[dict]):
    """history --compare: per profile, what its recorded measurements say."""
    from driver import display

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
    return table


def _runs_table(data: list[dict], last: int):
    """history: the last runs, newest first, each with its measurements."""
    from driver import display

    table = display.table(
        f"last {last} runs",
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
    return table


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
