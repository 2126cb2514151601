"""A detached restart's progress: the worker and its files (sglang_deploy.job), the reporter and the journal's
model-load steps (sglang_deploy.progress), the driver's pump of the controller's copies and its stall flag
(driver/runner.py Pump), the live line (driver/display.py)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import job as jobs
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import progress
from driver import display, runner
from driver.events import PROGRESS, Tracker


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


def test_a_detached_job_answers_its_progress_then_its_result_and_leaves_nothing_once_acknowledged(tmp_path):
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
    assert jobs.wait(job, seen=said["seq"], wait_s=10, min_s=0) == end  # asked again: the same result
    assert jobs.ack(job) and not os.path.exists(job.dir)
    assert not jobs.ack(job)  # acknowledged twice: nothing more to remove


def test_a_worker_killed_without_a_result_is_a_failure_naming_it_and_its_files_stay(tmp_path):
    def work():
        progress.Reporter(job.progress).phase("start")
        os.kill(os.getpid(), 9)

    job = jobs.new("main", str(tmp_path / "jobs"))
    jobs.detach(job, work, lambda exc: {"ok": False, "res": {}})
    end = jobs.wait(job, seen=0, wait_s=10, min_s=10)
    assert end["done"] and not end["ok"]
    assert "ended without a result during start" in end["res"]["msg"] and "driver status" in end["res"]["msg"]
    assert not jobs.ack(job) and os.path.isdir(job.dir)  # no result: an acknowledgement removes nothing


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
    job = said.get("job")  # none when the result came within `every`: start() removed the job itself
    while not said["done"]:
        said = jobs.wait(jobs.Job(said["job"]), said["seq"], wait_s=10, min_s=0)
    assert said["ok"] and said["res"]["msg"] == "restarted with ****"
    assert [s["step"] for s in said["res"]["steps"]] == [progress.WEIGHTS]
    if job:
        assert jobs.ack(jobs.Job(job))
    assert os.listdir(tmp_path) == []


def test_start_removes_a_job_whose_result_it_answers_itself(tmp_path):
    class Inst:
        name = "main"

    class Machine:
        inst = Inst()
        progress = None

    said = jobs.start(
        Machine(), lambda: {"outcome": "locked"}, lambda res: False, lambda d: d, every=10, jobs_dir=str(tmp_path)
    )
    assert said["done"] and said["res"]["outcome"] == "locked"
    assert os.listdir(tmp_path) == []  # the controller never learns this job: nothing would acknowledge it


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

    prelude = f"import ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.job as j; j.JOBS_DIR = {str(tmp_path / 'jobs')!r}"
    return run_module("sglang_job", args, tmp_path, prelude=prelude)


def test_the_sglang_job_module_hands_over_a_result_its_progress_or_a_clear_refusal(tmp_path):
    done = jobs.new("main", str(tmp_path / "jobs"))
    jobs.write_json(done.result, {"ok": True, "res": {"outcome": "restarted", "msg": "main: restarted"}})
    rc, res = job_module(tmp_path, {"job": done.dir})
    assert rc == 0 and res["outcome"] == "restarted" and os.path.exists(done.dir)  # kept until acknowledged

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
    assert res["boot_id"] == jobs.boot_id() and len(res["boot_id"]) > 37  # the controller passes it back
    assert res["progress"]["step"] == progress.WEIGHTS

    rc, res = job_module(tmp_path, {"job": "/etc"})
    assert rc == 1 and "is not a job directory under" in res["msg"]
    rc, res = job_module(tmp_path, {"job": f"{tmp_path / 'jobs'}/../../etc", "ack": True})
    assert rc == 1 and "is not a job directory under" in res["msg"]
    empty = jobs.new("main", str(tmp_path / "jobs"))
    rc, res = job_module(tmp_path, {"job": empty.dir})
    assert rc == 1 and "holds no restart" in res["msg"]
    # Gone, and the host has another boot id than the controller last heard: the job went with a reboot.
    rc, res = job_module(tmp_path, {"job": f"{tmp_path / 'jobs'}/main-1-2", "boot_id": "0" * 36})
    assert rc == 1 and "the host booted during the restart (boot 00000000, now" in res["msg"]
    assert "boot guard starts its known-good configuration" in res["msg"]
    rc, res = job_module(tmp_path, {"job": f"{tmp_path / 'jobs'}/main-1-2", "boot_id": jobs.boot_id()})
    assert rc == 1 and "holds no restart" in res["msg"]  # the same boot: acknowledged, not rebooted


def test_a_result_lost_on_the_way_is_handed_over_again_until_acknowledged(tmp_path):
    """The connection drops exactly while sglang_job hands the result over: the next call still gets it."""
    job = jobs.new("main", str(tmp_path / "jobs"))
    jobs.write_json(job.result, {"ok": False, "res": {"outcome": "rolled_back", "msg": "main: rolled back"}})
    first = job_module(tmp_path, {"job": job.dir, "seen": 4, "min_s": 0})
    assert first[0] == 1 and first[1]["outcome"] == "rolled_back"  # this answer is lost on the way
    assert job_module(tmp_path, {"job": job.dir, "seen": 4, "min_s": 0}) == first  # asked again: the same
    rc, res = job_module(tmp_path, {"job": job.dir, "ack": True})
    assert rc == 0 and res["changed"] and res["acked"] == job.dir and not os.path.exists(job.dir)
    rc, res = job_module(tmp_path, {"job": job.dir, "ack": True})
    assert rc == 0 and not res["changed"]  # acknowledged twice (its answer lost too): no error
    rc, res = job_module(tmp_path, {"job": job.dir})
    assert rc == 1 and "holds no restart" in res["msg"]

    running = jobs.new("main", str(tmp_path / "jobs"))
    with open(running.pid_file, "w") as f:
        f.write(str(os.getpid()))
    rc, res = job_module(tmp_path, {"job": running.dir, "ack": True})
    assert rc == 0 and not res["changed"] and os.path.isdir(running.dir)  # no result yet: nothing removed


# The action plugin as Ansible runs it: its ActionModule with the task's args, each module call it makes
# (_execute_module) answered by the test: sglang_job is the real module run as Ansible runs it (job_module), the
# connection's failures are Ansible's (AnsibleConnectionFailure, or a result marked unreachable).


def action_plugin(tmp_path, monkeypatch, args: dict, answer, clock):
    """(run, progress file): run() is the plugin's run() for a task with `args` on host gpu-01 under the driver
    (its progress dir set); answer(module name, module args) answers each module call; clock is the fake
    controller clock, advanced by the plugin's sleeps (each recorded in clock.sleeps with the progress file then)."""
    import importlib.util
    from types import SimpleNamespace

    from support import REPO

    spec = importlib.util.spec_from_file_location(
        "sglang_server_action", REPO / "plugins" / "action" / "sglang_server.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    where = tmp_path / "progress"
    where.mkdir()
    monkeypatch.setenv(progress.PROGRESS_DIR_ENV, str(where))
    task = SimpleNamespace(args=args, async_val=0, check_mode=False, action="sglang.deploy.sglang_server")
    connection = SimpleNamespace(_shell=SimpleNamespace(tmpdir=str(tmp_path)))
    plugin = mod.ActionModule(task, connection, SimpleNamespace(check_mode=False), None, None)

    def execute(module_name, module_args, task_vars):
        # the collection's modules by their FQCN, the one name an installed copy has for them
        assert module_name.startswith("sglang.deploy."), module_name
        return answer(module_name.removeprefix("sglang.deploy."), dict(module_args))

    plugin._execute_module = execute
    path = progress.progress_file(str(where), "gpu-01", "main")

    def sleep(s):
        clock.sleeps.append((s, json.loads(Path(path).read_text())))
        clock.now += s

    plugin.clock = lambda: clock.now
    plugin.sleep = sleep
    return (lambda: plugin.run(task_vars={"inventory_hostname": "gpu-01"})), path


class Clock:
    def __init__(self):
        self.now = 1000.0
        self.sleeps: list[tuple[float, dict]] = []


def running_job(tmp_path) -> jobs.Job:
    """A job whose worker runs (the test's own pid) in phase start, loading weights; seq 2."""
    job = jobs.new("main", str(tmp_path / "jobs"))
    with open(job.pid_file, "w") as f:
        f.write(str(os.getpid()))
    jobs.write_json(job.progress, {"seq": 2, "phase": "start", "step": progress.WEIGHTS, "detail": "1/2 (50%)"})
    return job


def connection_lost(kind: str) -> dict:
    """What Ansible's _execute_module does when the SSH connection drops: raises, or (a connection plugin's way)
    answers a result marked unreachable."""
    from ansible.errors import AnsibleConnectionFailure

    msg = "Failed to connect to the host via ssh: ssh: connect to host gpu-01 port 22: Connection timed out"
    if kind == "raise":
        raise AnsibleConnectionFailure(msg)
    return {"unreachable": True, "msg": msg, "changed": False}


@pytest.mark.parametrize("kind", ["raise", "unreachable"])
def test_a_poll_lost_to_an_ssh_blip_is_asked_again_and_the_task_gets_the_jobs_real_outcome(tmp_path, monkeypatch, kind):
    job = running_job(tmp_path)
    calls = []

    def answer(name, args):
        calls.append((name, args))
        if name == "sglang_server":
            return {
                "changed": True,
                "sglang_job": job.dir,
                "seq": 2,
                "progress": jobs.read_json(job.progress),
                "boot_id": "b" * 36,
            }
        if len(calls) == 2:  # the connection drops; meanwhile the worker goes on, rolls back, writes its result
            jobs.write_json(job.result, {"ok": False, "res": {"changed": True, "outcome": "rolled_back", "msg": "rb"}})
            return connection_lost(kind)
        return job_module(tmp_path, args)[1]

    clock = Clock()
    run, path = action_plugin(
        tmp_path, monkeypatch, {"action": "restart", "instance": {"name": "main"}, "reconnect_s": 60}, answer, clock
    )
    res = run()
    assert res["outcome"] == "rolled_back" and res["failed"] and not res.get("unreachable"), res
    # reconnect_s is the plugin's own: never passed to a module.
    assert calls[0] == ("sglang_server", {"action": "restart", "instance": {"name": "main"}, "detach": True})
    asked = [args for name, args in calls[1:] if "ack" not in args]
    assert [(a["job"], a["seen"]) for a in asked] == [(job.dir, 2), (job.dir, 2)]  # the same job, the same seq
    assert {a["boot_id"] for a in asked} == {"b" * 36}  # the boot it was heard of in: a reboot is told apart
    # While disconnected the driver's live view says so, the last progress kept.
    [(slept, doc)] = clock.sleeps
    assert slept == 2.0 and doc["connection_lost_s"] == 0.0 and "Connection timed out" in doc["connection_error"]
    assert doc["phase"] == "start" and doc["step"] == progress.WEIGHTS and doc["done"] is False
    end = json.loads(Path(path).read_text())
    assert end["done"] and end["outcome"] == "rolled_back" and "connection_lost_s" not in end
    assert calls[-1] == ("sglang_job", {"job": job.dir, "ack": True}) and not os.path.exists(job.dir)


def test_a_result_answer_lost_at_hand_over_is_asked_for_again(tmp_path, monkeypatch):
    from ansible.errors import AnsibleConnectionFailure

    job = running_job(tmp_path)
    jobs.write_json(job.result, {"ok": True, "res": {"changed": True, "outcome": "restarted", "msg": "main: ok"}})
    handed = []

    def answer(name, args):
        if name == "sglang_server":
            return {"changed": True, "sglang_job": job.dir, "seq": 2, "progress": jobs.read_json(job.progress)}
        res = job_module(tmp_path, args)[1]
        if not handed and not args.get("ack"):
            handed.append(res)  # the host answered the result; the connection dropped before it arrived
            raise AnsibleConnectionFailure("Data could not be sent to remote host 'gpu-01'")
        return res

    clock = Clock()
    run, _ = action_plugin(tmp_path, monkeypatch, {"action": "restart", "instance": {"name": "main"}}, answer, clock)
    res = run()
    assert handed[0]["outcome"] == "restarted" and res["outcome"] == "restarted" and not res.get("failed"), res
    assert not os.path.exists(job.dir)  # acknowledged once the controller had it


def test_a_connection_lost_past_reconnect_s_ends_unreachable_naming_the_job_and_its_phase(tmp_path, monkeypatch):
    job = running_job(tmp_path)
    calls = []
    clock = Clock()

    def answer(name, args):
        calls.append((name, args))
        if name == "sglang_server":
            return {"changed": True, "sglang_job": job.dir, "seq": 2, "progress": jobs.read_json(job.progress)}
        clock.now += 1.0  # each attempt: a second of SSH timing out
        return connection_lost("raise")

    run, path = action_plugin(
        tmp_path, monkeypatch, {"action": "rollback", "instance": {"name": "main"}, "reconnect_s": 30}, answer, clock
    )
    res = run()
    assert res["unreachable"] and not res.get("failed") and res["job"] == job.dir and res["phase"] == "start"
    assert job.dir in res["msg"] and f"in start, {progress.WEIGHTS} 1/2 (50%)" in res["msg"]
    assert "goes on on the host" in res["msg"] and res["connection_lost_s"] == 31.0
    # A bounded backoff, never past the budget: 2, 4, 8, then at most 10 s, the last cut to what is left.
    assert [s for s, _ in clock.sleeps] == [2.0, 4.0, 8.0, 10.0, 2.0]
    assert [doc["connection_lost_s"] for _, doc in clock.sleeps] == [0.0, 3.0, 8.0, 17.0, 28.0]
    end = json.loads(Path(path).read_text())
    assert end["done"] and end["outcome"] == "unreachable" and end["job"] == job.dir and end["phase"] == "start"
    assert not any(args.get("ack") for _, args in calls) and os.path.isdir(job.dir)  # the worker runs on


def test_reconnect_s_0_gives_up_at_the_first_failed_poll(tmp_path, monkeypatch):
    job = running_job(tmp_path)

    def answer(name, args):
        if name == "sglang_server":
            return {"changed": True, "sglang_job": job.dir, "seq": 2, "progress": jobs.read_json(job.progress)}
        return connection_lost("unreachable")

    clock = Clock()
    run, _ = action_plugin(
        tmp_path, monkeypatch, {"action": "restart", "instance": {"name": "main"}, "reconnect_s": 0}, answer, clock
    )
    res = run()
    assert res["unreachable"] and res["job"] == job.dir and clock.sleeps == []


# ---------------------------------------------------------------------- the worker's own scope unit and journal


def fake_busctl(bin_dir: Path, body: str) -> None:
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "busctl").write_text("#!/bin/sh\n" + body)
    (bin_dir / "busctl").chmod(0o755)


