"""What validation answers with: a problem ({check, key, message}: the check, the variable to change, what to do),
the variable a flag came from, and ValidateError, for checks that could not run (the host, not the configuration).

Shared by validate (the whole host), instance_checks, host_checks and sglang_parser.
"""

from __future__ import annotations


class ValidateError(Exception):
    """The checks could not run (the host, not the configuration): the message says why."""


def problem(check, key, message):
    return {"check": check, "key": key, "message": message}


def flag_origin(flag, origins):
    return origins.get(flag, "the rendered command line")
