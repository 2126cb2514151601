"""Issue #29 on a lab node: what `systemctl stop` does to a request in flight, by the unit's KillMode.

The unit as the role renders it (KillMode=mixed: SIGTERM to the main process only) lets the lab's SGLang stand-in
drain: a stream in flight at the stop ends whole ([DONE]). The unit as it was (KillMode=control-group, put back
with a drop-in) sends SIGTERM to every process of the unit at once: the stand-in's schedulers die as SGLang
0.5.23's do (no SIGTERM handler), its watchdog sees them crashed and it kills itself with the stream
(lab/standin/lab_sglang_standin.py cites the SGLang code). Neither case involves the safe restart: the unit is
written by deploy (configure) and started and stopped with systemctl, so that the stop alone is measured.

Instance `s` on lab-node1, GPUs 0-3 (lab-node1's `main` is deployed, never started); removed at the end.
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from support.e2e import ansible, podman_exec

pytestmark = pytest.mark.lab

NODE = "lab-node1"
UNIT = "sglang-s.service"
PORT = 30002
DROPIN_DIR = f"/etc/systemd/system/{UNIT}.d"
TOKENS = 60  # 3 s at 20 tok/s: the stream is still running when the stop comes
INSTANCE = {
    "name": "s",
    "port": PORT,
    "gpus": [0, 1, 2, 3],
    "env": {"LAB_STANDIN_TOKENS_PER_S": "20"},
}

# A streamed /generate, run on the node: prints "first" at its first event, then its result as JSON.
CLIENT = r"""
import http.client, json, sys
out = {"status": None, "events": 0, "tokens": 0, "done": False, "error": None}
try:
    conn = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=60)
    body = {"text": "stop me", "sampling_params": {"max_new_tokens": int(sys.argv[2])}, "stream": True}
    conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    out["status"] = resp.status
    while line := resp.readline():
        if line.startswith(b"data: [DONE]"):
            out["done"] = True
        elif line.startswith(b"data: "):
            out["events"] += 1
            out["tokens"] = json.loads(line[6:])["meta_info"]["completion_tokens"]
            if out["events"] == 1:
                print("first", flush=True)
except Exception as exc:  # a reset, a timeout: the stream is lost
    out["error"] = repr(exc)
if not out["events"]:
    print("first", flush=True)  # none came: the test goes on, and reads why
print(json.dumps(out), flush=True)
"""

HEALTHY = r"""
import sys, time, urllib.request as u
deadline = time.monotonic() + 90
while time.monotonic() < deadline:
    try:
        if u.urlopen(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=2).status == 200:
            sys.exit(0)
    except OSError:
        pass
    time.sleep(0.2)
