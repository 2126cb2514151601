"""restart.yml and verify.yml on a lab node, against the lab's SGLang stand-in server, one test
per fault: detected, reported with its cause, rolled back to a serving server, and nothing
else on the node disturbed (a second instance on the same node keeps its process).

Node lab-node2 runs two instances: `a` on GPUs 0-3 (the one that is restarted) and `b` on
GPUs 4-7 (the bystander).
"""

from __future__ import annotations

import json

import pytest

from support.e2e import ansible, lab_gpu_state, podman_exec, remove_instances

pytestmark = pytest.mark.lab

NODE = "lab-node2"
A = {"name": "a", "port": 30000, "gpus": [0, 1, 2, 3]}
B = {"name": "b", "port": 30001, "gpus": [4, 5, 6, 7]}


def instances(**a_env) -> str:
    a = {**A, "env": {k.upper(): v for k, v in a_env.items()}} if a_env else A
    return json.dumps({"sglang_instances": [a, B]})


def run(the_lab, playbook: str, *extra: str) -> tuple[int, dict, str]:
    """Run a playbook on NODE; (rc, {instance: module result}, the failure message if any)."""
    proc = ansible(
        "ansible-playbook",
        playbook,
        "--limit",
        NODE,
        *extra,
        inventory=the_lab.inventory,
        check=False,
        env={"ANSIBLE_STDOUT_CALLBACK": "ansible.posix.json"},
    )
    start = proc.stdout.find("\n{\n")
    assert start >= 0, f"no JSON in the output of {playbook}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    doc, _ = json.JSONDecoder().raw_decode(proc.stdout, start + 1)
    results, msgs = {}, []
    for play in doc["plays"]:
        for task in play["tasks"]:
            host = task["hosts"].get(NODE) or {}
            for item in host.get("results") or []:
                if item.get("instance") and item.get("outcome"):
                    results[item["instance"]] = item
                if item.get("failed"):
                    msgs.append(item.get("msg", ""))
            if host.get("failed") and not host.get("results"):
                msgs.append(host.get("msg", ""))
    return proc.returncode, results, "\n".join(msgs)


def restart(the_lab, *extra: str, select=("a",), **a_env):
    return run(
        the_lab,
        "playbooks/restart.yml",
        "-e",
        instances(**a_env),
        "-e",
        json.dumps({"sglang_service_instances_selected": list(select)}),
        *extra,
    )


def latest_record(node: str, name: str) -> tuple[str, dict]:
    """The newest known-good generation of an instance: (its path, its record)."""
    gens = f"/var/lib/sglang/known-good/{name}/generations"
    newest = podman_exec(node, "sh", "-c", f"ls -1 {gens} | tail -n 1").strip()
    assert newest.endswith(".json"), f"no known-good generation of {name}"
    return f"{gens}/{newest}", json.loads(podman_exec(node, "cat", f"{gens}/{newest}"))


def unit_state(node: str, name: str) -> str:
    return podman_exec(node, "systemctl", "show", "-p", "ActiveState", "--value", f"sglang-{name}.service").strip()


def main_pid(node: str, name: str) -> int:
    return int(podman_exec(node, "systemctl", "show", "-p", "MainPID", "--value", f"sglang-{name}.service"))


def generate(node: str, port: int) -> dict:
    code = (
        f"import json, urllib.request as u; r = u.urlopen(u.Request('http://127.0.0.1:{port}/generate', "
        "data=json.dumps({'text': 'hi', 'sampling_params': {'max_new_tokens': 8}}).encode(), "
        "headers={'Content-Type': 'application/json'}), timeout=30); print(r.read().decode())"
    )
    return json.loads(podman_exec(node, "python3", "-c", code))


@pytest.fixture(scope="module")
def serving(deployed):
    """Both instances started through the safe restart: the last-known-good configuration of each."""
    the_lab, hosts = deployed
    node = next(h["container"] for h in hosts if h["name"] == NODE)
    rc, res, msg = restart(the_lab, select=("a", "b"))
    assert rc == 0, msg
    assert res["a"]["outcome"] == res["b"]["outcome"] == "restarted"
    yield the_lab, node
    remove_instances(node, "a", "b")


@pytest.fixture
def bystander(serving):
    """Instance b's process before the test; after it, b must run the same process and still generate."""
    _, node = serving
    before = main_pid(node, "b")
    yield
    assert main_pid(node, "b") == before, "instance b was disturbed"
    assert generate(node, B["port"])["meta_info"]["completion_tokens"] == 8


