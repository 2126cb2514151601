"""Outcome and phase names: defined here once, read by the modules, the playbooks and the driver.

A module's result carries ``outcome`` (one of the constants below) and ``phases`` (a list
of {phase, seconds, ok, detail}); the driver maps outcomes to exit codes and shows phases
from these fields, never from task names or file paths.
"""

from __future__ import annotations

# ---------------------------------------------------------------- outcomes
# restart / rollback: exactly one of the first three once anything was touched.
RESTARTED = "restarted"  # the new configuration started and verified; recorded as known-good
ROLLED_BACK = "rolled_back"  # the new configuration failed; the known-good one serves, verified
NOT_RECOVERED = "not_recovered"  # failed, and no known-good configuration could be started: stopped
# Refusals: nothing running was touched.
GPUS_NOT_CLEAN = "gpus_not_clean"  # another process holds the instance's GPUs
LOCKED = "locked"  # another operation holds the instance's lock
INVALID_CONFIG = "invalid_config"  # a setting was refused (validation)
REFUSED = (
    "refused"  # the operation cannot apply here (nothing to roll back to, a multi-node rollback): the cause says why
)
# Check mode.
WOULD_RESTART = "would_restart"
WOULD_ROLL_BACK = "would_roll_back"
# The phases of a restart of an instance spanning nodes (one task each, on every node).
STOPPED = "stopped"
STARTED = "started"
# verify / status / stage
VERIFIED = "verified"
VERIFY_FAILED = "verify_failed"
STATUS = "status"
STAGED = "staged"  # deploy wrote a new configuration as pending: the safe restart applies it
UNCHANGED = "unchanged"  # deploy found the configuration already in place
# the deployed state (sglang_state): as the last complete deploy left it and what a deploy would leave now, or not
CURRENT = "current"
DRIFTED = "drifted"

SUCCESS = frozenset(
    {RESTARTED, WOULD_RESTART, WOULD_ROLL_BACK, STOPPED, STARTED, VERIFIED, STATUS, STAGED, UNCHANGED, CURRENT}
)
NOTHING_TOUCHED = frozenset({GPUS_NOT_CLEAN, LOCKED, INVALID_CONFIG, REFUSED})
ALL = SUCCESS | NOTHING_TOUCHED | {ROLLED_BACK, NOT_RECOVERED, VERIFY_FAILED, DRIFTED}


def succeeded(action: str, outcome: str) -> bool:
    """Whether sglang_server's task succeeds: a success, or an operator's rollback that rolled back."""
    return outcome in SUCCESS or (action == "rollback" and outcome == ROLLED_BACK)


# ---------------------------------------------------------------- phases
LOCK = "lock"
VALIDATE = "validate"  # SGLang's parser and the host's checks, in the restart's own call (its verdict cached)
STAGE = "stage"  # this run's rendered configuration written as pending, under the lock the restart holds
PREFLIGHT = "preflight"
STOP = "stop"
GPUS = "gpus"  # wait for clean GPUs
PROMOTE = "promote"  # the pending configuration becomes the unit's
RESTORE = "restore"  # the known-good configuration is put back (rollback)
START = "start"  # systemctl start, then wait until ready (fail fast)
GENERATE = "generate"  # a real generation with a fixed prompt
VERIFY = "verify"
RECORD = "record"  # what started and verified becomes a known-good generation
BENCH = "bench"  # autotune's benchmark after the record, under the lock (restart.measure): not a phase of its own
ROLLBACK_PREFIX = "rollback-"

RESTART_PHASES = (LOCK, VALIDATE, STAGE, PREFLIGHT, STOP, GPUS, PROMOTE, START, GENERATE, VERIFY, RECORD)
ROLLBACK_PHASES = (RESTORE, STOP, GPUS, START, GENERATE, VERIFY)
