"""The driver's exit codes: distinct for each way a run can end (README: "Exit codes")."""

from __future__ import annotations

OK = 0
FAILED = 1  # a failure of another kind: see the output
USAGE = 2  # bad command line (argparse)
INVALID_CONFIG = 3  # a setting was refused before anything running was touched
GPUS_NOT_CLEAN = 4  # another process holds the instance's GPUs; nothing was stopped
ROLLED_BACK = 5  # the new configuration failed to start or verify; the last-known-good one serves
NOT_RECOVERED = 6  # the new configuration failed and no known-good one could be started
VERIFY_FAILED = 7  # the running server failed verification
UNREACHABLE = 8  # a host could not be reached
INTERRUPTED = 130  # Ctrl-C

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
    INTERRUPTED: "interrupted (Ctrl-C)",
}

# When hosts end differently, the most serious decides the exit code.
SEVERITY = [NOT_RECOVERED, UNREACHABLE, FAILED, ROLLED_BACK, GPUS_NOT_CLEAN, VERIFY_FAILED, INVALID_CONFIG, OK]

OUTCOME_CODES = {
    "not_recovered": NOT_RECOVERED,
    "rolled_back": ROLLED_BACK,
    "gpus_not_clean": GPUS_NOT_CLEAN,
    "verify_failed": VERIFY_FAILED,
}


def worst(codes: list[int]) -> int:
    for code in SEVERITY:
        if code in codes:
            return code
    return OK