def assert_rolled_back(node: str, result: dict) -> None:
    assert result["outcome"] == "rolled_back", result
    assert result["rollback"]["outcome"] == "serving"
    assert "LAB_STANDIN_FAULT" not in podman_exec(node, "cat", "/etc/sglang/a.env"), (
        "the known-good environment is back"
    )
    assert generate(node, A["port"])["meta_info"]["completion_tokens"] == 8


TEXTFILES = "/var/lib/prometheus/node-exporter"  # node_exporter's textfile collector (sglang_service_metrics_dir)


def test_restart_phases_and_known_good_record(serving, bystander):
    the_lab, node = serving
    podman_exec(node, "mkdir", "-p", TEXTFILES)  # as Debian's prometheus-node-exporter leaves it
    try:
        rc, res, msg = restart(the_lab)
        prom = podman_exec(node, "cat", f"{TEXTFILES}/sglang_deploy_a.prom")
    finally:
        podman_exec(node, "rm", "-rf", TEXTFILES)
    assert rc == 0, msg
    a = res["a"]
    # its end, as metrics on the node (docs/monitoring.md)
    assert a["metrics"] == f"{TEXTFILES}/sglang_deploy_a.prom"
    assert 'sglang_deploy_operation_outcome{operation="restart",outcome="restarted",sglang_instance="a"} 1' in prom
    assert f'generation="{a["known_good"]["generation"]}"' in prom
    assert [p["phase"] for p in a["phases"]] == [
        "lock",
        "validate",
        "stage",
        "preflight",
        "stop",
        "gpus",
        "promote",
        "start",
        "generate",
        "verify",
        "record",
    ]
    assert all(p["ok"] for p in a["phases"])
    # This run's configuration, staged by the restart's own call under its lock: what was started and recorded.
    stage = next(p for p in a["phases"] if p["phase"] == "stage")
    assert stage["detail"]["config_hash"] == a["known_good"]["config_hash"]
    assert a["verify"]["accept_length"] > 1.5 and a["verify"]["running_profile"] == "eagle3_topk1"
    path, record = latest_record(node, "a")
    assert record["profile"] == "eagle3_topk1" and record["config_hash"] == a["known_good"]["config_hash"]
    assert record["generation"] == a["known_good"]["generation"]
    assert set(record["files"]) == {"/etc/systemd/system/sglang-a.service", "/etc/sglang/a.env"}
    assert record["software"]["venv"] == record["argv"][0].rsplit("/bin/python", 1)[0]
    assert podman_exec(node, "stat", "-c", "%a", path).strip() == "600"
    assert podman_exec(node, "systemctl", "is-enabled", "sglang-a.service").strip() == "enabled"


@pytest.mark.parametrize(
    "fault,extra,phase,cause",
    [
        # the server dies while loading: its traceback, within a poll of the unit's state
        ("crash-startup", [], "start", "RuntimeError: CUDA error: out of memory while loading draft model weights"),
        # the seed's: loads, serves /health, dies on the first decode
        (
            "crash-first-decode",
            [],
            "generate",
            "AttributeError: 'EAGLEWorkerV2' object has no attribute 'adaptive_controller'",
        ),
        # never ready: the ready timeout, and the server's last log line says where it hangs (systemd's own
        # lines about the unit skipped); 20 s: the rollback's start (the same timeout) runs SGLang's parser on a
        # loaded 2-core machine (8 s was seen to fail there)
        ("hang", ["-e", "sglang_service_ready_timeout=20"], "start", "not ready after 20s"),
        # speculation accepts nothing (an EAGLE/EAGLE3 mix-up): verify fails
        ("wrong-accept", [], "verify", "accept_length: average accept length 1.0"),
    ],
)
def test_fault_is_reported_with_its_cause_and_rolled_back(serving, bystander, fault, extra, phase, cause):
    the_lab, node = serving
    rc, res, msg = restart(the_lab, *extra, lab_standin_fault=fault)
    assert rc != 0
    a = res["a"]
    assert a["failure"]["phase"] == phase and cause in a["failure"]["cause"], a["failure"]
    if fault in ("crash-startup", "crash-first-decode"):
        assert any("Traceback (most recent call last)" in line for line in a["failure"]["traceback"])
    if fault == "hang":
        assert "Capture cuda graph begin" in a["failure"]["cause"]
    assert "Rolled back to the last-known-good configuration (profile eagle3_topk1): serving" in msg
    assert_rolled_back(node, a)