def test_the_worker_is_moved_into_a_transient_scope_named_after_its_job(tmp_path, monkeypatch):
    log = tmp_path / "busctl.log"
    fake_busctl(tmp_path / "bin", f'echo "$@" > {log}\n')
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    proc = tmp_path / "proc"
    (proc / "4242").mkdir(parents=True)
    (proc / "4242" / "cgroup").write_text("0::/system.slice/sglang-deploy-job-main-1-2.scope\n")
    assert jobs.own_scope(4242, "sglang-deploy-job-main-1-2.scope", timeout=1, proc=str(proc)) == ""
    args = log.read_text().split()
    assert args[args.index("StartTransientUnit") + 2 :][:4] == ["sglang-deploy-job-main-1-2.scope", "fail", "3", "PIDs"]
    assert args[args.index("PIDs") + 1 : args.index("PIDs") + 4] == ["au", "1", "4242"]
    assert "CollectMode" in args and "inactive-or-failed" in args  # systemd removes it once the worker is gone
    # Made, but the process never moved (still the session's): said, not taken for done.
    (proc / "4242" / "cgroup").write_text("0::/user.slice/user-1000.slice/session-7.scope\n")
    assert "the worker is not in it" in jobs.own_scope(4242, "sglang-deploy-job-main-1-2.scope", 0.1, str(proc))


