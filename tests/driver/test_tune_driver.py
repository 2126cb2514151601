"""driver/tune.py without a lab: the sweep's steps with each playbook step answered by a fake (what the modules
would have said, in a real events.Tracker), the ledger real. The same steps on lab nodes: tests/e2e/test_tune.py."""

from __future__ import annotations

import json
import sqlite3

import pytest

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import bench as benchmark
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import outcomes, tune
from driver import cli, commands, events, exitcodes, inventory
from driver import tune as dtune

HOST = "gpu-node-01"
SOFTWARE = {"generation": "0123456789abcdef", "venv": "/opt/ml-env.d/0123456789abcdef", "sglang_version": "0.5.23"}


def combo(name: str, label: str, valid: bool = True, problems=()) -> dict:
    return {
        "name": name,
        "label": label,
        "values": {"speculative_num_steps": label},
        "flags": {},
        "env": {},
        "notes": [],
        "profile": {"description": label, "flags": {"speculative_num_steps": 3}},
        "valid": valid,
        "problems": list(problems),
    }


PLAN = {
    "combinations": [
        combo(tune.BASELINE, "no speculation"),
        combo("tune_a", "steps=1"),
        combo("tune_b", "steps=3"),
        combo("tune_c", "steps=5"),
        combo("tune_x", "steps=9", False, ["flags: --bad is not a flag"]),
    ],
    "dropped": [{"values": {"speculative_num_steps": 7}, "reason": "the same server as steps=1"}],
}


class Fake:
    """Answers each step of the sweep: plan, measure (per combination: tok/s or an outcome), put back."""

    def __init__(
        self,
        speeds: dict,
        plan=PLAN,
        plan_code=exitcodes.OK,
        interrupt_after: str | None = None,
        failed=None,
        bench_errors=None,
    ):
        self.speeds, self.plan, self.plan_code, self.interrupt_after = speeds, plan, plan_code, interrupt_after
        self.failed = failed or {}  # combination: requests of its benchmark that failed
        self.bench_errors = bench_errors or {}  # combination: why its benchmark could not run (restarted all the same)
        self.calls: list[tuple] = []
        self.software: list = []  # each step's sglang_software (extra vars): the plan's on every measure step
        self.spread = 0.02  # each measured level's interval: its tok/s -+ this fraction

    def __call__(self, sweep, playbook, extra, command, after_interrupt=False):
        tracker = events.Tracker(command)
        h = tracker.host(HOST)
        step = extra.get("sglang_tune_step") or "put_back"
        self.calls.append((step, (extra.get("sglang_service_instance_profiles") or {}).get("main"), after_interrupt))
        self.software.append(extra.get("sglang_software"))
        if step == "plan":
            if self.plan_code:
                h.failures.append(events.Failure(self.plan_code, "Plan", "grid key 'x' is set by sglang_instances[0]"))
                return tracker, {}, self.plan_code
            plan = {
                **self.plan,
                "profiles": ["eagle3_topk1", "baseline_no_spec"],
                "fingerprint": "f1",
                "software": SOFTWARE,
            }
            return tracker, {"sglang_tune": [{"instance": "main", "plan": plan}]}, exitcodes.OK
        if step == "put_back":
            h.instances["main"] = {"instance": "main", "outcome": outcomes.RESTARTED}
            return tracker, {}, exitcodes.OK
        name = extra["sglang_service_instance_profiles"]["main"]
        got = self.speeds[name]
        if name == self.interrupt_after:
            sweep.interrupts.count = 1  # a Ctrl-C while this one ran: it ends, no other begins
        phases = [{"phase": outcomes.START, "ok": True, "seconds": 2.0}]
        kg = {"config_hash": f"hash-{name}", "software": {"sglang_version": "0.5.23"}}
        if isinstance(got, str):  # an outcome: the restart failed so
            h.instances["main"] = {"instance": "main", "outcome": got, "phases": phases}
            h.failures.append(events.Failure(exitcodes.OUTCOME_CODES.get(got, 1), "Restart", f"{name} crashed"))
            return tracker, {}, exitcodes.OUTCOME_CODES.get(got, exitcodes.FAILED)
        b = {
            "output_tokens_per_s": got,
            "accept_length": 2.0,
            "ttft_median_s": 0.01,
            "ttft_p99_s": 0.02,
            "itl_median_s": 0.003,
            "itl_p99_s": 0.004,
            "seconds": 1.5,
            "failed": self.failed.get(name, 0),
            "levels": [
                {
                    "concurrency": 1,
                    "output_tokens_per_s": got,
                    "failures": ["HTTP 503"] * self.failed.get(name, 0),
                    # three repeats within 2 % of each other, unless the fake says how wide (self.spread)
                    "samples": [got] * 3,
                    "interval": (round(got * (1 - self.spread), 2), round(got * (1 + self.spread), 2)),
                    "accept_length": 2.0,
                    "intervals": {"accept_length": (1.9, 2.1), "ttft_median_s": (0.009, 0.011)},
                }
            ],
        }
        # The benchmark is in the restart's own result (sglang_server's bench, under its lock).
        h.instances["main"] = {
            "instance": "main",
            "outcome": outcomes.RESTARTED,
            "phases": phases,
            "known_good": kg,
            "verify": {"running_profile": name},
            "bench": b,
            "gpu_model": "NVIDIA H200",
        }
        if name in self.bench_errors:
            h.instances["main"].update(bench=None, bench_error=self.bench_errors[name])
        return tracker, {}, exitcodes.OK