def test_without_rollback_the_failed_unit_is_stopped_and_explained(serving, bystander):
    the_lab, node = serving
    rc, res, msg = restart(the_lab, "-e", "sglang_service_rollback=false", lab_standin_fault="crash-startup")
    assert rc != 0
    why = "rollback is off (sglang_service_rollback)"
    assert res["a"]["outcome"] == "not_recovered" and res["a"]["rollback"] == {"attempted": False, "why": why}
    assert f"Not rolled back: {why}; sglang-a.service is stopped" in msg
    assert unit_state(node, "a") in ("inactive", "failed"), "stopped, never activating (a crash loop)"
    assert "LAB_STANDIN_FAULT" not in podman_exec(node, "cat", "/etc/sglang/a.env"), (
        "the known-good files are back on disk"
    )
    assert "LAB_STANDIN_FAULT" in podman_exec(node, "cat", "/var/lib/sglang/known-good/a/failed/a.env"), (
        "the failed one kept"
    )
    rc, res, msg = restart(the_lab)  # and the good configuration serves again
    assert rc == 0, msg


def test_stray_child_is_killed_at_stop_and_no_process_survives(serving, bystander):
    """#4: stopping the unit leaves no process of it alive, even a child that ignores SIGTERM."""
    the_lab, node = serving
    rc, res, msg = restart(the_lab, lab_standin_fault="stray-child")
    assert rc == 0, msg
    cgroup = podman_exec(node, "systemctl", "show", "-p", "ControlGroup", "--value", "sglang-a.service").strip()
    pids = podman_exec(
        node,
        "sh",
        "-c",
        f"cat /sys/fs/cgroup/systemd{cgroup}/cgroup.procs 2>/dev/null || cat /sys/fs/cgroup{cgroup}/cgroup.procs",
    ).split()
    assert len(pids) == 5, pids  # the server and its 4 schedulers
    rc, res, msg = restart(the_lab)
    assert rc == 0, msg
    stop = next(p for p in res["a"]["phases"] if p["phase"] == "stop")
    assert stop["seconds"] >= 4.5, "the stray ignored SIGTERM: systemd killed it after TimeoutStopSec (5 s)"
    alive = podman_exec(node, "sh", "-c", " ".join(f"test -d /proc/{p} && echo {p};" for p in pids) + " true").split()
    assert alive == [], f"processes of the old server survived the stop: {alive}"


def test_slow_release_is_waited_for_by_polling(serving, bystander):
    the_lab, _ = serving
    rc, res, msg = restart(the_lab, lab_standin_fault="slow-release", lab_standin_release_s="3")
    assert rc == 0, msg
    rc, res, msg = restart(the_lab)
    assert rc == 0, msg
    gpus = next(p for p in res["a"]["phases"] if p["phase"] == "gpus")
    assert 2.0 < gpus["detail"]["waited_s"] < 6 and gpus["detail"]["polls"] > 10


def test_a_foreign_process_on_the_gpus_refuses_before_anything_is_stopped(serving, bystander):
    the_lab, node = serving
    before = main_pid(node, "a")
    with lab_gpu_state(
        node,
        ["hold", "--pid", "1", "--gpu", "2", "--mib", "8148", "--name", "someone-elses-job"],
        ["release", "--pid", "1"],
    ):
        rc, res, msg = restart(the_lab)
    assert rc != 0
    assert res["a"]["outcome"] == "gpus_not_clean"
    assert "GPU 2: pid 1 holds 8148 MiB (user root, unit" in msg and "Nothing was stopped" in msg
    assert main_pid(node, "a") == before, "the running server must not have been touched"


def test_verify_passes_and_names_the_profile(serving, bystander):
    the_lab, _ = serving
    rc, res, msg = run(the_lab, "playbooks/verify.yml", "-e", instances())
    assert rc == 0, msg
    v = res["a"]["verify"]
    assert {c["name"] for c in v["checks"]} >= {
        "unit",
        "drift",
        "gpu_processes",
        "health_generate",
        "generate",
        "speculative_algorithm",
        "accept_length",
        "patches",
    }
    assert all(c["ok"] for c in v["checks"]) and v["running_profile"] == "eagle3_topk1" and v["tokens_per_s"] > 100


