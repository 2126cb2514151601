"""The driver's exit codes: distinct for each way a run can end (README: "Exit codes").

Outcomes are the modules' own names (plugins/module_utils/sglang_deploy/outcomes.py, imported, never
retyped), so a renamed or added outcome cannot silently fall through to FAILED.
"""

from __future__ import annotations

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import outcomes

# AWX's job status -> ansible-runner's, which Tracker.exit_code reads (AWX says "error" where runner says "failed"):
# `report --status` takes AWX's (driver/commands.py), driver/report.py maps them.
AWX_STATUS = {"successful": "successful", "failed": "failed", "error": "failed", "canceled": "canceled"}

OK = 0
FAILED = 1  # a failure of another kind: see the output
USAGE = 2  # bad command line (argparse)
INVALID_CONFIG = 3  # a setting was refused before anything running was touched
GPUS_NOT_CLEAN = 4  # another process holds the instance's GPUs; nothing was stopped
ROLLED_BACK = 5  # the new configuration failed to start or verify; the last-known-good one serves
NOT_RECOVERED = 6  # the new configuration failed and no known-good one could be started
VERIFY_FAILED = 7  # the running server failed verification
UNREACHABLE = 8  # a host could not be reached
LOCKED = 9  # another operation holds the instance's lock; nothing was touched
DRIFTED = 10  # status --drift: a host's deployed state is not what a deploy would leave (changed nothing)
INTERRUPTED = 130  # Ctrl-C or SIGTERM

MEANING = {
    OK: "success",
    FAILED: "failed (another cause: see the output)",
    USAGE: "bad command line",
    INVALID_CONFIG: "invalid configuration (nothing running was touched)",
    GPUS_NOT_CLEAN: "GPUs not clean (nothing was stopped)",
    ROLLED_BACK: "start failed; rolled back to the last-known-good configuration, which serves",
    NOT_RECOVERED: "start failed and not recovered: no server is running",
    VERIFY_FAILED: "verification failed",
    UNREACHABLE: "host unreachable",
    LOCKED: "locked: another operation holds the instance's lock (nothing was touched)",
    DRIFTED: "drifted: a host's deployed state is not what a deploy would leave (nothing was touched)",
    INTERRUPTED: "interrupted (Ctrl-C or SIGTERM)",
}

# When hosts end differently, the most serious decides the exit code. An interruption hides no server left
# down (6) and no host lost (8): those outrank it; what it cut short it explains.
SEVERITY = [
    NOT_RECOVERED,
    UNREACHABLE,
    INTERRUPTED,
    FAILED,
    ROLLED_BACK,
    GPUS_NOT_CLEAN,
    LOCKED,
    VERIFY_FAILED,
    INVALID_CONFIG,
    DRIFTED,
    OK,
]

# Every outcome a module fails with (outcomes.ALL less outcomes.SUCCESS) has a code: its own, or FAILED where
# only the cause can say what to do (REFUSED: nothing to roll back to, a multi-node rollback).
OUTCOME_CODES = {
    outcomes.NOT_RECOVERED: NOT_RECOVERED,
    outcomes.ROLLED_BACK: ROLLED_BACK,
    outcomes.GPUS_NOT_CLEAN: GPUS_NOT_CLEAN,
    outcomes.LOCKED: LOCKED,
    outcomes.VERIFY_FAILED: VERIFY_FAILED,
    outcomes.INVALID_CONFIG: INVALID_CONFIG,
    outcomes.REFUSED: FAILED,
    outcomes.DRIFTED: DRIFTED,
}


def worst(codes: list[int]) -> int:
    """The code of the most serious way any host ended (SEVERITY), so one exit code can speak for all."""
    for code in SEVERITY:
        if code in codes:
            return code
    return OK