@pytest.fixture
def env(tmp_path, monkeypatch, ledger_path):
    inv = tmp_path / "inv" / "hosts.yml"
    inv.parent.mkdir()
    inv.write_text("all: {}\n")
    monkeypatch.setattr(
        inventory, "check", lambda i, limit, *selection: inventory.Checked(source=str(inv), hosts=[HOST])
    )
    return tmp_path, inv, ledger_path


# A tune of `main` on HOST from eagle3_topk1 (the fake's plan answers for any grid).
ARGV = [
    "tune",
    "--limit",
    HOST,
    "--instance",
    "main",
    "--profile",
    "eagle3_topk1",
    "--grid",
    "speculative_num_steps=1,3",
]


def run(monkeypatch, fake, *extra):
    # The ranked table as wide as its cells: rich takes 80 columns where it finds a terminal (as under xdist).
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.setattr(dtune.Sweep, "playbook", lambda self, *a, **k: fake(self, *a, **k))
    code = cli.main([*ARGV, *extra])
    return code


def doc_of(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_a_sweep_measures_each_valid_combination_ranks_them_and_writes_the_winner(env, monkeypatch, capsys):
    tmp, inv, ledger_path = env
    fake = Fake({tune.BASELINE: 100.0, "tune_a": 90.0, "tune_b": 150.0, "tune_c": outcomes.ROLLED_BACK})
    code = run(monkeypatch, fake, "--json", "--name", "fast", "--svg", str(tmp / "s.svg"))
    doc = doc_of(capsys)
    assert code == exitcodes.OK, doc
    assert [c[:2] for c in fake.calls] == [
        ("plan", None),
        ("measure", tune.BASELINE),
        ("measure", "tune_a"),
        ("measure", "tune_b"),
        ("measure", "tune_c"),
        ("put_back", None),
    ]
    # Every measure step runs the software the plan named (no step names it again); the put-back names its own.
    assert fake.software == [None, SOFTWARE, SOFTWARE, SOFTWARE, SOFTWARE, None]
    assert [(r["name"], r["rank"], r["slower_than_baseline"]) for r in doc["ranked"]] == [
        ("tune_b", 1, False),
        (tune.BASELINE, 2, False),
        ("tune_a", 3, True),
        ("tune_c", None, False),
    ]
    assert doc["winner"] == "tune_b" and doc["complete"] is True and doc["put_back"]["exit_code"] == 0
    assert [d["reason"] for d in doc["dropped"]] == [
        "the same server as steps=1",
        "refused by SGLang's parser: flags: --bad is not a flag",
    ]
    failed = doc["ranked"][-1]
    assert failed["outcome"] == "failed" and failed["cause"] == "rolled_back: tune_c crashed"
    written = inv.parent / "group_vars" / "sglang_nodes" / "tuned_fast.yml"  # beside the inventory
    assert doc["profile_file"] == str(written) and "sglang_tuned_profile_fast:" in written.read_text()
    assert "output_tokens_per_s: 150.0" in written.read_text()
    # Each measured one's own time: its step's wall time (the fake's: nearly 0) less start (2 s) and bench (1.5 s).
    assert len(doc["overheads_s"]) == 3 and all(-3.5 <= o < -3.0 for o in doc["overheads_s"]), doc["overheads_s"]
    assert (tmp / "s.svg").read_text().startswith("<svg")
    db = sqlite3.connect(ledger_path)
    rows = db.execute(
        "SELECT combination, outcome, gpu_model, config_hash FROM tune_results ORDER BY measured_at"
    ).fetchall()
    assert rows == [
        (tune.BASELINE, "measured", "NVIDIA H200", f"hash-{tune.BASELINE}"),
        ("tune_a", "measured", "NVIDIA H200", "hash-tune_a"),
        ("tune_b", "measured", "NVIDIA H200", "hash-tune_b"),
        ("tune_c", "failed", None, None),
    ]
    assert db.execute("SELECT command, exit_code FROM runs").fetchall() == [("tune", 0)]
    db.close()

    written.unlink()  # (the name is taken while its file exists: refused before anything restarts)
    again = Fake({})  # every combination is recorded: a re-run measures none, and restarts nothing
    assert run(monkeypatch, again, "--json", "--name", "fast") == exitcodes.OK
    assert [c[0] for c in again.calls] == ["plan"]
    redoc = doc_of(capsys)
    assert redoc["winner"] == "tune_b" and redoc["put_back"]["cause"] == "nothing was restarted"
    assert run(monkeypatch, Fake({}), "--json", "--name", "fast") == exitcodes.USAGE  # its file exists now
    assert "tuned_fast.yml exists already (an earlier sweep's)" in doc_of(capsys)["cause"]


def test_an_interrupted_sweep_stops_after_the_running_one_and_puts_the_instance_back(env, monkeypatch, capsys):
    fake = Fake({tune.BASELINE: 100.0, "tune_a": 120.0, "tune_b": 150.0, "tune_c": 10.0}, interrupt_after="tune_a")
    code = run(monkeypatch, fake, "--json")
    doc = doc_of(capsys)
    assert code == exitcodes.INTERRUPTED
    assert fake.calls == [
        ("plan", None, False),
        ("measure", tune.BASELINE, False),
        ("measure", "tune_a", False),
        ("put_back", None, True),
    ]
    assert doc["complete"] is False and doc["profile_file"] is None  # no winner from half a sweep
    resumed = Fake({"tune_b": 150.0, "tune_c": 10.0})
    assert run(monkeypatch, resumed, "--json") == exitcodes.OK
    assert [c[1] for c in resumed.calls if c[0] == "measure"] == ["tune_b", "tune_c"]  # only the rest
    assert doc_of(capsys)["winner"] == "tune_b"


def test_a_combination_that_leaves_no_server_stops_the_sweep(env, monkeypatch, capsys):
    fake = Fake({tune.BASELINE: 100.0, "tune_a": outcomes.NOT_RECOVERED, "tune_b": 1.0, "tune_c": 1.0})
    code = run(monkeypatch, fake, "--json")
    doc = doc_of(capsys)
    assert code == exitcodes.NOT_RECOVERED
    assert [c[1] for c in fake.calls if c[0] == "measure"] == [tune.BASELINE, "tune_a"]
    assert doc["stopped"] == "tune_a: not_recovered: tune_a crashed" and fake.calls[-1][0] == "put_back"


def test_a_failed_plan_restarts_nothing_and_says_why(env, monkeypatch, capsys):
    fake = Fake({}, plan_code=exitcodes.INVALID_CONFIG)
    assert run(monkeypatch, fake, "--json") == exitcodes.INVALID_CONFIG
    assert [c[0] for c in fake.calls] == ["plan"]
    assert doc_of(capsys)["cause"] == "grid key 'x' is set by sglang_instances[0]"


def test_check_mode_plans_and_lists_what_it_would_measure(env, monkeypatch, capsys):
    fake = Fake({})
    assert run(monkeypatch, fake, "--check") == exitcodes.OK
    out = capsys.readouterr().out
    assert [c[0] for c in fake.calls] == ["plan"]
    assert "would measure tune_b: steps=3" in out and 'dropped {"speculative_num_steps": 7}: the same server' in out


def test_without_a_winner_no_profile_is_written_and_the_table_says_so(env, monkeypatch, capsys):
    _, inv, _ = env
    fake = Fake({tune.BASELINE: 100.0, "tune_a": 90.0, "tune_b": 80.0, "tune_c": 70.0})
    assert run(monkeypatch, fake) == exitcodes.OK
    out = capsys.readouterr().out
    assert "no winner at concurrency 1: no speculation is the fastest (100.0 tok/s); no profile written" in out
    assert "slower than no speculation" in out and "[2/4] tune_a steps=1: 90.0 tok/s" in out
    assert "2.0 [1.9, 2.1]" in out and "[0.009, 0.011]" in out  # every figure with its repeats' interval
    assert not (inv.parent / "group_vars").exists()


def test_a_winner_inside_the_noise_writes_no_profile_unless_forced_and_says_so(env, monkeypatch, capsys):
    """150 against 140 with intervals of -+10 %: the best's [135, 165] does not clear the runner-up's 154 by 2 %."""
    _, inv, _ = env
    written = inv.parent / "group_vars" / "sglang_nodes" / "tuned_close.yml"
    fake = Fake({tune.BASELINE: 100.0, "tune_a": 140.0, "tune_b": 150.0, "tune_c": 90.0})
    fake.spread = 0.10
    assert run(monkeypatch, fake, "--json", "--name", "close") == exitcodes.OK
    doc = doc_of(capsys)
    assert doc["verdict"] == tune.NO_DIFFERENCE and doc["winner"] is None and doc["profile_file"] is None
    assert "tune_b" not in doc["why"] and "steps=3: 150.0 tok/s [135.0, 165.0] does not clear steps=1's" in doc["why"]
    assert not written.exists()
    assert [r["interval"] for r in doc["ranked"][:2]] == [[135.0, 165.0], [126.0, 154.0]]  # kept, shown
    # --force: the fastest one's profile, the file saying it is not clear of the noise (a new sweep: the ledger's)
    fake = Fake({tune.BASELINE: 100.0, "tune_a": 140.0, "tune_b": 150.0, "tune_c": 90.0})
    fake.spread = 0.10
    assert run(monkeypatch, fake, "--name", "close", "--force") == exitcodes.OK
    out = capsys.readouterr().out
    assert "winner tune_b (steps=3) (--force: NOT clear of the noise): 150.0 tok/s" in out
    assert "written with --force, not clear of the noise" in written.read_text()


def test_the_target_concurrency_ranks_the_sweep_and_every_level_is_shown(env, monkeypatch, capsys):
    _, inv, _ = env

    class TwoLevels(Fake):
        def __call__(self, sweep, playbook, extra, command, after_interrupt=False):
            tracker, res, code = super().__call__(sweep, playbook, extra, command, after_interrupt)
            inst = tracker.host(HOST).instances.get("main") or {}
            b = inst.get("bench")
            if b:  # at concurrency 8 no speculation is the fastest (speculation's gain turned into a loss)
                name = extra["sglang_service_instance_profiles"]["main"]
                v = 800.0 if name == tune.BASELINE else 500.0
                b["levels"].append({"concurrency": 8, "output_tokens_per_s": v, "samples": [v] * 3,
                                    "interval": (v * 0.98, v * 1.02)})  # fmt: skip
            return tracker, res, code

    fake = TwoLevels({tune.BASELINE: 100.0, "tune_a": 90.0, "tune_b": 150.0, "tune_c": 95.0})
    assert run(monkeypatch, fake, "--json", "--concurrency", "1,8", "--target-concurrency", "8") == exitcodes.OK
    doc = doc_of(capsys)
    assert doc["target_concurrency"] == 8 and doc["verdict"] == tune.BASELINE_FASTEST and doc["winner"] is None
    assert doc["ranked"][0]["name"] == tune.BASELINE and doc["ranked"][0]["output_tokens_per_s"] == 800.0
    assert doc["profile_file"] is None and not (inv.parent / "group_vars").exists()
    # the same sweep at concurrency 1 (the ledger's measurements: nothing measured again) has its winner
    fake = TwoLevels({tune.BASELINE: 100.0, "tune_a": 90.0, "tune_b": 150.0, "tune_c": 95.0})
    assert run(monkeypatch, fake, "--json", "--concurrency", "1,8") == exitcodes.OK
    doc = doc_of(capsys)
    assert [c[0] for c in fake.calls] == ["plan"]
    assert doc["target_concurrency"] == 1 and doc["winner"] == "tune_b" and doc["verdict"] == tune.WINNER


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--instance", "other"], "tune measures one instance: give --instance NAME once"),
        (["--concurrency", "1,x"], "--concurrency '1,x': whole numbers, comma-separated (1,4)"),
        (["--requests", "0"], "--requests 0: at least 1"),
        (["--repeat", "0"], "--repeat 0: at least 1"),
        (["--concurrency", "1,8", "--target-concurrency", "4"], "--target-concurrency 4: not one of --concurrency 1,8"),
        (["--margin", "1.5"], "--margin 1.5: a fraction, 0 or more and below 1"),
        (["--name", "Bad-Name"], "--name 'Bad-Name': lowercase letters, digits and '_'"),
        (["--grid", "novalue"], "--grid 'novalue': write it as key=value1,value2"),
    ],
)
def test_bad_input_is_refused_before_anything_runs(env, monkeypatch, capsys, extra, message):
    fake = Fake({})
    assert run(monkeypatch, fake, *extra) == exitcodes.USAGE
    assert fake.calls == [] and message in capsys.readouterr().err


