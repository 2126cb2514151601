"""One playbook step of a command, as every command runs it: cli runs one per command, tune one per plan, measure and
put-back. Its job tells ansible-playbook the step's cancel file (the first Ctrl-C creates it: driver/interrupts.py),
the command that runs it (what the hosts record) and where the hosts' crash evidence goes; its progress files sit
beside them. Its run ends as canceled on a KeyboardInterrupt raised under the runner (the driver's own handler never
raises one: that is code that installed its own), the interrupts told to abandon."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from driver import commands, evidence, runner


def job(
    playbook: str,
    directory: Path,
    command: str,
    *,
    inventory: str | None,
    limit: str | None,
    extravars: list[str],
    redactor,
    check: bool = False,
    verbosity: int = 0,
    stall_s: float = 300.0,
) -> runner.Job:
    """The step's job, its files under `directory` (a run's, or a tune step's)."""
    return runner.Job(
        playbook=playbook,
        inventory=inventory,
        limit=limit,
        extravars=extravars,
        check=check,
        verbosity=verbosity,
        env={
            "SGLANG_DEPLOY_CANCEL_FILE": str(directory / "cancel"),
            "SGLANG_DEPLOY_COMMAND": f"{commands.PROG} {command}",
            evidence.ENV: str(evidence.directory(directory)),
        },
        scrub=redactor.scrub if redactor.secrets else None,
        progress_dir=directory / "progress",
        stall_s=stall_s,
    )


def run(the_job: runner.Job, on_event: Callable[[dict], None], interrupts, record: Path) -> runner.Outcome:
    """The job run to its end, each event to `on_event`, cancelled when the interrupts say so."""
    try:
        return runner.run(the_job, on_event, interrupts.poll, record=record)
    except KeyboardInterrupt:  # from code under the runner that raised its own
        interrupts.abandon()
        return runner.Outcome(status="canceled", rc=254)
