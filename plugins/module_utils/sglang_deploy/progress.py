"""A restart's progress while it runs: which phase, which step of the model load, how far, streamed to the
controller (plugins/modules/sglang_server.py with detach, plugins/modules/sglang_job.py, plugins/action/sglang_server.py).

The restart runs in a worker detached from the SSH session (detach): it writes its progress to a file
(Reporter) and, at its end, its result. The module call that started it, and each sglang_job call after it,
waits on the host until the progress changes or the result is there (wait_change), so the controller learns
each change with one round trip, never one per second per host.

The model-load steps come from the unit's journal, SGLang 0.5.23's own lines (LoadWatch):
  "Load weight begin. avail mem=... GB"                (model_runner.py; the first: the target model, the
                                                         second, after a "Load weight end.": the draft model)
  "Loading safetensors checkpoint shards:  50% Completed | 1/2 [...]"    (weight_utils.py, tqdm)
  "Capture target verify CUDA graph begin. ..."         (cuda_graph_setup.py: "Capture {role} {decode|verify}
  "Capture draft decode CUDA graph begin. ..."           CUDA graph begin."; eagle_worker_v2.py)
  "Capturing batches (bs=8 avail_mem=70.12 GB):  50%|...| 2/4"          (decode_cuda_graph_runner.py, tqdm)
tqdm redraws its bar with "\\r" and ends it with "\\n"; journald cuts lines at "\\n" only, so a bar's n/m
reaches the journal when the bar ends (the last "\\r" segment of the line is its state then). The steps
themselves ("Load weight begin.", "Capture ... begin.") are logged lines and arrive as they happen.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable

from .durable import write_atomic
from .secret_rule import clip, patterns

# The model-load steps (the sub-phases of `start`), in the order SGLang takes them.
WEIGHTS = "loading weights"
DRAFT_WEIGHTS = "loading draft weights"
GRAPHS = "capturing CUDA graphs"
DRAFT_GRAPHS = "capturing draft CUDA graphs"
READY_WAIT = "starting"  # no load step logged yet (Python and SGLang importing, the ranks starting)

LOAD_BEGIN = re.compile(r"\bLoad weight begin\.")
LOAD_END = re.compile(r"\bLoad weight end\.")
# "Capture target decode CUDA graph begin.", "Capture draft extend CUDA graph begin.", "Capture cuda graph begin."
CAPTURE_BEGIN = re.compile(r"\bCapture (?:(target|draft)\s+)?(?:[\w ]+?\s+)?(?:CUDA|cuda) graph begin\.")
# A tqdm bar segment: "<desc>: 50% Completed | 1/2" (SGLang's BAR_FORMAT) or "<desc>:  50%|#####     | 2/4".
BAR = re.compile(
    r"(?P<desc>Loading safetensors checkpoint shards|Capturing batches[^:]*):\s*(?P<pct>\d+)%"
    r"(?:\s*Completed\s*\||\|[^|]*\|)\s*(?P<n>\d+)/(?P<m>\d+)"
)


class LoadWatch:
    """Reads the journal's new lines and keeps the model-load step and its bar: step, detail (n/m, %)."""

    def __init__(self, redact: Callable[[str], str] = patterns) -> None:
        self.redact = redact  # masks a line before its tail is cut (secret_rule.clip)
        self.step = ""
        self.detail = ""
        self.loads = 0  # "Load weight begin." lines seen: 1 the target, 2 the draft
        self.last_line = ""

    def feed(self, lines: list[str]) -> list[tuple[str, str]]:
        """The lines since the last call, in order; each (step, detail) they went through, in order (a bar's end
        and the next step's begin often come in one read: the bar's last n/m is not lost)."""
        went: list[tuple[str, str]] = []
        for line in lines:
            if not line.strip():
                continue
            segment = line.rsplit("\r", 1)[-1].strip() or line.strip()
            self.last_line = clip(segment, 300, self.redact, last=True)  # SGLang's ServerArgs line is long
            if LOAD_BEGIN.search(line):
                self.loads += 1
                self.step, self.detail = (WEIGHTS if self.loads == 1 else DRAFT_WEIGHTS), ""
            elif LOAD_END.search(line):
                self.detail = "done"
            m = CAPTURE_BEGIN.search(line)
            if m:
                self.step, self.detail = (DRAFT_GRAPHS if m.group(1) == "draft" else GRAPHS), ""
            bars = list(BAR.finditer(segment))
            if bars:
                b = bars[-1]
                self.detail = f"{b['n']}/{b['m']} ({b['pct']}%)"
            if (self.step, self.detail) != (went[-1] if went else None):
                went.append((self.step, self.detail))
        return went


