"""python -m driver tune: a sweep of speculative and serving flags over the safe restart (issue 15, docs/tune.md).

One instance on one host (--limit, --instance), from a starting profile (--profile) and a grid (--grid, or
--grid-file). In order:

1. plan (commands.TUNE_PLAYBOOK, step plan): the combinations, SGLang's refusals and the combinations that would
   start the same server dropped with their reason, every other one checked by the installed SGLang's parser;
   nothing running is touched, and an invalid combination is dropped before any restart;
2. per combination not yet in the ledger for this sweep (a re-run resumes), the baseline (no speculation)
   first: the safe restart on it (lock, GPU gate, fail-fast, verify; a failure rolls back to the known-good
   and is recorded as failed, and the sweep goes on), then the fixed benchmark, in the restart's own module
   call under its lock (sglang_server's bench); each one is recorded at once. Every step runs the software
   generation the plan named (sglang_software), so the steps do not name it again;
3. the instance back on its own profile (or the winner, --keep-best), by the safe restart;
4. the ranking (combinations slower than no speculation marked), the winner written as a new profile file
   (never over the operator's), a plot (--svg).

Ctrl-C: the combination running ends as its restart does (a defined end), none after it begins, and the
instance is put back (step 3); a second Ctrl-C abandons that too.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import bench as benchmark
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import durable, outcomes, tune
from driver import commands, exitcodes
from driver.events import NOT_BEGUN

PLAYBOOK = commands.TUNE_PLAYBOOK
RESTART = commands.COMMANDS["restart"].playbook
MEASURED, FAILED = "measured", "failed"
# A combination that failed so still leaves the instance serving (or untouched): the sweep goes on.
GOES_ON = (outcomes.RESTARTED, outcomes.ROLLED_BACK, outcomes.INVALID_CONFIG)
# A combination whose restart ended so has its result: a re-run of the sweep does not measure it again.
DECIDED = (outcomes.RESTARTED, outcomes.ROLLED_BACK)


def usage(args, message: str) -> int:
    return commands.usage_error(args, message)


def load_grid_file(path: Path) -> dict:
    import yaml

    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise tune.GridError(f"--grid-file {path}: {exc}") from exc
    if not isinstance(doc, dict):
        raise tune.GridError(f"--grid-file {path}: a mapping of key to a list of values, not {type(doc).__name__}")
    return doc


def settings(args) -> tuple[dict, dict]:
    """(grid, bench) from the command line; GridError/ValueError name the option."""
    from driver import redact

    base = load_grid_file(args.grid_file) if args.grid_file else None
    grid = tune.parse_grid(args.grid, base)
    for key in grid:
        if redact.is_secret(key):
            raise tune.GridError(f"grid key {key!r} names a secret: a sweep shows its values everywhere; set it as one")
    try:
        levels = [int(c) for c in str(args.concurrency).split(",") if c.strip()]
    except ValueError:
        raise ValueError(f"--concurrency {args.concurrency!r}: whole numbers, comma-separated (1,4)") from None
    for opt, v in (("--requests", args.requests), ("--max-new-tokens", args.max_new_tokens), ("--repeat", args.repeat)):
        if v < 1:
            raise ValueError(f"{opt} {v}: at least 1")
    if not levels or min(levels) < 1 or args.warmup < 0:
        raise ValueError("--concurrency levels at least 1, --warmup at least 0")
    if args.target_concurrency is not None and args.target_concurrency not in levels:
        raise ValueError(f"--target-concurrency {args.target_concurrency}: not one of --concurrency {args.concurrency}")
    if not 0 <= args.margin < 1:
        raise ValueError(f"--margin {args.margin}: a fraction, 0 or more and below 1 (0.02: 2 %)")
    bench = {
        "concurrency": levels,
        "requests": args.requests,
        "max_new_tokens": args.max_new_tokens,
        "warmup": args.warmup,
        "repeat": args.repeat,
    }
    return grid, bench


def target_of(args, bench: dict) -> int:
    """The concurrency the sweep ranks at: --target-concurrency, else the first level."""
    return args.target_concurrency if args.target_concurrency is not None else bench["concurrency"][0]


class Sweep:
    """One tune run: its ledger run, its playbook steps through the runner, what each step's modules said."""

    def __init__(self, args, host: str, instance: str, grid: dict, bench: dict, interrupts):
        from driver import ledger, redact

        self.args, self.host, self.instance, self.grid, self.bench = args, host, instance, grid, bench
        self.interrupts = interrupts
        self.start = args.profile
        self.id = ""  # named once the plan says what it starts from (_steps)
        self.book = ledger.Ledger()
        self.redactor = redact.Redactor()
        self.run_id = self.book.start("tune", self.redactor.argv(args.argv), args.inventory, self.start)
        self.dir = self.book.events_dir(self.run_id)
        self.steps = 0
        self.evidence = None  # the last step's crash evidence bundle, if it fetched any
        self.touched = False  # a measure step ran: the instance may be on a combination
        self.back: tuple[int, str] | None = None  # the put-back step's (exit code, cause), once it ran
        self.software: dict | None = None  # the software generation the plan rendered with (sglang_software)

    def say(self, line: str) -> None:
        if not self.args.json:
            print(line, flush=True)

    def playbook(self, playbook: str, extra: dict, command: str, after_interrupt: bool = False):
        """Run one step: (tracker, {module: [results]}, exit code). Each step has its own cancel file: a Ctrl-C
        makes it; the step that puts the instance back after one (after_interrupt) starts without it."""
        from driver import events, evidence, step

        self.steps += 1
        step_dir = self.dir / f"step-{self.steps:03d}"
        step_dir.mkdir(mode=0o700)
        if after_interrupt:
            self.interrupts.cancel_file = step_dir / "cancel"  # only the second Ctrl-C (abandon) stops it
        else:
            self.interrupts.arm(step_dir / "cancel")
        results: dict[str, list] = {}
        tracker = events.Tracker(command)

        def on_event(event: dict) -> None:
            tracker.handle(event)
            data = event.get("event_data") or {}
            if event.get("event") in ("runner_on_ok", "runner_on_failed") and data.get("host") == self.host:
                results.setdefault(events.module_of(data), []).append(data.get("res") or {})

        job = step.job(
            playbook,
            step_dir,
            "tune",
            inventory=self.args.inventory,
            limit=self.host,
            extravars=[*self.args.extra_vars, json.dumps(extra)],
            redactor=self.redactor,
            verbosity=self.args.verbose,
        )
        outcome = step.run(job, on_event, self.interrupts, step_dir / "events.jsonl")
        code = tracker.exit_code(outcome.status, outcome.rc, self.interrupts.abandoned)
        self.evidence = None
        try:  # a failed restart's crash evidence, fetched by the playbook: one bundle in the step's directory
            self.evidence = evidence.package(step_dir, self.run_id)
        except OSError as exc:
            print(f"tune: the crash evidence stays under {evidence.directory(step_dir)}: {exc}", file=sys.stderr)
        return tracker, results, code

    # ------------------------------------------------------------------ the steps

    def plan(self) -> tuple[dict | None, int, str]:
        extra = {
            "sglang_tune_step": "plan",
            "sglang_tune": {"instance": self.instance, "profile": self.start, "grid": self.grid},
        }
        tracker, results, code = self.playbook(PLAYBOOK, extra, "validate")
        res = (results.get("sglang_tune") or [None])[-1]
        if res and res.get("plan") and not res.get("failed"):
            return res["plan"], exitcodes.OK, ""
        return None, code or exitcodes.FAILED, cause_of(tracker) or (res or {}).get("msg") or "the plan failed"

    def measure(self, combo: dict) -> dict:
        """The safe restart on one combination, then the benchmark: the ledger's row."""
        name = combo["name"]
        extra = {
            "sglang_tune_step": "measure",
            "sglang_tune": {"instance": self.instance, "profile": self.start, "sweep": self.id, "bench": self.bench},
            tune.profile_var(name): combo["profile"],
            "sglang_service_instance_profiles": {self.instance: name},
            **({"sglang_software": self.software} if self.software else {}),
        }
        t0 = time.monotonic()
        self.touched = True
        tracker, _, code = self.playbook(PLAYBOOK, extra, "restart")
        h = tracker.hosts.get(self.host)
        server = (h.instances.get(self.instance) if h else None) or {}  # the restart's result (events.record_instance)
        # Nothing said of the combination: a Ctrl-C before its restart began, or its benchmark cut short by a SIGTERM.
        cut = server.get("bench_error") == benchmark.INTERRUPTED
        if cut or (server.get("outcome") in (None, NOT_BEGUN) and self.interrupts.interrupted):
            return {
                "combination": name,
                "outcome": NOT_BEGUN,
                "label": combo["label"],
                **({"cause": f"{server['bench_error']}: not recorded, a re-run measures it"} if cut else {}),
            }  # not recorded: re-run measures it
        b = server.get("bench") or {}
        kg = server.get("known_good") or {}
        whole = bool(b.get("output_tokens_per_s")) and not b.get("failed")  # every request answered in full
        measured = code == exitcodes.OK and server.get("outcome") == outcomes.RESTARTED and whole
        row = {
            "sweep": self.id,
            "combination": name,
            "run_id": self.run_id,
            "host": self.host,
            "instance": self.instance,
            "start_profile": self.start,
            "label": combo["label"],
            "combo": combo,
            "outcome": MEASURED if measured else FAILED,
            "cause": None if measured else failure_of(server, tracker, b, self.evidence),
            "restart_outcome": server.get("outcome"),
            "exit_code": code,
            "config_hash": kg.get("config_hash"),
            "software": kg.get("software"),
            "gpu_model": server.get("gpu_model"),
            "running_profile": (server.get("verify") or {}).get("running_profile"),
            "bench": b or None,
        }
        # The sweep's own time for this combination: all of it but the server's start (the start phase: process
        # start to ready) and the benchmark itself (docs/tune.md, goal at most 5 s).
        start_s = sum(p.get("seconds") or 0 for p in server.get("phases") or [] if p.get("phase") == outcomes.START)
        timing = {"seconds": round(time.monotonic() - t0, 2), "start_s": round(start_s, 2), "bench_s": b.get("seconds")}
        if measured:
            timing["overhead_s"] = round(timing["seconds"] - start_s - (b.get("seconds") or 0), 2)
        row["timing"], row["bench"] = timing, {**b, "timing": timing}
        for k in ("output_tokens_per_s", "accept_length", "ttft_median_s", "ttft_p99_s", "itl_median_s", "itl_p99_s"):
            row["tokens_per_s" if k == "output_tokens_per_s" else k] = b.get(k) if measured else None
        self.book.tune_record(row)
        return row

    def put_back(self, winner: tuple[str, dict] | None = None) -> tuple[int, str]:
        """The instance on its own profile again (or the winner (name, profile): passed along, so that it runs
        wherever its file went), by the safe restart."""
        extra: dict = {"sglang_service_instances_selected": [self.instance]}
        if winner:
            extra["sglang_service_instance_profiles"] = {self.instance: winner[0]}
            extra[tune.profile_var(winner[0])] = winner[1]
        # Never armed: a first Ctrl-C now must not keep the instance on a combination (a second one abandons it).
        tracker, _, code = self.playbook(RESTART, extra, "restart", after_interrupt=True)
        self.back = (code, cause_of(tracker))
        return self.back


