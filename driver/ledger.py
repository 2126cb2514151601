"""The run ledger: every driver run and what it measured, in a local SQLite database.

    $SGLANG_DEPLOY_LEDGER, or ~/.local/state/sglang-deploy/ledger.sqlite3

Private to its user: the database is 0600, its directory (when the ledger made it, or it is the default
one) and the run directories (runs/<id>/: the event stream, the cancel file) 0700; modes left wider by
an older driver are narrowed when the ledger is opened. The argv it keeps has its secrets redacted
(driver/redact.py).

`history` lists runs; `history --compare` puts profiles side by side from the recorded
measurements: "which configuration gave 82.3 tok/s, and was it really the one running?"
"""

from __future__ import annotations

import getpass
import json
import os
import sqlite3
import statistics
import time
from pathlib import Path

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import durable

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    started_at TEXT NOT NULL,
    finished_at TEXT,
    user TEXT NOT NULL,
    command TEXT NOT NULL,
    argv TEXT NOT NULL,
    inventory TEXT,
    hosts TEXT,
    profile TEXT,
    config_hash TEXT,
    outcome TEXT,
    exit_code INTEGER,
    duration_s REAL,
    events_path TEXT,
    evidence_path TEXT
);
CREATE TABLE IF NOT EXISTS measurements (
    run_id INTEGER NOT NULL REFERENCES runs(id),
    host TEXT NOT NULL,
    instance TEXT NOT NULL,
    outcome TEXT,
    profile TEXT,
    running_profile TEXT,
    config_hash TEXT,
    downtime_s REAL,
    tokens_per_s REAL,
    accept_length REAL,
    load_s REAL,
    capture_s REAL
);
CREATE INDEX IF NOT EXISTS measurements_profile ON measurements(profile);
CREATE TABLE IF NOT EXISTS tune_results (
    sweep TEXT NOT NULL,
    combination TEXT NOT NULL,
    run_id INTEGER NOT NULL REFERENCES runs(id),
    measured_at TEXT NOT NULL,
    host TEXT NOT NULL,
    instance TEXT NOT NULL,
    start_profile TEXT NOT NULL,
    label TEXT NOT NULL,
    combo TEXT NOT NULL,
    outcome TEXT NOT NULL,
    restart_outcome TEXT,
    cause TEXT,
    config_hash TEXT,
    software TEXT,
    gpu_model TEXT,
    tokens_per_s REAL,
    accept_length REAL,
    ttft_median_s REAL,
    ttft_p99_s REAL,
    itl_median_s REAL,
    itl_p99_s REAL,
    bench TEXT,
    PRIMARY KEY (sweep, combination)
);
"""

# The columns of a tune result (tune_results above) that driver/tune.py fills, in order.
TUNE_COLUMNS = (
    "sweep",
    "combination",
    "run_id",
    "measured_at",
    "host",
    "instance",
    "start_profile",
    "label",
    "combo",
    "outcome",
    "restart_outcome",
    "cause",
    "config_hash",
    "software",
    "gpu_model",
    "tokens_per_s",
    "accept_length",
    "ttft_median_s",
    "ttft_p99_s",
    "itl_median_s",
    "itl_p99_s",
    "bench",
)


def default_path() -> Path:
    env = os.environ.get("SGLANG_DEPLOY_LEDGER")
    if env:
        return Path(env)
    state = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
    return state / "sglang-deploy" / "ledger.sqlite3"


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


FILE_MODE = 0o600
DIR_MODE = 0o700


def private_dir(d: Path, narrow: bool = True) -> Path:
    """d, made 0700 if missing; an existing one narrowed to 0700 when narrow (never a directory others share)."""
    try:
        d.mkdir(mode=DIR_MODE, parents=True)
        os.chmod(d, DIR_MODE)  # mkdir's mode is cut by the umask; this one is exact
        durable.fsync_dir(str(d.parent))  # a new run's directory survives a crash with the row that names it
    except FileExistsError:
        if narrow and _ours(d) and d.stat().st_mode & 0o7777 != DIR_MODE:
            os.chmod(d, DIR_MODE)
    return d


def _ours(d: Path) -> bool:
    """A directory this user owns that is nobody else's too: not sticky (/tmp), not the home directory."""
    st = d.stat()
    return st.st_uid == os.getuid() and not st.st_mode & 0o1000 and d.resolve() != Path.home().resolve()