sys.exit(1)
"""


def show(node: str, *props: str) -> dict[str, str]:
    out = podman_exec(node, "systemctl", "show", UNIT, *(f"--property={p}" for p in props))
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


@pytest.fixture(scope="module")
def node(deployed):
    """Instance s written by deploy (configure): a stop timeout long enough for the drain (30 s, the lab's is 5)."""
    the_lab, hosts = deployed
    container = next(h["container"] for h in hosts if h["name"] == NODE)
    extra = {"sglang_instances": [INSTANCE], "sglang_service_stop_timeout": 30}
    ansible(
        "ansible-playbook",
        "playbooks/deploy.yml",
        "--limit",
        NODE,
        "--tags",
        "sglang_service_configure",
        "-e",
        json.dumps(extra),
        inventory=the_lab.inventory,
    )
    yield container
    podman_exec(container, "systemctl", "disable", "--now", UNIT)
    podman_exec(container, "sh", "-c", f"systemctl reset-failed {UNIT} || true")
    podman_exec(
        container,
        "rm",
        "-rf",
        DROPIN_DIR,
        f"/etc/systemd/system/{UNIT}",
        "/etc/sglang/s.env",
        "/etc/sglang/pending/sglang-s.service",
        "/etc/sglang/pending/s.env",
        "/etc/sglang/secrets/s.env",
        "/var/lib/sglang/known-good/s",
    )
    podman_exec(container, "systemctl", "daemon-reload")


def kill_mode(node: str, mode: str | None) -> None:
    """The unit's KillMode: as rendered (None), or another one by a drop-in."""
    if mode is None:
        podman_exec(node, "rm", "-rf", DROPIN_DIR)
    else:
        podman_exec(node, "mkdir", "-p", DROPIN_DIR)
        podman_exec(node, "sh", "-c", f"printf '[Service]\\nKillMode={mode}\\n' > {DROPIN_DIR}/killmode.conf")
    podman_exec(node, "systemctl", "daemon-reload")


def start(node: str) -> None:
    """Start the unit and wait until it serves. reset-failed first (the stop before may have left it failed; a
    unit systemd has not loaded yet is "not loaded" to reset-failed, hence `|| true`)."""
    podman_exec(node, "sh", "-c", f"systemctl reset-failed {UNIT} 2>/dev/null || true")
    podman_exec(node, "systemctl", "start", UNIT)
    subprocess.run(["podman", "exec", node, "python3", "-c", HEALTHY, str(PORT)], check=True, timeout=120)


def stop_under_a_stream(node: str) -> tuple[dict, float, dict[str, str], str]:
    """Start the unit, open a stream, `systemctl stop` once its first event is in: (the stream's result, the
    stop's seconds, the unit's properties after it, the invocation's journal)."""
    start(node)
    invocation = show(node, "InvocationID")["InvocationID"]
    client = subprocess.Popen(
        ["podman", "exec", node, "python3", "-c", CLIENT, str(PORT), str(TOKENS)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert client.stdout.readline().strip() == "first"
        t0 = time.monotonic()
        # Not checked: a stop job is done however the main process ended (the old unit's ends killed, failed).
        podman_exec(node, "sh", "-c", f"systemctl stop {UNIT} || true")
        took = time.monotonic() - t0
        lines = [line for line in client.stdout.read().splitlines() if line.startswith("{")]
        client.wait(60)
    finally:
        if client.poll() is None:
            client.kill()
    props = show(node, "ActiveState", "Result", "ExecMainCode", "ExecMainStatus", "KillMode", "TimeoutStopUSec")
    journal = ""
    for _ in range(50):  # journald may lag the exit a little
        journal = podman_exec(node, "journalctl", "--no-pager", "-o", "cat", f"_SYSTEMD_INVOCATION_ID={invocation}")
        if "SIGTERM received" in journal:
            break
        time.sleep(0.1)
    return json.loads(lines[-1]), took, props, journal


def test_the_rendered_unit_signals_the_main_process_only_and_the_stream_finishes(node):
    kill_mode(node, None)
    stream, took, props, journal = stop_under_a_stream(node)
    print(f"KillMode={props['KillMode']}: stop {took:.1f} s, stream {stream}, unit {props}")
    assert props["KillMode"] == "mixed" and props["TimeoutStopUSec"] == "30s"
    assert stream["done"] and stream["tokens"] == TOKENS and stream["error"] is None, stream
    assert "Gracefully exiting... Remaining number of requests 1." in journal
    assert "crashed with exit code" not in journal
    # Ended by itself with 0 (ExecMainCode is 1, CLD_EXITED, or 0 once systemd has let the exit go: both say
    # no signal killed it; a kill leaves 2 and the signal, as the old unit's test below asserts).
    assert props["Result"] == "success" and props["ExecMainCode"] in ("0", "1") and props["ExecMainStatus"] == "0", (
        props
    )


def test_the_old_unit_signals_every_process_and_the_stream_is_lost(node):
    """The mutation issue #29 fixed, shown on the node: KillMode=control-group put back."""
    kill_mode(node, "control-group")
    try:
        stream, took, props, journal = stop_under_a_stream(node)
    finally:
        kill_mode(node, None)
    print(f"KillMode={props['KillMode']}: stop {took:.1f} s, stream {stream}, unit {props}")
    assert props["KillMode"] == "control-group"
    assert not stream["done"] and stream["tokens"] < TOKENS, f"the stream survived a group SIGTERM: {stream}"
    assert "crashed with exit code -15. Triggering SIGQUIT for cleanup..." in journal
    # The server killed itself (kill_process_tree): SIGKILL, the unit failed.
    assert props["ExecMainCode"] == "2" and props["ExecMainStatus"] == "9", props


def test_a_child_that_ignores_sigterm_is_still_killed_at_the_stop(node):
    """Issue #4's guarantee under KillMode=mixed: the SIGTERM reaches the main process only, and whatever is left of
    the unit after it is SIGKILLed (systemd.kill(5)): no process of the old server survives."""
    kill_mode(node, None)
    podman_exec(node, "sh", "-c", "printf '\\nLAB_STANDIN_FAULT=stray-child\\n' >> /etc/sglang/s.env")
    # No request to drain here: the stop's timeout need not wait for one (the guarantee is the same at any).
    podman_exec(node, "mkdir", "-p", DROPIN_DIR)
    podman_exec(node, "sh", "-c", f"printf '[Service]\\nTimeoutStopSec=5\\n' > {DROPIN_DIR}/timeout.conf")
    podman_exec(node, "systemctl", "daemon-reload")
    try:
        start(node)
        cgroup = show(node, "ControlGroup")["ControlGroup"]
        procs = (
            f"cat /sys/fs/cgroup/systemd{cgroup}/cgroup.procs 2>/dev/null || cat /sys/fs/cgroup{cgroup}/cgroup.procs"
        )
        pids = podman_exec(node, "sh", "-c", procs).split()
        assert len(pids) == 5, pids  # the server and its 4 schedulers
        t0 = time.monotonic()
        podman_exec(node, "systemctl", "stop", UNIT)
        took = time.monotonic() - t0
        alive = podman_exec(node, "sh", "-c", " ".join(f"test -d /proc/{p} && echo {p};" for p in pids) + " true")
        print(f"stray-child under KillMode=mixed: stop {took:.1f} s (TimeoutStopSec 5 s)")
        assert alive.split() == [], f"processes of the old server survived the stop: {alive}"
    finally:
        podman_exec(node, "sed", "-i", "/^LAB_STANDIN_FAULT=/d", "/etc/sglang/s.env")
        podman_exec(node, "rm", "-f", f"{DROPIN_DIR}/timeout.conf")
        podman_exec(node, "systemctl", "daemon-reload")