def failure_of(server: dict, tracker, b: dict, bundle) -> str:
    """Why a combination has no measurement: its restart's outcome and cause, or what its benchmark lost."""
    if server.get("outcome") == outcomes.RESTARTED and not cause_of(tracker):
        if server.get("bench_error"):
            return server["bench_error"]
        lost = [f for lv in b.get("levels") or [] for f in lv.get("failures") or []] + (b.get("warmup_failures") or [])
        return f"the benchmark: {b.get('failed', '?')} request(s) failed" + (f": {lost[0]}" if lost else "")
    text = f"{server.get('outcome') or 'no restart'}: {cause_of(tracker) or 'no result'}"
    return text + (f" (crash evidence: {bundle})" if bundle else "")


def cause_of(tracker) -> str:
    return "; ".join(f.message for h in tracker.hosts.values() for f in h.failures)[:600]


def results_of(recorded: list[dict]) -> list[dict]:
    """Ledger rows as rank() takes them."""
    return [
        {
            **r,
            "name": r["combination"],
            "output_tokens_per_s": r["tokens_per_s"],
            "label": r["label"] if r["combination"] != tune.BASELINE else "no speculation",
        }
        for r in recorded
    ]


def writable(d: Path) -> bool:
    """d, or the nearest directory above it that exists, is one this user can write (mkdir makes the rest)."""
    d = d.resolve()
    while not d.exists():
        d = d.parent
    return d.is_dir() and os.access(d, os.W_OK | os.X_OK)


