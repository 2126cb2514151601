"""Replay an event stream recorded from a real driver run (tests/driver/streams) through driver.events.Tracker."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from driver.events import RESULT, Tracker

STREAMS = Path(__file__).resolve().parent.parent / "driver" / "streams"


def replay(name: str, command: str) -> tuple[Tracker, int]:
    """The tracker fed the stream `name`, and the exit code it maps the recorded ending to: the code the driver gave
    in the recorded run (the stream's last line, driver.events.RESULT), or the assertion fails."""
    with gzip.open(STREAMS / f"{name}.jsonl.gz", "rt", encoding="utf-8") as fh:
        *stream, ending = [json.loads(line) for line in fh]
    assert ending["event"] == RESULT, f"{name}: recorded without the driver's result line; record it again"
    tracker = Tracker(command)
    for event in stream:
        tracker.handle(event)
    code = tracker.exit_code(ending["runner_status"], ending["rc"], ending["interrupted"])
    assert code == ending["exit_code"], f"{name}: the recorded run exited {ending['exit_code']}, the replay maps {code}"
    return tracker, code