def test_one_host_a_profile_and_a_readable_grid_file_are_required(env, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(dtune.Sweep, "playbook", Fake({}))
    monkeypatch.setattr(
        inventory, "check", lambda i, limit, *selection: inventory.Checked(source="x", hosts=["a", "b"])
    )
    assert cli.main(["tune", "--instance", "main", "--profile", "p", "--grid", "a=1"]) == exitcodes.USAGE
    assert "tune runs on one host: --limit matches 2 (a, b)" in capsys.readouterr().err
    monkeypatch.setattr(inventory, "check", lambda i, limit, *selection: inventory.Checked(source="x", hosts=["a"]))
    assert cli.main(["tune", "--instance", "main", "--grid", "a=1"]) == exitcodes.USAGE
    assert "tune needs its starting profile: --profile NAME" in capsys.readouterr().err
    bad = tmp_path / "grid.yml"
    bad.write_text("- a list\n")
    assert cli.main(["tune", "--instance", "main", "--profile", "p", "--grid-file", str(bad)]) == exitcodes.USAGE
    assert "a mapping of key to a list of values, not list" in capsys.readouterr().err
    good = tmp_path / "grid2.yml"
    good.write_text("speculative_num_steps: [1, 3]\n")
    grid, bench = dtune.settings(
        commands.parser().parse_args(["tune", "--grid-file", str(good), "--grid", "NCCL_ALGO=Ring"])
    )
    assert grid == {"speculative_num_steps": [1, 3], "NCCL_ALGO": ["Ring"]} and bench["concurrency"] == [1]


def test_an_error_inside_the_sweep_is_contained_and_the_instance_put_back(env, monkeypatch, capsys):
    fake = Fake({tune.BASELINE: 100.0, "tune_a": 120.0})
    broken = {"n": 0}

    def failing(self, *a, **k):
        broken["n"] += 1
        if broken["n"] == 3:  # the second combination's step: the ledger's disk is gone, say
            raise OSError(28, "No space left on device")
        return fake(self, *a, **k)

    monkeypatch.setattr(dtune.Sweep, "playbook", failing)
    code = cli.main(["tune", "--limit", HOST, "--instance", "main", "--profile", "p", "--grid", "a=1", "--json"])
    out, err = capsys.readouterr()
    doc = json.loads(out.strip().splitlines()[-1])
    assert code == exitcodes.FAILED and "Traceback" not in err
    assert doc["cause"] == "OSError: [Errno 28] No space left on device"
    assert "tune: stopped by OSError: [Errno 28] No space left on device" in err
    assert [c[0] for c in fake.calls] == ["plan", "measure", "put_back"] and doc["put_back"]["exit_code"] == 0


def test_keep_best_puts_the_winner_back_wherever_its_file_went(env, monkeypatch, capsys, tmp_path):
    fake = Fake({tune.BASELINE: 100.0, "tune_a": 120.0, "tune_b": 150.0, "tune_c": 130.0})
    seen = {}

    def keeping(self, playbook, extra, command, after_interrupt=False):
        if playbook == dtune.RESTART:
            seen.update(extra)
        return fake(self, playbook, extra, command, after_interrupt)

    monkeypatch.setattr(dtune.Sweep, "playbook", keeping)

    def full_disk(path, text):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dtune, "write_atomic", full_disk)
    argv = [*ARGV, "--keep-best", "--name", "best", "--profile-dir", str(tmp_path / "profiles"), "--json"]
    assert cli.main(argv) == exitcodes.OK
    doc = doc_of(capsys)
    assert doc["profile_file"] is None and doc["file_error"].startswith("the winner's profile file ")
    assert doc["file_error"].endswith("could not be written: [Errno 28] No space left on device")
    assert seen["sglang_service_instance_profiles"] == {"main": "best"}
    assert seen["sglang_tuned_profile_best"]["baseline"] == {"output_tokens_per_s": 150.0}
    assert doc["put_back"]["profile"] == "best"