def inventory_dir(source: str) -> Path:
    p = Path(source)
    return p if p.is_dir() else p.parent


def line_of(i: int, n: int, row: dict) -> str:
    if row["outcome"] == MEASURED:
        return (
            f"[{i}/{n}] {row['combination']} {row['label']}: {row['tokens_per_s']} tok/s, accept "
            f"{row['accept_length']}, TTFT p50 {row['ttft_median_s']} s, ITL p50 {row['itl_median_s']} s "
            f"({row['timing']['seconds']} s, the sweep's own {row['timing'].get('overhead_s')} s)"
        )
    return f"[{i}/{n}] {row['combination']} {row['label']}: FAILED ({row['cause']})"


def main(args) -> int:
    from driver import inventory
    from driver.interrupts import Interrupts

    try:
        checked = inventory.check(args.inventory, args.limit, commands.TUNE_PLAYBOOK, args.instance, args.extra_vars)
    except inventory.InventoryError as e:
        return usage(args, str(e))
    if len(checked.hosts) != 1:
        return usage(args, f"tune runs on one host: --limit matches {len(checked.hosts)} ({', '.join(checked.hosts)})")
    if len(args.instance) != 1:
        return usage(args, "tune measures one instance: give --instance NAME once")
    if not args.profile:
        return usage(args, "tune needs its starting profile: --profile NAME (a profile of sglang_profiles)")
    if args.name and not tune.FLAG_NAME.match(args.name):
        return usage(args, f"--name {args.name!r}: lowercase letters, digits and '_'")
    try:
        grid, bench = settings(args)
    except (tune.GridError, ValueError) as exc:
        return usage(args, str(exc))
    for opt, where in (("--profile-dir", args.profile_dir), ("--svg", Path(args.svg).parent if args.svg else None)):
        if where is not None and not writable(Path(where)):
            return usage(args, f"{opt} {where}: not a directory this user can write (checked before anything runs)")
    interrupts = Interrupts("tune")
    previous = interrupts.install()
    try:
        return _sweep(args, Sweep(args, checked.hosts[0], args.instance[0], grid, bench, interrupts), checked)
    except KeyboardInterrupt:
        return exitcodes.INTERRUPTED
    finally:
        Interrupts.restore(previous)


