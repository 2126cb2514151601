"""A detached restart's progress: the worker and its files (sglang_deploy.job), the reporter and the journal's
model-load steps (sglang_deploy.progress), the driver's pump of the controller's copies and its stall flag
(driver/runner.py Pump), the live line (driver/display.py)."""

from __future__ import annotations

import json
import os
import time

import pytest

from driver import display, runner
from driver.events import PROGRESS, Tracker
from sglang_deploy import job as jobs
from sglang_deploy import progress


def test_the_journal_steps_of_a_speculative_load_in_sglang_0_5_23_words():
    w = progress.LoadWatch()
    said = []
    for line in [
        "[2026-12-02 10:00:00 TP0] Load weight begin. avail mem=139.50 GB",
        "Loading safetensors checkpoint shards:   0% Completed | 0/4 [00:00<?, ?it/s]"
        "\rLoading safetensors checkpoint shards:  75% Completed | 3/4 [00:03<00:01, 1.00it/s]",
        "[2026-12-02 10:00:04 TP0] Load weight end. elapsed=4.00 s, type=DeepseekV3ForCausalLM, avail mem=20.00 GB",
        "[2026-12-02 10:00:04 TP0] Load weight begin. avail mem=20.00 GB",
        "[2026-12-02 10:00:06 TP0] Capture target verify CUDA graph begin. backend=full, num_tokens_per_req=4",
        "Capturing batches (bs=160 avail_mem=12.10 GB):  45%|####5     | 10/22 [00:09<00:11, 1.07it/s]",
        "[2026-12-02 10:00:20 TP0] Capture draft decode CUDA graph begin. backend=full, num_tokens_per_req=1",
        "[2026-12-02 10:00:21 TP0] Prefill batch, #new-seq: 1",  # not a step: the step stays, the line is the last
    ]:
        w.feed([line])
        said.append((w.step, w.detail))
    assert said == [
        (progress.WEIGHTS, ""),
        (progress.WEIGHTS, "3/4 (75%)"),  # the bar's last "\r" segment
        (progress.WEIGHTS, "done"),
        (progress.DRAFT_WEIGHTS, ""),
        (progress.GRAPHS, ""),
        (progress.GRAPHS, "10/22 (45%)"),
        (progress.DRAFT_GRAPHS, ""),
        (progress.DRAFT_GRAPHS, ""),
    ]
    assert w.last_line.endswith("Prefill batch, #new-seq: 1")


def test_the_reporter_times_each_step_and_writes_only_what_its_mask_leaves(tmp_path):
    t = [100.0]
    path = tmp_path / "progress.json"
    r = progress.Reporter(
        str(path), clock=lambda: t[0], mask=lambda d: json.loads(json.dumps(d).replace("sk-1", "****"))
    )
    r.phase("stop")
    t[0] += 1
    r.phase("start")
    r.step(progress.WEIGHTS, "", "api_key='sk-1'")
    t[0] += 5
    r.step(progress.WEIGHTS, "1/2 (50%)", "shard")
    r.step(progress.WEIGHTS, "1/2 (50%)", "shard")  # no change: no write
    seq = json.loads(path.read_text())["seq"]
    t[0] += 2
    r.step(progress.GRAPHS)
    t[0] += 3
    doc = json.loads(path.read_text())
    assert seq == 4 and doc["seq"] == 5 and doc["phase"] == "start" and doc["step"] == progress.GRAPHS
    assert "sk-1" not in path.read_text() and oct(path.stat().st_mode & 0o777) == "0o600"
    assert [(t["phase"], t["step"], t["detail"]) for t in doc["trail"]] == [
        ("stop", "", ""),
        ("start", "", ""),
        ("start", progress.WEIGHTS, ""),
        ("start", progress.WEIGHTS, "1/2 (50%)"),
        ("start", progress.GRAPHS, ""),
    ]
    assert r.finish() == [
        {"phase": "start", "step": progress.WEIGHTS, "detail": "1/2 (50%)", "seconds": 7.0},
        {"phase": "start", "step": progress.GRAPHS, "detail": "", "seconds": 3.0},
    ]