def test_without_a_measured_baseline_there_is_no_winner(env, monkeypatch, capsys):
    fake = Fake({tune.BASELINE: outcomes.ROLLED_BACK, "tune_a": 120.0, "tune_b": 150.0, "tune_c": 130.0})
    assert run(monkeypatch, fake, "--json") == exitcodes.OK
    doc = doc_of(capsys)
    assert doc["winner"] is None and doc["baseline_measured"] is False and doc["profile_file"] is None
    assert not any(r["slower_than_baseline"] for r in doc["ranked"])


def test_a_combination_that_said_nothing_of_itself_is_measured_again(env, monkeypatch, capsys):
    first = Fake({tune.BASELINE: 100.0, "tune_a": outcomes.LOCKED, "tune_b": 1.0, "tune_c": 1.0})
    assert run(monkeypatch, first, "--json") == exitcodes.NOT_RECOVERED  # locked: the sweep stops there
    assert doc_of(capsys)["stopped"].startswith("tune_a: locked: ")
    second = Fake({"tune_a": 120.0, "tune_b": 150.0, "tune_c": 130.0}, failed={"tune_c": 1})
    assert run(monkeypatch, second, "--json") == exitcodes.OK
    doc = doc_of(capsys)
    assert [c[1] for c in second.calls if c[0] == "measure"] == ["tune_a", "tune_b", "tune_c"]
    c = next(r for r in doc["ranked"] if r["name"] == "tune_c")
    assert c["outcome"] == "failed" and c["cause"] == "the benchmark: 1 request(s) failed: HTTP 503"
    assert doc["winner"] == "tune_b"