def _sweep(args, sweep: Sweep, checked) -> int:
    t0 = time.monotonic()
    code, report = exitcodes.OK, {}
    try:
        code, report = _steps(args, sweep, checked)
    except Exception as exc:  # contained: the cause, the instance put back, never a traceback
        code, report = exitcodes.FAILED, {"cause": f"{type(exc).__name__}: {exc}"}
        print(f"tune: stopped by {type(exc).__name__}: {exc}", file=sys.stderr)
        if sweep.touched and sweep.back is None and not sweep.interrupts.abandoned:
            try:
                back_code, back_cause = sweep.put_back()
            except Exception as again:
                back_code, back_cause = exitcodes.FAILED, f"{type(again).__name__}: {again}"
            report["put_back"] = {"exit_code": back_code, "profile": "its own", "cause": back_cause}
            if back_code != exitcodes.OK:
                print(f"tune: putting {sweep.instance} back failed: {back_cause}", file=sys.stderr)
    finally:
        if sweep.interrupts.interrupted:
            code = exitcodes.INTERRUPTED
        try:
            sweep.book.finish(
                sweep.run_id,
                code,
                exitcodes.MEANING.get(code, "?"),
                round(time.monotonic() - t0, 1),
                [sweep.host],
                [],
                str(sweep.dir),
            )
            sweep.book.close()
        except Exception as exc:  # the ledger's disk or database: said, never a traceback over the outcome
            print(f"tune: the ledger could not record the run's end: {type(exc).__name__}: {exc}", file=sys.stderr)
    report.update(
        command="tune", exit_code=code, meaning=exitcodes.MEANING.get(code, "?"), run_id=sweep.run_id, sweep=sweep.id
    )
    if args.json:
        print(json.dumps(report, default=str))
    return code