class Reporter:
    """The progress file of one detached restart: rewritten (atomically) on each change, read by wait_change.

    The document: seq (grows on each change), phase (the state machine's, "rollback/start" in a rollback), step
    (a model-load step of start, or ""), detail, last_line (the server's newest journal line), since (epoch of
    the phase's start), step_since, and steps: every step finished so far with its seconds (the ledger's
    sub-phase timings), and trail: the last TRAIL phase and step changes with their epoch (each answer carries
    them, so none is lost between two answers)."""

    TRAIL = 100

    def __init__(self, path: str | None, clock=time.time, mask=lambda doc: doc, echo=None):
        self.path = path
        self.clock = clock
        self.mask = mask  # strips secret values (the module's no_log values) before anything is written
        # A line per phase and step change, for the worker's journal (job.detach); names only, never a log line.
        self.echo = echo
        self.doc = {
            "seq": 0,
            "phase": "",
            "step": "",
            "detail": "",
            "last_line": "",
            "since": 0.0,
            "steps": [],
            "trail": [],
        }

    def _write(self) -> None:
        self.doc["seq"] += 1
        if not self.path:
            return
        write_atomic(self.path, json.dumps(self.mask(self.doc)), 0o600)

    def _trail(self, now: float) -> None:
        d = self.doc
        d["trail"] = [
            *d["trail"],
            {"phase": d["phase"], "step": d["step"], "detail": d["detail"], "at": round(now, 3)},
        ][-self.TRAIL :]

    def _close_step(self, now: float) -> None:
        d = self.doc
        if d["step"]:
            d["steps"].append(
                {
                    "phase": d["phase"],
                    "step": d["step"],
                    "detail": d["detail"],
                    "seconds": round(now - d["step_since"], 3),
                }
            )

    def phase(self, name: str) -> None:
        now = self.clock()
        self._close_step(now)
        self.doc.update(phase=name, step="", detail="", since=round(now, 3), step_since=round(now, 3))
        self._trail(now)
        self._write()
        if self.echo:
            self.echo(f"phase {name}")

    def step(self, name: str, detail: str = "", last_line: str = "") -> None:
        d = self.doc
        if (d["step"], d["detail"], d["last_line"]) == (name, detail, last_line):
            return
        now = self.clock()
        if d["step"] != name:
            self._close_step(now)
            d["step_since"] = round(now, 3)
        moved = (d["step"], d["detail"]) != (name, detail)
        d.update(step=name, detail=detail, last_line=last_line)
        if moved:
            self._trail(now)
        self._write()
        if moved and self.echo:
            self.echo(f"{d['phase']}: {name} {detail}".rstrip())

    def finish(self) -> list[dict]:
        """The steps with their seconds, the last one closed (the trail stays in doc)."""
        self._close_step(self.clock())
        self.doc["step"] = ""
        return list(self.doc["steps"])


# The controller's side (plugins/action/sglang_server.py, driver/): where the progress of each host's restart
# is written, one file per host and instance, when the driver asks for it.
PROGRESS_DIR_ENV = "SGLANG_DEPLOY_PROGRESS_DIR"
DETACHED_ACTIONS = frozenset({"restart", "rollback"})


def progress_file(directory: str, host: str, instance: str) -> str:
    return os.path.join(directory, f"{host}.{instance}.json")