def test_a_name_the_profiles_have_or_a_secret_grid_key_is_refused(env, monkeypatch, capsys):
    fake = Fake({})
    assert run(monkeypatch, fake, "--json", "--name", "baseline_no_spec") == exitcodes.USAGE
    assert [c[0] for c in fake.calls] == ["plan"]
    assert "a profile of that name exists already" in doc_of(capsys)["cause"]
    for key in ("HF_TOKEN", "api_key", "sglang_service_api_key"):
        assert run(monkeypatch, fake, "--grid", f"{key}=a,b") == exitcodes.USAGE
        assert f"grid key {key!r} names a secret" in capsys.readouterr().err
    assert run(monkeypatch, fake, "--profile-dir", "/proc/1/x") == exitcodes.USAGE
    assert "--profile-dir /proc/1/x: not a directory this user can write" in capsys.readouterr().err


def test_a_benchmark_that_could_not_run_is_a_failed_combination_and_the_sweep_goes_on(env, monkeypatch, capsys):
    """The restart stood (restarted, verified); its benchmark in the same call could not run: no measurement, the
    cause recorded, and the next combination measured."""
    why = "the benchmark could not run: ConnectionResetError(104, 'Connection reset by peer')"
    fake = Fake({tune.BASELINE: 100.0, "tune_a": 90.0, "tune_b": 150.0, "tune_c": 120.0}, bench_errors={"tune_a": why})
    assert run(monkeypatch, fake, "--json", "--name", "resets") == exitcodes.OK
    doc = doc_of(capsys)
    by_name = {r["name"]: r for r in doc["ranked"]}
    assert by_name["tune_a"]["outcome"] == "failed" and by_name["tune_a"]["cause"] == why
    assert by_name["tune_a"]["rank"] is None and doc["winner"] == "tune_b"
    assert [c[:2] for c in fake.calls][-2:] == [("measure", "tune_c"), ("put_back", None)]