def _steps(args, sweep: Sweep, checked) -> tuple[int, dict]:
    """The sweep once its options are checked: the plan, each combination not yet recorded measured, then the
    conclusion (_conclude); (exit code, report)."""
    plan, code, cause = sweep.plan()
    if plan is None:
        print(f"tune: the plan failed, nothing was restarted: {cause}", file=sys.stderr)
        return code, {"cause": cause}
    # Named by what it starts from too: a changed profile, software or model is another sweep, never resumed.
    sweep.id = tune.sweep_id(sweep.host, sweep.instance, sweep.start, sweep.grid, sweep.bench, plan.get("fingerprint"))
    sweep.software = plan.get("software")
    name, target, refusal = winner_file(args, sweep, checked, plan)
    if refusal:
        print(f"python -m driver tune: {refusal}", file=sys.stderr)
        return exitcodes.USAGE, {"cause": refusal}
    sweep.say(f"sweep {sweep.id}: {sweep.instance} on {sweep.host} from profile {sweep.start}")
    combos, dropped = combinations_of(sweep, plan)
    if args.check:  # the plan only: nothing restarted
        for c in combos:
            sweep.say(
                f"would measure {c['name']}: {c['label']}" + (f" ({'; '.join(c['notes'])})" if c["notes"] else "")
            )
        return exitcodes.OK, {"combinations": combos, "dropped": dropped}
    stopped = measure_all(sweep, combos)
    return _conclude(args, sweep, combos, dropped, name, target, stopped)


def _conclude(
    args, sweep: Sweep, combos: list[dict], dropped: list[dict], name: str, target: Path, stopped: str | None
) -> tuple[int, dict]:
    """After the measurements: the ranking, the instance put back, the winner's profile (name) written at target,
    the plot; (exit code, report)."""
    recorded = sweep.book.tune_results(sweep.id)
    ranking = Ranking.of(args, sweep, combos, recorded, stopped)
    winner = ranking.winner(sweep, combos, name)
    keep = winner if args.keep_best else None
    # Put back only when this run moved the instance; first, so that nothing written below can stand in its way.
    back_code, back_cause = put_back_if_moved(sweep, keep)
    written, file_error = write_winner(sweep, target, winner, ranking) if winner else (None, None)
    table(sweep, ranking.ranked, dropped, written, ranking.best, ranking.decision, ranking.at)
    if args.svg and ranking.ranked:
        file_error = write_plots(sweep, args.svg, ranking) or file_error
    overheads = overheads_of(recorded)
    decision = ranking.decision
    report = {
        # Per measured combination, the sweep's own seconds beyond the server's start and the benchmark.
        "overhead_median_s": round(statistics.median(overheads), 2) if overheads else None,
        "overheads_s": overheads,
        "ranked": ranking.ranked,
        "dropped": dropped,
        "winner": decision["winner"]["name"] if decision["winner"] else None,
        "verdict": decision["verdict"],
        "why": decision["why"],
        "forced": ranking.best is not None and decision["winner"] is None,
        "target_concurrency": ranking.at,
        "margin": args.margin,
        "baseline_measured": ranking.base is not None,
        "profile_file": str(written) if written else None,
        "complete": ranking.complete,
        "stopped": stopped,
        "put_back": {"exit_code": back_code, "profile": keep[0] if keep else "its own", "cause": back_cause},
        "file_error": file_error,
    }
    if back_code != exitcodes.OK:
        print(f"tune: putting {sweep.instance} back failed: {back_cause}", file=sys.stderr)
        return back_code, report
    if stopped:
        print(f"tune: the sweep stopped: {stopped}", file=sys.stderr)
        return exitcodes.NOT_RECOVERED, report
    return exitcodes.OK, report


def winner_file(args, sweep: Sweep, checked, plan: dict) -> tuple[str, Path, str | None]:
    """(the winner's profile name, its file, why the sweep refuses them): never over a profile or file there is."""
    name = args.name or tune.default_name(sweep.start, sweep.id)
    target = args.profile_dir or inventory_dir(checked.source) / tune.PROFILE_DIR
    target = target / tune.profile_file_name(name)
    refusal = None
    if name in (plan.get("profiles") or []):
        refusal = f"--name {name}: a profile of that name exists already; a sweep never replaces one (choose another)"
    elif target.exists():
        refusal = f"--name {name}: {target} exists already (an earlier sweep's); choose another name or remove it"
    return name, target, refusal


def combinations_of(sweep: Sweep, plan: dict) -> tuple[list[dict], list[dict]]:
    """(the plan's valid combinations, the dropped ones with their reason), each dropped one said."""
    combos = [c for c in plan["combinations"] if c["valid"]]
    dropped = plan["dropped"] + [
        {"values": c["values"], "reason": "refused by SGLang's parser: " + "; ".join(c["problems"])}
        for c in plan["combinations"]
        if not c["valid"]
    ]
    for d in dropped:
        sweep.say(f"dropped {json.dumps(d['values'])}: {d['reason']}")
    return combos, dropped


