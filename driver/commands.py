"""The driver's commands as one table (pip's commands/__init__.py is the model): each command's name, what it does,
its playbook, its own options and the function that runs it, imported only when that command runs. Only argparse
is imported at start-up: `--help` answers at once (bench/driver_help.py).

cli.py parses and dispatches; tune.py, report.py and redact.py read the table, the parser and the program's name here,
never cli.py: the driver's modules import one another without a cycle (tests/driver/test_commands.py).
"""

from __future__ import annotations

import argparse
import importlib
import pathlib
import sys
from collections.abc import Callable
from dataclasses import dataclass

from driver import exitcodes, paths

# How the operator called the driver: in its help, its refusals, and what the hosts are told ran them. The console
# script renames it once, at its start (use_console_name), before anything reads it.
PROG = "python -m driver"
CONSOLE_SCRIPT = "sglang-deploy"


def use_console_name() -> None:
    global PROG
    PROG = CONSOLE_SCRIPT


EPILOG = "exit codes:\n" + "\n".join(f"  {code:>3}  {meaning}" for code, meaning in sorted(exitcodes.MEANING.items()))

# The handler of the commands that run their playbook once, through ansible-runner.
RUN_PLAYBOOK = "driver.cli:run_playbook"
# tune's steps (plan, measure) are one playbook's; its put-back is restart's (driver/tune.py).
TUNE_PLAYBOOK = "playbooks/tune.yml"


@dataclass(frozen=True)
class Command:
    summary: str
    handler: str  # "module:function", imported when the command runs; called with the parsed arguments
    playbook: str | None = None  # a path from the collection's root (the checkout, or the installed collection)
    options: tuple[Callable[[argparse.ArgumentParser], None], ...] = ()  # its own options, beyond the common ones
    common: bool = True  # takes the common options (-i, --limit, --profile, -e, --instance, ...)
    exit_codes: bool = True  # its --help ends with the exit codes (history exits 0 or on a usage error)
    description: str | None = None  # --help's text, when not the summary