def test_a_benchmark_cut_short_by_a_sigterm_is_not_recorded_and_stops_the_sweep(env, monkeypatch, capsys):
    """Its restart stood, its benchmark was cut short (bench.INTERRUPTED): nothing said of the combination, so
    it is not in the ledger, the sweep stops there saying why, the instance is put back, and a re-run measures it
    and what came after it."""
    _, _, ledger_path = env
    speeds = {tune.BASELINE: 100.0, "tune_a": 90.0, "tune_b": 150.0, "tune_c": 120.0}
    fake = Fake(speeds, bench_errors={"tune_a": benchmark.INTERRUPTED})
    code = run(monkeypatch, fake, "--json", "--name", "cut")
    doc = doc_of(capsys)
    assert code != exitcodes.OK and doc["complete"] is False
    assert doc["stopped"] == f"tune_a: {benchmark.INTERRUPTED}: not recorded, a re-run measures it"
    assert [c[:2] for c in fake.calls] == [
        ("plan", None),
        ("measure", tune.BASELINE),
        ("measure", "tune_a"),
        ("put_back", None),
    ]
    db = sqlite3.connect(ledger_path)
    assert db.execute("SELECT combination FROM tune_results").fetchall() == [(tune.BASELINE,)]
    db.close()
    again = Fake(speeds)
    assert run(monkeypatch, again, "--json", "--name", "cut2") == exitcodes.OK
    assert [c[1] for c in again.calls if c[0] == "measure"] == ["tune_a", "tune_b", "tune_c"]