def private_file(f: Path) -> Path:
    """f created 0600 (or an existing one narrowed to 0600)."""
    try:
        os.close(os.open(f, os.O_CREAT | os.O_EXCL | os.O_WRONLY, FILE_MODE))
        # SQLite fsyncs its journal's directory, never the database's own: a new ledger's name is made durable here
        durable.fsync_dir(str(f.parent))
    except FileExistsError:
        pass
    if f.stat().st_mode & 0o777 != FILE_MODE:
        os.chmod(f, FILE_MODE)
    return f


class Ledger:
    def __init__(self, path: Path | None = None):
        self.path = path or default_path()
        # Its own directory: the default one, or one it makes; a directory the user named may be shared.
        private_dir(self.path.parent, narrow=self.path.parent == default_path().parent)
        private_file(self.path)
        runs = self.path.parent / "runs"
        if runs.exists() and runs.stat().st_mode & 0o777 != DIR_MODE:
            # Left by an older driver (0755/0644): every run directory and its files become private.
            for run_dir in (p for p in runs.iterdir() if p.is_dir()):
                os.chmod(run_dir, DIR_MODE)
                for f in (f for f in run_dir.iterdir() if f.is_file()):
                    os.chmod(f, FILE_MODE)
        private_dir(runs)
        self.db = sqlite3.connect(self.path)
        self.db.row_factory = sqlite3.Row
        self.db.executescript(SCHEMA)
        columns = {r["name"] for r in self.db.execute("PRAGMA table_info(runs)")}
        if "evidence_path" not in columns:  # a ledger made before the crash evidence bundle
            self.db.execute("ALTER TABLE runs ADD COLUMN evidence_path TEXT")
            self.db.commit()
        columns = {r["name"] for r in self.db.execute("PRAGMA table_info(measurements)")}
        for column in ("load_s", "capture_s"):  # a ledger made before the restart's progress
            if column not in columns:
                self.db.execute(f"ALTER TABLE measurements ADD COLUMN {column} REAL")
        self.db.commit()

    def set_evidence(self, run_id: int, path: str) -> None:
        self.db.execute("UPDATE runs SET evidence_path=? WHERE id=?", (path, run_id))
        self.db.commit()

    def close(self) -> None:
        self.db.close()

    def start(self, command: str, argv: list[str], inventory: str | None, profile: str | None) -> int:
        cur = self.db.execute(
            "INSERT INTO runs (started_at, user, command, argv, inventory, profile) VALUES (?, ?, ?, ?, ?, ?)",
            (now_iso(), getpass.getuser(), command, json.dumps(argv), inventory, profile),
        )
        self.db.commit()
        return int(cur.lastrowid)

    def events_dir(self, run_id: int) -> Path:
        """The run's private directory (0700): its event stream and its cancel file."""
        return private_dir(self.path.parent / "runs" / str(run_id))

    def finish(
        self,
        run_id: int,
        exit_code: int,
        outcome: str,
        duration_s: float,
        hosts: list[str],
        measurements: list[dict],
        events_path: str | None,
    ) -> None:
        hashes = sorted({m["config_hash"] for m in measurements if m.get("config_hash")})
        profiles = sorted({m["profile"] for m in measurements if m.get("profile")})
        self.db.execute(
            "UPDATE runs SET finished_at=?, exit_code=?, outcome=?, duration_s=?, hosts=?, config_hash=?,"
            " profile=COALESCE(profile, ?), events_path=? WHERE id=?",
            (
                now_iso(),
                exit_code,
                outcome,
                duration_s,
                ",".join(sorted(hosts)),
                ",".join(hashes) or None,
                ",".join(profiles) or None,
                events_path,
                run_id,
            ),
        )
        self.db.executemany(
            "INSERT INTO measurements (run_id, host, instance, outcome, profile, running_profile, config_hash,"
            " downtime_s, tokens_per_s, accept_length, load_s, capture_s) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [
                (
                    run_id,
                    m["host"],
                    m["instance"],
                    m.get("outcome"),
                    m.get("profile"),
                    m.get("running_profile"),
                    m.get("config_hash"),
                    m.get("downtime_s"),
                    m.get("tokens_per_s"),
                    m.get("accept_length"),
                    m.get("load_s"),
                    m.get("capture_s"),
                )
                for m in measurements
            ],
        )
        self.db.commit()

    def tune_record(self, row: dict) -> None:
        """One combination of a sweep, measured or failed: kept (a re-run of the sweep skips it), and a measured
        one also as a measurement of its run (history --compare ranks it with the profiles)."""
        row = {**row, "measured_at": now_iso()}
        for k in ("combo", "software", "bench"):
            row[k] = json.dumps(row.get(k), sort_keys=True, default=str)
        self.db.execute(
            f"INSERT OR REPLACE INTO tune_results ({', '.join(TUNE_COLUMNS)}) VALUES ({', '.join('?' * len(TUNE_COLUMNS))})",
            tuple(row.get(k) for k in TUNE_COLUMNS),
        )
        if row.get("tokens_per_s") is not None:
            self.db.execute(
                "INSERT INTO measurements (run_id, host, instance, outcome, profile, running_profile, config_hash,"
                " tokens_per_s, accept_length) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    row["run_id"],
                    row["host"],
                    row["instance"],
                    row["outcome"],
                    row["combination"],
                    row.get("running_profile"),
                    row.get("config_hash"),
                    row["tokens_per_s"],
                    row.get("accept_length"),
                ),
            )
        self.db.commit()

    def tune_results(self, sweep: str) -> list[dict]:
        """The sweep's recorded combinations, oldest first."""
        rows = self.db.execute("SELECT * FROM tune_results WHERE sweep=? ORDER BY measured_at", (sweep,)).fetchall()
        out = []
        for r in rows:
            d = dict(r)
            for k in ("combo", "software", "bench"):
                d[k] = json.loads(d[k]) if d[k] else None
            out.append(d)
        return out

    def runs(self, limit: int = 20) -> list[dict]:
        rows = self.db.execute("SELECT * FROM runs ORDER BY id DESC LIMIT ?", (limit,)).fetchall()
        out = []
        for r in rows:
            d = dict(r)
            m = self.db.execute("SELECT * FROM measurements WHERE run_id=?", (r["id"],)).fetchall()
            d["measurements"] = [dict(x) for x in m]
            out.append(d)
        return out

    def compare(self) -> list[dict]:
        """Per profile, from every measurement that has a throughput: runs, medians, and whether the
        server verifiably ran that profile (running_profile == profile) when it was measured."""
        rows = self.db.execute(
            "SELECT m.*, r.started_at FROM measurements m JOIN runs r ON r.id = m.run_id"
            " WHERE m.tokens_per_s IS NOT NULL ORDER BY r.id"
        ).fetchall()
        by: dict[str, list] = {}
        for r in rows:
            by.setdefault(r["profile"] or "?", []).append(r)
        out = []
        for profile, ms in sorted(by.items()):
            tok = [m["tokens_per_s"] for m in ms]
            acc = [m["accept_length"] for m in ms if m["accept_length"] is not None]
            verified = sum(1 for m in ms if m["running_profile"] == profile)
            load = [m["load_s"] for m in ms if m["load_s"] is not None]
            capture = [m["capture_s"] for m in ms if m["capture_s"] is not None]
            out.append(
                {
                    "profile": profile,
                    "measurements": len(ms),
                    "median_tokens_per_s": round(statistics.median(tok), 1),
                    "best_tokens_per_s": round(max(tok), 1),
                    "median_accept_length": round(statistics.median(acc), 2) if acc else None,
                    "verified_running": f"{verified}/{len(ms)}",
                    # The model load and the CUDA-graph capture of its restarts (the restart's progress steps).
                    "median_load_s": round(statistics.median(load), 1) if load else None,
                    "median_capture_s": round(statistics.median(capture), 1) if capture else None,
                    "config_hashes": sorted({m["config_hash"] for m in ms if m["config_hash"]}),
                    "last_measured": ms[-1]["started_at"],
                }
            )
        return out