def test_without_systemd_the_worker_runs_in_the_callers_session_and_its_result_says_why(tmp_path, monkeypatch):
    fake_busctl(tmp_path / "bin", "echo 'Failed to connect to bus: No such file or directory' >&2\nexit 1\n")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    job = jobs.new("main", str(tmp_path / "jobs"))
    jobs.detach(job, lambda: {"ok": True, "res": {"where": jobs.worker_unit(job)}}, lambda exc: {"ok": False})
    end = jobs.wait(job, seen=0, wait_s=10, min_s=0)
    assert end["ok"] and end["res"]["where"] == {
        "unit": None,
        "error": "busctl: Failed to connect to bus: No such file or directory",
    }
    assert job.unit() is None


def test_the_worker_begins_only_once_its_scope_is_made(tmp_path, monkeypatch):
    made = tmp_path / "made"
    fake_busctl(tmp_path / "bin", f"sleep 0.5; touch {made}; exit 1\n")  # slow, then refused
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    job = jobs.new("main", str(tmp_path / "jobs"))
    jobs.detach(job, lambda: {"ok": True, "res": {"made_first": made.exists()}}, lambda exc: {"ok": False})
    assert jobs.wait(job, seen=0, wait_s=10, min_s=0)["res"] == {"made_first": True}


