"""python -m driver: deploy, restart, verify, validate, status, rollback, preflight, collect, rollout, tune, history,
report.

Installed (pip install .), the same CLI is the console script sglang-deploy (console() below, pyproject.toml).
Only argparse is imported at start-up: `--help` answers at once (bench/driver_help.py).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from driver import exitcodes, paths

# How the operator called the driver: in its help, its refusals, and what the hosts are told ran them.
PROG = "python -m driver"
CONSOLE_SCRIPT = "sglang-deploy"

# Each command's playbook, a path from the collection's root (the checkout, or the installed collection).
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
    "rollback": (
        "playbooks/rollback.yml",
        "put back the known-good generation before the one serving (the newest, if the unit is stopped), restart and verify it",
    ),
    "preflight": (
        "playbooks/preflight.yml",
        "before a restart: NCCL all-reduce bandwidth on each instance's GPUs against a floor, and each multi-node "
        "group's rendezvous (interfaces, dist_init_addr, a cross-node all-reduce); changes nothing",
    ),
    "collect": (
        "playbooks/collect.yml",
        "the crash evidence bundle of each instance, now: journal, py-spy of every rank, nvidia-smi -q, Xid lines, "
        "pip freeze, the configuration with secrets removed; changes nothing on the servers",
    ),
    "rollout": (
        "playbooks/rollout.yml",
        "rolling restart of the replicas behind sglang-router: out of the router, drained, safe restart, back in and "
        "healthy; the first batch is a canary measured against the fleet; stops at the failure budget",
    ),
}

# tune's steps (plan, measure) are one playbook's; its put-back is restart's (driver/tune.py).
TUNE_PLAYBOOK = "playbooks/tune.yml"

EPILOG = "exit codes:\n" + "\n".join(f"  {code:>3}  {meaning}" for code, meaning in sorted(exitcodes.MEANING.items()))


# The commands whose restarts or rollbacks report their progress as they run (plugins/action/sglang_server.py).
PROGRESSING = ("restart", "rollback", "rollout")


def tune_arguments(sp: argparse.ArgumentParser) -> None:
    """tune's own options (driver/tune.py runs the sweep)."""
    sp.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="a flag as profiles write it (speculative_num_steps=1,2,3) or an environment variable "
        "(NCCL_ALGO=Ring,Tree); repeatable; '' unsets",
    )
    sp.add_argument(
        "--grid-file", type=pathlib.Path, help="a YAML or JSON mapping of key to values (--grid adds to it)"
    )
    sp.add_argument("--concurrency", default="1", help="concurrency levels, comma-separated (default 1); all are shown")
    sp.add_argument(
        "--target-concurrency",
        type=int,
        help="the level the combinations are ranked and the winner chosen at: the one the server runs at "
        "(default: the first of --concurrency)",
    )
    sp.add_argument(
        "--repeat", type=int, default=3, help="measurements of each level per combination, for an interval (default 3)"
    )
    sp.add_argument(
        "--margin",
        type=float,
        default=0.02,
        help="how far a winner's 95%% interval must clear no speculation's and the runner-up's (default 0.02: 2%%)",
    )
    sp.add_argument(
        "--force",
        action="store_true",
        help="write the fastest combination's profile even when it is not clear of the noise (saying so)",
    )
    sp.add_argument("--requests", type=int, default=8, help="measured requests per level (default 8)")
    sp.add_argument("--max-new-tokens", type=int, default=64, help="tokens per request (default 64)")
    sp.add_argument("--warmup", type=int, default=2, help="unmeasured requests first (default 2)")
    sp.add_argument("--name", help="the winner's profile name (default <profile>_tuned_<sweep>)")
    sp.add_argument(
        "--profile-dir",
        type=pathlib.Path,
        help="where the winner's profile file goes (default: the inventory's group_vars/sglang_nodes/)",
    )
    sp.add_argument("--keep-best", action="store_true", help="leave the instance on the winner, not its own profile")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Deploy and operate SGLang servers (sglang-deploy).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "-i",
        "--inventory",
        help="inventory (default: the local lab, inventory/lab/hosts.yml)"
        if paths.CHECKOUT
        else "inventory (required: the installed driver has no default; or set $ANSIBLE_INVENTORY)",
    )
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

    def count_or_percent(value: str) -> str:
        value = value.strip()
        if not value.rstrip("%").isdigit() or value.count("%") > 1:
            raise argparse.ArgumentTypeError(f"{value!r} is neither a count (2) nor a percentage (25%)")
        return value

    def at_least_one(value: str) -> int:
        if not value.strip().isdigit() or int(value) < 1:
            raise argparse.ArgumentTypeError(f"{value!r} is not a count of 1 or more")
        return int(value)

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
                help="also kill other users' and other units' processes holding the instance's GPUs (never done otherwise)",
            )
        if name in PROGRESSING:
            sp.add_argument(
                "--stall-after",
                type=float,
                default=300.0,
                metavar="S",
                help="flag a restart whose progress (phase, load step, last log line) has not changed for S s "
                "(default 300; flagged, never stopped)",
            )
        if name == "rollout":
            sp.add_argument(
                "--max-unavailable",
                type=count_or_percent,
                default="1",
                help="replica hosts out of the router at once, a count or a percentage (default 1)",
            )
            sp.add_argument(
                "--max-fail",
                type=count_or_percent,
                default="0",
                help="failed replica hosts the rollout goes on after, a count or a percentage (default 0)",
            )
            sp.add_argument(
                "--gateway-quorum",
                type=at_least_one,
                metavar="N",
                help="gateways of sglang_routers that must carry out each step (default all): one down beyond that "
                "fails the replica's turn",
            )
    text = (
        "a sweep of speculative and serving flags over the safe restart on one instance: each combination "
        "restarted, benchmarked and recorded; ranked against no speculation; the winner written as a new profile"
    )
    tune_arguments(
        sub.add_parser(
            "tune",
            parents=[common],
            help=text,
            description=text,
            epilog=EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )
    h = sub.add_parser(
        "history", help="the run ledger; --compare puts profiles side by side", description="The run ledger."
    )
    h.add_argument("--compare", action="store_true", help="profiles side by side from the recorded measurements")
    h.add_argument("-n", "--last", type=int, default=20, help="how many runs to list")
    h.add_argument("--json", action="store_true", help="machine-readable output")
    from driver import report  # argparse only: the command's own imports wait until it runs

    report.arguments(
        sub.add_parser(
            "report",
            help="the summary, exit code and (--record) ledger row of a run AWX or ansible-navigator played",
            description="The driver's account of a run it did not start, from its job events (docs/awx.md).",
            epilog=EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )
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
    if getattr(args, "max_unavailable", None) is not None:
        out.append(json.dumps({"sglang_rollout_max_unavailable": args.max_unavailable}))
    if getattr(args, "max_fail", None) is not None:
        out.append(json.dumps({"sglang_rollout_max_fail": args.max_fail}))
    if getattr(args, "gateway_quorum", None) is not None:
        out.append(json.dumps({"sglang_rollout_gateway_quorum": args.gateway_quorum}))
    return out


def usage_error(args: argparse.Namespace, message: str) -> int:
    """Exit 2 before anything ran: the message on stderr; with --json, also the one result document on stdout."""
    print(f"{PROG} {args.command}: {message}", file=sys.stderr)
    if getattr(args, "json", False):
        import json

        doc = {"command": args.command, "exit_code": exitcodes.USAGE, "meaning": exitcodes.MEANING[exitcodes.USAGE]}
        print(json.dumps({**doc, "error": message, "run_id": None}))
    return exitcodes.USAGE


def run_playbook(args: argparse.Namespace, argv: list[str]) -> int:
    """Check the inventory, record the run, run its playbook, record how it ended, show it.

    SIGINT and SIGTERM are the driver's own from the start to the end (driver/interrupts.py): no Ctrl-C raises
    KeyboardInterrupt, and the ledger row gets its exit code whatever happens.
    """
    from driver.interrupts import Interrupts

    interrupts = Interrupts(args.command)
    previous = interrupts.install()
    try:
        return _run_playbook(args, argv, interrupts)
    except KeyboardInterrupt:  # raised by code that installs its own handler: the run was recorded already
        return exitcodes.INTERRUPTED
    finally:
        Interrupts.restore(previous)


def _run_playbook(args: argparse.Namespace, argv: list[str], interrupts) -> int:
    import time

    from driver import inventory

    try:
        inventory.check(args.inventory, args.limit, PLAYBOOKS[args.command][0], args.instance, extravars(args))
    except inventory.InventoryError as e:
        return usage_error(args, str(e))
    if interrupts.interrupted:
        print("interrupted before anything ran", file=sys.stderr)
        return exitcodes.INTERRUPTED

    from driver import display, events, evidence, ledger, redact, runner

    tracker = events.Tracker(args.command)
    redactor = redact.Redactor()
    book = ledger.Ledger()
    run_id = book.start(args.command, redactor.argv(argv), args.inventory, args.profile)
    run_dir = book.events_dir(run_id)
    record = run_dir / "events.jsonl"
    interrupts.arm(run_dir / "cancel")
    job = runner.Job(
        playbook=PLAYBOOKS[args.command][0],
        inventory=args.inventory,
        limit=args.limit,
        extravars=extravars(args),
        check=args.check,
        verbosity=args.verbose,
        env={
            "SGLANG_DEPLOY_CANCEL_FILE": str(run_dir / "cancel"),
            "SGLANG_DEPLOY_COMMAND": f"{PROG} {args.command}",
            evidence.ENV: str(evidence.directory(run_dir)),
        },
        scrub=redactor.scrub if redactor.secrets else None,
        progress_dir=run_dir / "progress",
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

            try:
                outcome = runner.run(job, on_event, interrupts.poll, record=record)
            except KeyboardInterrupt:  # from code under the runner that raised its own
                interrupts.abandon()
                outcome = runner.Outcome(status="canceled", rc=254)
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
    global PROG
    PROG = CONSOLE_SCRIPT
    sys.exit(main())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parser().parse_args(argv)
        args.argv = argv  # what a run records (redacted): the arguments parsed, not sys.argv when called with others
        if args.command == "history":
            return history(args)
        if args.command == "report":
            from driver import report

            return report.main(args, {name: path for name, (path, _) in PLAYBOOKS.items()})
        if args.command == "tune":
            from driver import tune

            return tune.main(args)
        return run_playbook(args, argv)
    except KeyboardInterrupt:  # before the driver's own handler, or after it: nothing half-recorded, no traceback
        print("\ninterrupted", file=sys.stderr)
        return exitcodes.INTERRUPTED