def measure_all(sweep: Sweep, combos: list[dict]) -> str | None:
    """Each combination the ledger has no result of yet, in order; why the sweep stopped early, or None."""
    # Done: those whose restart ended (measured, or failed on the combination itself). A host unreachable, a lock
    # held, busy GPUs or a stop before the restart say nothing of the combination: measured again.
    done = {r["combination"] for r in sweep.book.tune_results(sweep.id) if r["restart_outcome"] in DECIDED}
    todo = [c for c in combos if c["name"] not in done]
    if done:
        sweep.say(
            f"resuming: {len(combos) - len(todo)} of {len(combos)} combination(s) recorded, {len(todo)} to measure"
        )
    n = len(combos)
    for c in todo:
        if sweep.interrupts.interrupted:
            break
        row = sweep.measure(c)
        if row["outcome"] == NOT_BEGUN:
            return f"{c['name']}: {row['cause']}" if row.get("cause") else None
        sweep.say(line_of(n - len(todo) + todo.index(c) + 1, n, row))
        if row["outcome"] == FAILED and row["restart_outcome"] not in GOES_ON:
            return f"{c['name']}: {row['cause']}"  # not serving its known-good, locked, GPUs busy: no further
    return None


@dataclass
class Ranking:
    """What the sweep's recorded rows say, ranked at one concurrency: the decision, the combination whose profile
    is written (best), the baseline's row, and whether every combination has its result (complete)."""

    at: int
    ranked: list[dict]
    decision: dict
    best: dict | None
    base: dict | None
    complete: bool

    @classmethod
    def of(cls, args, sweep: Sweep, combos: list[dict], recorded: list[dict], stopped: str | None) -> Ranking:
        """The recorded rows of this plan's combinations, ranked at the target concurrency (--target-concurrency)."""
        names = {c["name"] for c in combos}
        at = target_of(args, sweep.bench)
        ranked = tune.rank(results_of([r for r in recorded if r["combination"] in names]), at)
        decision = tune.decide(ranked, args.margin)
        # --force: the fastest speculative combination, clear of the noise or not (said in the file and here).
        best = decision["winner"] or (
            decision["best"] if args.force and decision["verdict"] == tune.NO_DIFFERENCE else None
        )
        base = next((r for r in ranked if r["name"] == tune.BASELINE and r["output_tokens_per_s"]), None)
        complete = (
            not stopped
            and not sweep.interrupts.interrupted
            and names <= {r["combination"] for r in recorded if r["restart_outcome"] in DECIDED}
        )
        return cls(at, ranked, decision, best, base, complete)

    def winner(self, sweep: Sweep, combos: list[dict], name: str) -> tuple[str, dict] | None:
        """(name, the best combination's profile), only when every combination has its result."""
        if not (self.best and self.complete):
            return None
        combo = next(c for c in combos if c["name"] == self.best["name"])
        profile = {**combo["profile"], "description": f"tuned from {sweep.start}: {combo['label']}"}
        one = tune.single_stream(self.best)
        return name, {**profile, **({"baseline": {"output_tokens_per_s": one}} if one is not None else {})}


def overheads_of(recorded: list[dict]) -> list[float]:
    """Each measured combination's own seconds beyond the server's start and the benchmark, sorted."""
    overheads = [((r.get("bench") or {}).get("timing") or {}).get("overhead_s") for r in recorded]
    return sorted(o for o in overheads if o is not None)


def put_back_if_moved(sweep: Sweep, keep: tuple[str, dict] | None) -> tuple[int, str]:
    """The put-back step's (exit code, cause): none when nothing was restarted or the operator abandoned it."""
    if not sweep.touched:
        return exitcodes.OK, "nothing was restarted"
    if sweep.interrupts.abandoned:
        return exitcodes.INTERRUPTED, f"abandoned: {sweep.instance} runs what the last step left"
    return sweep.put_back(keep)


