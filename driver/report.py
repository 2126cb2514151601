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


class ReportError(Exception):
    """EVENTS cannot be read as a run's events: the message names the file and why."""


def load(path: Path) -> list[dict]:
    """The events in `path`, each once (AWX's pages may overlap), in their counter's order; an AWX job's events
    only when every one of its pages is there (`count`), never a verdict on part of a run."""
    if path.is_dir():
        events_dir = path / "job_events"
        # -partial.json: a dying ansible-runner's, without a counter; the whole event is in its numbered file
        files = sorted(f for f in events_dir.glob("*.json") if not f.name.endswith("-partial.json"))
        if not files:
            raise ReportError(f"{path}: a directory without job_events/*.json (ansible-runner's artifacts)")
        docs = [read_json(f) for f in files]
    else:
        text = read_text(path)
        try:
            docs = [json.loads(text)]
        except (json.JSONDecodeError, RecursionError):
            docs = [parse_line(path, n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    tops = [item for doc in docs for item in (doc if isinstance(doc, list) else [doc])]  # a list of pages, unrolled
    pages = [p for p in tops if isinstance(p, dict) and "results" in p]
    events = [e for d in docs for e in flatten(d) if isinstance(e, dict) and "event" in e]
    unique = list({key(e): e for e in events}.values())
    counts = {p["count"] for p in pages if isinstance(p.get("count"), int)}
    if counts and len(unique) < max(counts):
        raise ReportError(
            f"{path}: {len(unique)} of the job's {max(counts)} events: every page is needed (AWX's `next` link, "
            "or page_size up to 200 and a page at a time)"
        )
    if not unique:
        raise ReportError(f"{path}: no event in it (each has an 'event' and its 'event_data')")
    # counter-less events last, in the order they came: never ahead of the play's own
    return sorted(unique, key=lambda e: (not isinstance(e.get("counter"), int), e.get("counter") or 0))


def key(event: dict):
    """An event's identity across overlapping pages: its uuid, else its counter, else itself."""
    return event.get("uuid") or event.get("counter") or json.dumps(event, sort_keys=True, default=str)


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
        if "results" in doc:
            return list(doc["results"]) if isinstance(doc["results"], list) else []
        return [doc]
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
        return exitcodes.AWX_STATUS[given], None, False
    for e in reversed(events):
        if e.get("event") == RESULT:
            return e.get("runner_status") or "failed", e.get("rc"), bool(e.get("interrupted"))
    return ("successful" if any(e.get("event") == "playbook_on_stats" for e in events) else "failed"), None, False


def main(args: argparse.Namespace) -> int:
    """The summary and exit code of the run EVENTS hold; a usage error (2) when they cannot be read."""
    from driver import commands, display, events

    playbooks = {name: path for name, (path, _) in commands.PLAYBOOKS.items()}

    try:
        stream = load(args.events)
    except ReportError as exc:
        return usage(args, str(exc))
    command = args.played or command_of(stream, playbooks)
    if command not in playbooks:
        known = ", ".join(sorted(playbooks))
        return usage(args, f"--command: {command!r} is no driver command ({known}), and the events name none")
    tracker = events.Tracker(command)
    for n, event in enumerate(stream, 1):
        try:
            tracker.handle(event)
        except (TypeError, ValueError, AttributeError, KeyError) as exc:  # a field of another shape than runner's
            return usage(args, f"{args.events}: event {n} ({event.get('event')!r}) is not ansible-runner's: {exc!r}")
    code = tracker.exit_code(*ending_of(stream, args.status))
    run_id = None
    if args.record:
        run_id = record(command, code, tracker, args.events.resolve())
    if args.json:
        display.as_json(tracker, code, run_id)
    else:
        display.summary(tracker, code, run_id)
    return code


def record(command: str, code: int, tracker, events_path: Path) -> int | None:
    """The run's ledger row; None (said on stderr) when the ledger cannot take it: the verdict stands either way."""
    import sys

    from driver import ledger

    try:
        book = ledger.Ledger()
    except Exception as exc:  # the ledger's directory or database: the exit code is the run's, not the ledger's
        print(f"report: not recorded in the ledger: {exc}", file=sys.stderr)
        return None
    try:
        run_id = book.start(command, ["report", str(events_path)], None, None)
        seconds = round(max(tracker.last - tracker.first, 0.0), 1)
        meaning = exitcodes.MEANING.get(code, "?")
        book.finish(run_id, code, meaning, seconds, list(tracker.hosts), tracker.measurements(), str(events_path))
        return run_id
    except Exception as exc:
        print(f"report: not recorded in the ledger: {exc}", file=sys.stderr)
        return None
    finally:
        book.close()


def usage(args: argparse.Namespace, message: str) -> int:
    from driver import commands

    return commands.usage_error(args, message)