def restart_options(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--no-rollback", action="store_true", help="leave a failed restart stopped instead of rolling back")
    sp.add_argument(
        "--force-stop",
        action="store_true",
        help="also kill other users' and other units' processes holding the instance's GPUs (never done otherwise)",
    )


def progress_options(sp: argparse.ArgumentParser) -> None:
    """The commands whose restarts or rollbacks report their progress as they run (plugins/action/sglang_server.py)."""
    sp.add_argument(
        "--stall-after",
        type=float,
        default=300.0,
        metavar="S",
        help="flag a restart whose progress (phase, load step, last log line) has not changed for S s "
        "(default 300; flagged, never stopped)",
    )


# status --drift: the deployed state of each GPU node against its desired one, one round trip a host (issue #36).
DRIFT_PLAYBOOK = "playbooks/drift.yml"


def status_options(sp: argparse.ArgumentParser) -> None:
    sp.add_argument(
        "--drift",
        action="store_true",
        help=f"instead: is each GPU node as its last complete deploy left it, and what a deploy would leave now? "
        f"(one call a host, changes nothing; exit {exitcodes.DRIFTED} where one drifted: {DRIFT_PLAYBOOK})",
    )


def playbook_of(args: argparse.Namespace) -> str | None:
    """The playbook the parsed command runs: its own, or status --drift's."""
    return DRIFT_PLAYBOOK if getattr(args, "drift", False) else COMMANDS[args.command].playbook


def count_or_percent(value: str) -> str:
    """--max-unavailable's and --max-fail's rule, the playbook's own (sglang_deploy.rollout.COUNT)."""
    from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.rollout import COUNT

    value = value.strip()
    if not COUNT.fullmatch(value):
        raise argparse.ArgumentTypeError(f"{value!r} is neither a count (2) nor a percentage (25%)")
    return value


def at_least_one(value: str) -> int:
    if not value.strip().isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a count of 1 or more")
    return int(value)


def rollout_options(sp: argparse.ArgumentParser) -> None:
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


def tune_options(sp: argparse.ArgumentParser) -> None:
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


def history_options(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--compare", action="store_true", help="profiles side by side from the recorded measurements")
    sp.add_argument("-n", "--last", type=int, default=20, help="how many runs to list")
    sp.add_argument("--json", action="store_true", help="machine-readable output")


def report_options(sp: argparse.ArgumentParser) -> None:
    sp.add_argument(
        "events", type=pathlib.Path, help="the run's events: AWX job events JSON, JSON Lines, or a runner artifacts dir"
    )
    sp.add_argument("--command", dest="played", help="the driver command the playbook is (default: from the events)")
    sp.add_argument(
        "--status",
        choices=sorted(exitcodes.AWX_STATUS),
        help="the job's status as AWX gives it (default: from the events)",
    )
    sp.add_argument("--record", action="store_true", help="also keep the run in the ledger (`history` lists it)")
    sp.add_argument("--json", action="store_true", help="print one machine-readable result")


COMMANDS: dict[str, Command] = {
    "deploy": Command(
        "install and configure GPU nodes: CUDA, ml-env, SGLang and its patches, the units",
        RUN_PLAYBOOK,
        "playbooks/deploy.yml",
    ),
    "restart": Command(
        "safe restart: validate, stop, clean GPUs, start, generate, verify; roll back on failure",
        RUN_PLAYBOOK,
        "playbooks/restart.yml",
        (restart_options, progress_options),
    ),
    "verify": Command(
        "verify running servers: unit, drift, GPU processes, generation, accept length, tok/s",
        RUN_PLAYBOOK,
        "playbooks/verify.yml",
    ),
    "validate": Command(
        "check the configuration with SGLang's own parser on each host; changes nothing",
        RUN_PLAYBOOK,
        "playbooks/validate.yml",
    ),
    "status": Command(
        "every instance at a glance: unit, profile, drift, GPU memory, health, accept length",
        RUN_PLAYBOOK,
        "playbooks/status.yml",
        (status_options,),
    ),
    "rollback": Command(
        "put back the known-good generation before the one serving (the newest, if the unit is stopped), restart and verify it",
        RUN_PLAYBOOK,
        "playbooks/rollback.yml",
        (progress_options,),
    ),
    "preflight": Command(
        "before a restart: NCCL all-reduce bandwidth on each instance's GPUs against a floor, and each multi-node "
        "group's rendezvous (interfaces, dist_init_addr, a cross-node all-reduce); changes nothing",
        RUN_PLAYBOOK,
        "playbooks/preflight.yml",
    ),
    "collect": Command(
        "the crash evidence bundle of each instance, now: journal, py-spy of every rank, nvidia-smi -q, Xid lines, "
        "pip freeze, the configuration with secrets removed; changes nothing on the servers",
        RUN_PLAYBOOK,
        "playbooks/collect.yml",
    ),
    "rollout": Command(
        "rolling restart of the replicas behind sglang-router: out of the router, drained, safe restart, back in and "
        "healthy; the first batch is a canary measured against the fleet; stops at the failure budget",
        RUN_PLAYBOOK,
        "playbooks/rollout.yml",
        (progress_options, rollout_options),
    ),
    "tune": Command(
        "a sweep of speculative and serving flags over the safe restart on one instance: each combination "
        "restarted, benchmarked and recorded; ranked against no speculation; the winner written as a new profile",
        "driver.tune:main",
        TUNE_PLAYBOOK,
        (tune_options,),
    ),
    "history": Command(
        "the run ledger; --compare puts profiles side by side",
        "driver.cli:history",
        options=(history_options,),
        common=False,
        exit_codes=False,
        description="The run ledger.",
    ),
    "report": Command(
        "the summary, exit code and (--record) ledger row of a run AWX or ansible-navigator played",
        "driver.report:main",
        options=(report_options,),
        common=False,
        description="The driver's account of a run it did not start, from its job events (docs/awx.md).",
    ),
}

# Each command that runs its playbook once: (its playbook, what it does). A played run's command is read back by
# its playbook (driver/report.py).
PLAYBOOKS = {name: (c.playbook, c.summary) for name, c in COMMANDS.items() if c.handler == RUN_PLAYBOOK}


def common_options() -> argparse.ArgumentParser:
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
    return common


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Deploy and operate SGLang servers (sglang-deploy).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = common_options()
    for name, c in COMMANDS.items():
        sp = sub.add_parser(
            name,
            parents=[common] if c.common else [],
            help=c.summary,
            description=c.description or c.summary,
            epilog=EPILOG if c.exit_codes else None,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        for add in c.options:
            add(sp)
    return p


def handler(name: str) -> Callable[[argparse.Namespace], int]:
    """The function that runs command `name`, its module imported now."""
    module, function = COMMANDS[name].handler.split(":")
    return getattr(importlib.import_module(module), function)


def extravars(args: argparse.Namespace) -> list[str]:
    """The command's options as the extra variables its playbook reads, after the operator's own -e."""
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
