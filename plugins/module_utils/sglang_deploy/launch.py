"""Start SGLang with its API key from the environment, never on its command line.

SGLang 0.5.23 takes its API key only as ``--api-key`` (server_args.py reads no variable),
and a command line is readable by every local user (/proc/PID/cmdline, ps). The unit runs

    <venv>/bin/python /usr/local/libexec/sglang-deploy/sglang-launch sglang.launch_server <flags>

and this adds ``--api-key`` from SGLANG_API_KEY (the instance's root-only secrets file, an
EnvironmentFile=) to the process's own sys.argv, then runs the module as ``python -m`` would.
The key is always the secrets file's current one, whatever configuration generation runs:
a rollback never switches authentication off or brings a rotated key back.
"""

from __future__ import annotations

import os
import runpy
import sys

from .procinfo import API_KEY_VAR


def server_argv(argv: list[str], environ: dict) -> tuple[str, list[str]]:
    """(the module to run, its argv with the key appended when there is one); the key leaves the environment."""
    if not argv:
        raise SystemExit("usage: sglang-launch MODULE [FLAG ...]")
    module, args = argv[0], list(argv[1:])
    key = environ.pop(API_KEY_VAR, None)
    if key:
        args += ["--api-key", key]
    return module, args


def main(argv: list[str] | None = None) -> None:
    module, args = server_argv(sys.argv[1:] if argv is None else argv, os.environ)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