def test_verify_reports_drift_and_names_what_runs(serving, bystander):
    """A server relaunched by hand with another step count than the profile's (the seed)."""
    the_lab, node = serving
    unit = podman_exec(node, "cat", "/etc/systemd/system/sglang-a.service")
    exec_start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    by_hand = exec_start.replace("--speculative-num-steps 2", "--speculative-num-steps 3")
    podman_exec(
        node,
        "sh",
        "-c",
        "mkdir -p /etc/systemd/system/sglang-a.service.d && printf '[Service]\\nExecStart=\\n%s\\n' "
        f"'{by_hand}' > /etc/systemd/system/sglang-a.service.d/by-hand.conf && systemctl daemon-reload && systemctl restart sglang-a.service",
    )
    try:
        rc, res, msg = run(the_lab, "playbooks/verify.yml", "-e", instances())
    finally:
        podman_exec(
            node, "sh", "-c", "rm -rf /etc/systemd/system/sglang-a.service.d/by-hand.conf && systemctl daemon-reload"
        )
    assert rc != 0
    assert res["a"]["outcome"] == "verify_failed"
    assert (
        "drift: running command line differs from the rendered configuration: --speculative-num-steps: configured '2', running '3'"
        in msg
    )
    assert "running profile: none of the known profiles (launched by hand?)" in msg
    rc, res, msg = restart(the_lab)  # the configured server again
    assert rc == 0, msg


def test_a_profile_slower_than_no_speculation_is_reported(serving, bystander):
    """The seed's "best config": EAGLE-3 at 82.3 tok/s, below the 90 tok/s of no speculation."""
    the_lab, _ = serving
    slow = json.dumps(
        {"sglang_instances": [{**A, "profile": "eagle3_5tok_cuda_graph", "env": {"LAB_STANDIN_TOKENS_PER_S": "80"}}, B]}
    )
    select = json.dumps({"sglang_service_instances_selected": ["a"]})
    rc, res, msg = run(
        the_lab, "playbooks/restart.yml", "-e", slow, "-e", select, "-e", "sglang_service_verify_regression_action=fail"
    )
    assert rc != 0 and res["a"]["failure"]["phase"] == "verify"
    assert "throughput_vs_no_speculation" in res["a"]["failure"]["cause"]
    assert res["a"]["outcome"] == "rolled_back" and res["a"]["rollback"]["to_profile"] == "eagle3_topk1"
    rc, res, msg = run(the_lab, "playbooks/restart.yml", "-e", slow, "-e", select)
    assert rc == 0, msg  # warn is the default action
    warnings = res["a"]["verify"]["warnings"]
    assert any("tok/s with speculation against 90 without" in w for w in warnings), warnings
    rc, res, msg = restart(the_lab)
    assert rc == 0, msg


def test_a_stray_of_the_service_user_is_stopped_by_policy_own(serving, bystander):
    """The seed's hand-started `nohup python -m sglang.launch_server &`, as the service user, outside the unit."""
    the_lab, node = serving
    podman_exec(node, "sh", "-c", "runuser -u sglang -- sleep 600 > /dev/null 2>&1 &")
    pid = podman_exec(
        node, "sh", "-c", "for i in $(seq 50); do p=$(pgrep -u sglang -x sleep) && break; sleep 0.1; done; echo $p"
    ).strip()
    assert pid.isdigit(), pid
    podman_exec(node, "lab-gpu", "hold", "--pid", pid, "--gpu", "1", "--mib", "30000", "--name", "python3")
    rc, res, msg = restart(the_lab, "-e", "sglang_service_stop_policy=none")
    assert rc != 0 and res["a"]["outcome"] == "gpus_not_clean", "policy none: refused, nothing stopped"
    assert f"GPU 1: pid {pid} holds 30000 MiB (user sglang" in msg
    rc, res, msg = restart(the_lab)  # the default policy, own
    assert rc == 0, msg
    gpus = next(p for p in res["a"]["phases"] if p["phase"] == "gpus")
    assert gpus["detail"]["stopped"] == {pid: "SIGTERM"}
    assert podman_exec(node, "sh", "-c", f"test -d /proc/{pid} && echo alive || echo gone").strip() == "gone"
