"""`python -m driver report EVENTS`: the driver's account of a run it did not start (issue #33, docs/awx.md).

AWX/AAP and ansible-navigator run the collection's playbooks themselves; their job events are ansible-runner's
(`event`, `event_data`, `created`, `stdout`), the stream the driver reads while it runs one. Fed the same events, the
driver's Tracker gives the same summary, exit code (driver/exitcodes.py) and, with --record, a ledger row: what the
driver adds that AWX does not keep.

EVENTS is one of: AWX's `GET /api/v2/jobs/N/job_events/` page(s) saved as JSON ({"results": [...]}, or a list of
such pages or events); JSON Lines of events (ansible-runner's `--json` stdout, the driver's own events.jsonl); an
ansible-runner artifacts directory (its job_events/*.json, ansible-navigator's playbook artefact's "plays" aside).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from driver import exitcodes

# AWX's job status -> ansible-runner's (Tracker.exit_code reads the latter): AWX says "error" where runner says "failed".
STATUS = {"successful": "successful", "failed": "failed", "error": "failed", "canceled": "canceled"}


class ReportError(Exception):
    """EVENTS cannot be read as a run's events: the message names the file and why."""


def load(path: Path) -> list[dict]:
    """The events in `path`, ordered by their counter where they have one (AWX pages and runner files may not be)."""
    if path.is_dir():
        files = sorted((path / "job_events").glob("*.json")) if (path / "job_events").is_dir() else []
        if not files:
            raise ReportError(f"{path}: a directory without job_events/*.json (ansible-runner's artifacts)")
        events = [read_json(f) for f in files]
    else:
        text = read_text(path)
        try:
            events = flatten(json.loads(text))
        except json.JSONDecodeError:
            events = [parse_line(path, n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    events = [e for e in events if isinstance(e, dict) and "event" in e]
    if not events:
        raise ReportError(f"{path}: no event in it (each has an 'event' and its 'event_data')")
    return sorted(events, key=lambda e: e.get("counter") if isinstance(e.get("counter"), int) else 0)


def read_text(path: Path) -> str:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ReportError(f"{path}: {exc}") from None


def read_json(path: Path) -> dict:
    try:
        return json.loads(read_text(path))
    except json.JSONDecodeError as exc:
        raise ReportError(f"{path}: not JSON ({exc})") from None


def parse_line(path: Path, n: int, line: str) -> dict:
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise ReportError(f"{path}:{n}: neither one JSON document nor JSON Lines ({exc})") from None


def flatten(doc) -> list:
    """AWX's page ({"results": [...]}), a list of pages, or a list of events."""
    if isinstance(doc, dict):
        return list(doc.get("results") or []) if "results" in doc else [doc]
    if isinstance(doc, list):
        return (
            [e for item in doc for e in flatten(item)]
            if any(isinstance(i, dict) and "results" in i for i in doc)
            else doc
        )
    return []


def command_of(events: list[dict], playbooks: dict[str, str]) -> str | None:
    """The driver command whose playbook the run played: playbook_on_start's `playbook`, a path (the checkout's, an
    AWX project's: the same file name) or the collection's name (sglang.deploy.NAME)."""
    for e in events:
        if e.get("event") == "playbook_on_start":
            played = str((e.get("event_data") or {}).get("playbook") or "")
            for command, path in playbooks.items():
                name = Path(path).name
                if played in (name, f"sglang.deploy.{Path(path).stem}") or played.endswith(f"/{name}"):
                    return command
    return None


def ending_of(events: list[dict], given: str | None) -> tuple[str, int | None, bool]:
    """How the run ended, as Tracker.exit_code takes it (runner status, rc, interrupted): AWX's status (--status);
    else the driver's own result line (a stream it recorded); else `failed` unless the play reached its end."""
    from driver.events import RESULT

    if given:
        return STATUS[given], None, False
    for e in reversed(events):
        if e.get("event") == RESULT:
            return e.get("runner_status") or "failed", e.get("rc"), bool(e.get("interrupted"))
    return ("successful" if any(e.get("event") == "playbook_on_stats" for e in events) else "failed"), None, False


def arguments(sp: argparse.ArgumentParser) -> None:
    sp.add_argument(
        "events", type=Path, help="the run's events: AWX job events JSON, JSON Lines, or a runner artifacts dir"
    )
    sp.add_argument("--command", dest="played", help="the driver command the playbook is (default: from the events)")
    sp.add_argument(
        "--status", choices=sorted(STATUS), help="the job's status as AWX gives it (default: from the events)"
    )
    sp.add_argument("--record", action="store_true", help="also keep the run in the ledger (`history` lists it)")
    sp.add_argument("--json", action="store_true", help="print one machine-readable result")


def main(args: argparse.Namespace, playbooks: dict[str, str]) -> int:
    """The summary and exit code of the run EVENTS hold; a usage error (2) when they cannot be read."""
    from driver import display, events, ledger

    try:
        stream = load(args.events)
    except ReportError as exc:
        return usage(args, str(exc))
    command = args.played or command_of(stream, playbooks)
    if command not in playbooks:
        known = ", ".join(sorted(playbooks))
        return usage(args, f"--command: {command!r} is no driver command ({known}), and the events name none")
    tracker = events.Tracker(command)
    for event in stream:
        tracker.handle(event)
    code = tracker.exit_code(*ending_of(stream, args.status))
    run_id = None
    if args.record:
        book = ledger.Ledger()
        try:
            run_id = book.start(command, ["report", str(args.events)], None, None)
            seconds = round(max(tracker.last - tracker.first, 0.0), 1)
            meaning = exitcodes.MEANING.get(code, "?")
            book.finish(run_id, code, meaning, seconds, list(tracker.hosts), tracker.measurements(), str(args.events))
        finally:
            book.close()
    if args.json:
        display.as_json(tracker, code, run_id)
    else:
        display.summary(tracker, code, run_id)
    return code


def usage(args: argparse.Namespace, message: str) -> int:
    import sys

    from driver.cli import PROG  # python -m driver, or sglang-deploy

    print(f"{PROG} report: {message}", file=sys.stderr)
    if args.json:
        print(json.dumps({"command": "report", "exit_code": exitcodes.USAGE, "error": message, "run_id": None}))
    return exitcodes.USAGE