def write_winner(
    sweep: Sweep, target: Path, winner: tuple[str, dict], ranking: Ranking
) -> tuple[Path | None, str | None]:
    """(the winner's profile file written, or None with why not): how it was measured said in the file."""
    name, profile = winner
    best, decision = ranking.best, ranking.decision
    how = (
        f"python -m driver tune sweep {sweep.id} on {sweep.host}/{sweep.instance} "
        f"({best.get('gpu_model') or 'GPU model unknown'}), {json.dumps(sweep.bench)}, ranked at concurrency "
        f"{ranking.at}, {time.strftime('%Y-%m-%d')}; {decision['verdict']}: {decision['why']}"
        + ("; written with --force, not clear of the noise" if decision["winner"] is None else "")
    )
    text = tune.profile_file(name, {k: v for k, v in profile.items() if k != "baseline"}, best, ranking.base, how)
    try:
        return write_atomic(target, text), None
    except OSError as exc:  # measured and recorded all the same; the instance was put back before
        file_error = f"the winner's profile file {target} could not be written: {exc}"
        print(f"tune: {file_error}", file=sys.stderr)
        return None, file_error


def write_plots(sweep: Sweep, svg: str, ranking: Ranking) -> str | None:
    """The ranking's plot at svg (--svg), and beside it tok/s at every level; why not, or None."""
    try:
        title = f"sweep {sweep.id}: {sweep.instance} on {sweep.host}, concurrency {ranking.at}"
        write_atomic(Path(svg), tune.svg(ranking.ranked, title))
        curves = tune.concurrency_svg(ranking.ranked)
        if curves:  # beside it: tok/s at every level, where speculation's gain shrinks
            write_atomic(Path(svg).with_name(Path(svg).stem + "-concurrency.svg"), curves)
    except OSError as exc:
        file_error = f"--svg {svg}: {exc}"
        print(f"tune: {file_error}", file=sys.stderr)
        return file_error
    return None


def write_atomic(path: Path, text: str) -> Path:
    """path with text, whole or not at all (durable.write_atomic: its temporary file never left behind), in a
    directory made first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    durable.write_atomic(str(path), text, 0o644)  # a profile or a plot: nothing secret in it
    return path


def table(sweep: Sweep, ranked: list[dict], dropped: list[dict], written, best, decision: dict, at: int) -> None:
    if sweep.args.json:
        return
    from driver import display

    levels = sweep.bench["concurrency"]
    t = display.table(
        f"sweep {sweep.id}, ranked by output tok/s at concurrency {at} (median of {sweep.bench['repeat']}, 95% interval)",
        ("rank", "combination", "values", "tok/s [95% interval]", "vs no spec", "accept [95%]",
         "TTFT p50 [95%] / p99 s", "ITL p50 [95%] / p99 s", *(f"tok/s at {c}" for c in levels if c != at), "result"),
    )  # fmt: skip

    def noisy(r: dict, key: str) -> str:  # a figure's median with its repeats' interval, where they give one
        iv = (r.get("intervals") or {}).get(key) or (r.get("interval") if key == "output_tokens_per_s" else None)
        value = r.get(key)
        return ("-" if value is None else str(value)) + (f" [{iv[0]}, {iv[1]}]" if iv else "")

    for r in ranked:
        verdict = (
            "slower than no speculation"
            if r["slower_than_baseline"]
            else ("failed: " + (r.get("cause") or "") if r["outcome"] == FAILED else "")
        )
        others = [tune.at_level(r, c).get("output_tokens_per_s") for c in levels if c != at]
        t.add_row(
            str(r["rank"] or "-"),
            r["name"],
            r["label"],
            noisy(r, "output_tokens_per_s"),
            str(r["vs_baseline"] or "-"),
            noisy(r, "accept_length"),
            f"{noisy(r, 'ttft_median_s')} / {r.get('ttft_p99_s')}",
            f"{noisy(r, 'itl_median_s')} / {r.get('itl_p99_s')}",
            *(str(v if v is not None else "-") for v in others),
            verdict[:80],
        )
    display.console().print(t)
    if best and written:
        forced = " (--force: NOT clear of the noise)" if decision["winner"] is None else ""
        print(
            f"winner {best['name']} ({best['label']}){forced}: {best['output_tokens_per_s']} tok/s, "
            f"x{best['vs_baseline']} no speculation; written as {written}"
        )
    elif decision["verdict"] == tune.NO_DIFFERENCE:
        print(
            f"no significant difference at concurrency {at}: {decision['why']}; no profile written (--force writes it)"
        )
    elif not best:
        print(f"no winner at concurrency {at}: {decision['why']}; no profile written")