def wait_until(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_detached_job_answers_its_progress_then_its_result_and_leaves_nothing(tmp_path):
    gate = tmp_path / "go"

    def work():
        r = progress.Reporter(job.progress)
        r.phase("stop")
        wait_until(gate.exists)
        r.phase("start")
        return {"ok": True, "res": {"outcome": "restarted", "sid": os.getsid(0), "pid": os.getpid()}}

    job = jobs.new("main", str(tmp_path / "jobs"))
    assert oct((tmp_path / "jobs").stat().st_mode & 0o777) == "0o700"
    pid = jobs.detach(job, work, lambda exc: {"ok": False, "res": {"msg": repr(exc)}})
    said = jobs.wait(job, seen=0, wait_s=10, min_s=0)
    assert said["done"] is False and said["job"] == job.dir and said["progress"]["phase"] == "stop"
    # Nothing new: answered when wait_s are out, the same seq.
    again = jobs.wait(job, seen=said["seq"], wait_s=0.2, min_s=0)
    assert again["done"] is False and again["seq"] == said["seq"]
    gate.touch()
    end = jobs.wait(job, seen=said["seq"], wait_s=10, min_s=5)  # the result at once, whatever min_s
    assert end["done"] and end["ok"] and end["res"]["outcome"] == "restarted"
    assert end["res"]["pid"] == pid and end["res"]["sid"] != os.getsid(0)  # its own session
    assert not os.path.exists(job.dir)


def test_a_worker_killed_without_a_result_is_a_failure_naming_it_and_its_files_stay(tmp_path):
    def work():
        progress.Reporter(job.progress).phase("start")
        os.kill(os.getpid(), 9)

    job = jobs.new("main", str(tmp_path / "jobs"))
    jobs.detach(job, work, lambda exc: {"ok": False, "res": {}})
    end = jobs.wait(job, seen=0, wait_s=10, min_s=10)
    assert end["done"] and not end["ok"]
    assert "ended without a result during start" in end["res"]["msg"] and "driver status" in end["res"]["msg"]
    assert os.path.isdir(job.dir)


def test_work_that_raises_ends_in_its_error_result(tmp_path):
    def work():
        raise OSError("disk full")

    job = jobs.new("main", str(tmp_path / "jobs"))
    jobs.detach(job, work, lambda exc: {"ok": False, "res": {"msg": f"raised {exc!r}"}})
    end = jobs.wait(job, seen=0, wait_s=10, min_s=0)
    assert end == {"done": True, "ok": False, "res": {"msg": "raised OSError('disk full')"}}


def write(path, doc):
    path.write_text(json.dumps(doc))
    os.utime(path, ns=(time.time_ns(), time.time_ns()))


def test_the_pump_turns_each_changed_file_into_an_event_and_flags_a_stall_once(tmp_path):
    now = [1000.0]
    pump = runner.Pump(tmp_path / "progress", stall_s=60, clock=lambda: now[0])
    f = tmp_path / "progress" / "gpu-01.example.com.main.json"
    write(
        f, {"phase": "start", "step": progress.WEIGHTS, "detail": "", "last_line": "Load weight begin.", "done": False}
    )
    [ev] = pump.poll()
    assert ev["event"] == PROGRESS and ev["event_data"]["host"] == "gpu-01.example.com"
    assert ev["event_data"]["instance"] == "main" and ev["event_data"]["step"] == progress.WEIGHTS
    assert pump.poll() == []  # unchanged file: nothing
    now[0] += 59
    assert pump.poll() == []
    now[0] += 2
    [stall] = pump.poll()
    assert stall["event_data"]["stalled_s"] == 61.0
    now[0] += 100
    assert pump.poll() == []  # flagged once per stall
    write(f, {"phase": "start", "step": progress.WEIGHTS, "detail": "1/2 (50%)", "done": False})
    [moved] = pump.poll()
    assert "stalled_s" not in moved["event_data"]
    write(f, {"outcome": "restarted", "done": True})
    pump.poll()
    now[0] += 1000
    assert pump.poll() == []  # done: never a stall


def test_the_live_line_shows_the_step_and_a_stall_with_the_last_line():
    t = Tracker("restart")
    for doc in (
        {"phase": "start", "step": progress.WEIGHTS, "detail": "61/100 (61%)", "last_line": "shard", "done": False},
        {
            "phase": "start",
            "step": progress.WEIGHTS,
            "detail": "61/100 (61%)",
            "last_line": "shard",
            "done": False,
            "stalled_s": 250,
        },
    ):
        t.handle({"event": PROGRESS, "event_data": {"host": "gpu-01", "instance": "main", **doc}})
        h = t.hosts["gpu-01"]
    assert display.progress_line(h) == (
        f"main: start, {progress.WEIGHTS} 61/100 (61%) - NO CHANGE for 4m10s, last line: shard"
    )
    t.handle({"event": PROGRESS, "event_data": {"host": "gpu-01", "instance": "main", "done": True}})
    assert display.progress_line(t.hosts["gpu-01"]) == ""


@pytest.mark.parametrize("name", ["main", "eagle3-topk1"])
def test_a_progress_file_name_is_the_host_and_the_instance(tmp_path, name):
    path = progress.progress_file(str(tmp_path), "10.0.0.7", name)
    assert runner.Pump.names(os.path.basename(path)) == ("10.0.0.7", name)


def test_start_runs_the_action_detached_with_the_jobs_reporter_and_masks_its_result(tmp_path):
    class Inst:
        name = "main"

    class Machine:
        inst = Inst()
        progress = None

    m = Machine()

    def action():
        m.progress.phase("start")
        m.progress.step(progress.WEIGHTS, "1/1 (100%)", "token sk-1")
        return {"outcome": "restarted", "msg": "restarted with sk-1"}

    def mask(doc):
        return json.loads(json.dumps(doc).replace("sk-1", "****"))

    said = jobs.start(m, action, lambda res: res["outcome"] == "restarted", mask, every=0.5, jobs_dir=str(tmp_path))
    while not said["done"]:
        said = jobs.wait(jobs.Job(said["job"]), said["seq"], wait_s=10, min_s=0)
    assert said["ok"] and said["res"]["msg"] == "restarted with ****"
    assert [s["step"] for s in said["res"]["steps"]] == [progress.WEIGHTS]
    assert os.listdir(tmp_path) == []


def test_the_ledger_keeps_the_load_and_capture_seconds_of_the_restart_not_its_rollback():
    from driver.events import step_seconds

    steps = [
        {"phase": "start", "step": progress.READY_WAIT, "seconds": 4.0},
        {"phase": "start", "step": progress.WEIGHTS, "seconds": 100.0},
        {"phase": "start", "step": progress.DRAFT_WEIGHTS, "seconds": 10.5},
        {"phase": "start", "step": progress.GRAPHS, "seconds": 30.0},
        {"phase": "start", "step": progress.DRAFT_GRAPHS, "seconds": 5.0},
        {"phase": "rollback-start", "step": progress.WEIGHTS, "seconds": 99.0},
    ]
    assert step_seconds(steps) == {"load_s": 110.5, "capture_s": 35.0}
    assert step_seconds([]) == {"load_s": None, "capture_s": None}


def job_module(tmp_path, args: dict):
    from support.modules import run_module

    prelude = f"import ansible.module_utils.sglang_deploy.job as j; j.JOBS_DIR = {str(tmp_path / 'jobs')!r}"
    return run_module("sglang_job", args, tmp_path, prelude=prelude)


def test_the_sglang_job_module_hands_over_a_result_its_progress_or_a_clear_refusal(tmp_path):
    done = jobs.new("main", str(tmp_path / "jobs"))
    jobs.write_json(done.result, {"ok": True, "res": {"outcome": "restarted", "msg": "main: restarted"}})
    rc, res = job_module(tmp_path, {"job": done.dir})
    assert rc == 0 and res["outcome"] == "restarted" and not os.path.exists(done.dir)

    failed = jobs.new("main", str(tmp_path / "jobs"))
    jobs.write_json(failed.result, {"ok": False, "res": {"outcome": "rolled_back", "msg": "main: rolled back"}})
    rc, res = job_module(tmp_path, {"job": failed.dir})
    assert rc == 1 and res["failed"] and res["outcome"] == "rolled_back"

    running = jobs.new("main", str(tmp_path / "jobs"))
    with open(running.pid_file, "w") as f:
        f.write(str(os.getpid()))  # alive for as long as the test runs
    jobs.write_json(running.progress, {"seq": 3, "phase": "start", "step": progress.WEIGHTS})
    rc, res = job_module(tmp_path, {"job": running.dir, "seen": 1, "min_s": 0, "wait_s": 5})
    assert rc == 0 and res["sglang_job"] == running.dir and res["seq"] == 3
    assert res["progress"]["step"] == progress.WEIGHTS

    rc, res = job_module(tmp_path, {"job": "/etc"})
    assert rc == 1 and "is not a job directory under" in res["msg"]
    empty = jobs.new("main", str(tmp_path / "jobs"))
    rc, res = job_module(tmp_path, {"job": empty.dir})
    assert rc == 1 and "holds no restart" in res["msg"]