def test_the_workers_output_is_a_journal_stream_under_its_identifier(tmp_path, monkeypatch):
    import socket
    import threading

    fake_busctl(tmp_path / "bin", "exit 1\n")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    path = str(tmp_path / "journal.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    got = bytearray()

    def accept():
        conn, _ = server.accept()
        with conn:
            while chunk := conn.recv(4096):
                got.extend(chunk)

    reader = threading.Thread(target=accept, daemon=True)
    reader.start()
    monkeypatch.setattr(jobs, "JOURNAL_STREAM", path)  # the worker is forked: it sees this

    def work():
        r = progress.Reporter(job.progress, echo=jobs.say)
        r.phase("stop")
        r.step("loading weights", "1/2 (50%)")
        return {"ok": True, "res": {}}

    job = jobs.new("main", str(tmp_path / "jobs"))
    jobs.detach(job, work, lambda exc: {"ok": False})
    jobs.wait(job, seen=0, wait_s=10, min_s=0)
    reader.join(10)
    server.close()
    head, _, body = bytes(got).decode().partition("\n\n")
    assert head == "sglang-deploy-job"  # the identifier, then an empty unit id
    assert body.split("\n")[:5] == ["6", "0", "0", "0", "0"]  # info; no level prefix; journal only
    lines = body.split("\n")[5:]
    assert lines[:2] == ["phase stop", "stop: loading weights 1/2 (50%)"]
    assert lines[2].startswith(f"job {os.path.basename(job.dir)} ended: ok=True")


def test_a_detach_that_fails_after_the_fork_kills_the_worker_before_it_does_anything(tmp_path, monkeypatch):
    ran = tmp_path / "ran"

    def broken(pid, name, *a, **kw):
        raise OSError(28, "No space left on device")  # writing the job's files on a full /run

    monkeypatch.setattr(jobs, "own_scope", broken)
    job = jobs.new("main", str(tmp_path / "jobs"))
    with pytest.raises(OSError, match="No space left"):
        jobs.detach(job, lambda: ran.write_text("restarted") or {"ok": True, "res": {}}, lambda exc: {"ok": False})
    pid = job.pid()
    deadline = time.monotonic() + 10
    while job.alive():  # SIGKILLed: reaped by init, or a zombie until then
        assert time.monotonic() < deadline, f"worker {pid} still runs"
        time.sleep(0.01)
    assert not ran.exists() and jobs.read_json(job.result) is None  # the controller never learns it: nothing ran


def test_the_scope_move_says_why_it_failed_when_busctl_is_missing_or_the_worker_is_gone(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no busctl at all (a host without systemd's tools)
    assert jobs.own_scope(4242, "sglang-deploy-job-main-1-2.scope", 0.1, str(tmp_path)).startswith("busctl: ")
    fake_busctl(tmp_path / "bin", "exit 0\n")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    # Made, but the worker died before /proc could say where it is.
    assert jobs.own_scope(4242, "x.scope", 0.1, str(tmp_path / "proc")).startswith("the worker is gone")


def test_a_job_without_pid_or_unit_files_is_neither_alive_nor_in_a_scope(tmp_path):
    job = jobs.new("main", str(tmp_path / "jobs"))
    assert job.pid() is None and not job.alive() and job.unit() is None
    with open(job.pid_file, "w") as f:
        f.write("999999999")  # above any pid_max: no /proc entry
    assert job.pid() == 999999999 and not job.alive()
