"""The role's default gateway, smg, on a lab node: pinned in its own virtualenv, a hardened unit that
systemd-analyze accepts, and its HTTP API listing exactly the workers of the inventory
(molecule/router/inventory/hosts.yml), each answered by the lab's SGLang stand-in on loopback."""

import json
import shlex

VENV = "/opt/smg"  # smg's own; sglang-router's is /opt/sglang-router
UNIT = "/etc/systemd/system/sglang-router.service"
ROUTER = "http://127.0.0.1:30000"
KEY = "lab-router-key"  # converge.yml's sglang_router_api_key
# replica-a's one instance, replica-b's two, the multi-node group once through node rank 0.
WORKERS = sorted(f"http://127.0.0.1:{port}" for port in (31001, 31002, 31003, 31004))

FETCH = """
import json, sys, urllib.request, urllib.error
method, url, key, body = sys.argv[1:5]
req = urllib.request.Request(url, method=method, data=body.encode() or None)
if key:
    req.add_header("Authorization", "Bearer " + key)
if body:
    req.add_header("Content-Type", "application/json")
try:
    with urllib.request.urlopen(req, timeout=30) as r:
        print(json.dumps({"status": r.status, "body": r.read().decode()}))
except urllib.error.HTTPError as e:
    print(json.dumps({"status": e.code, "body": e.read().decode()}))
"""


def http(host, path, key=KEY, method="GET", body=""):
    cmd = " ".join(shlex.quote(a) for a in ["python3", "-c", FETCH, method, ROUTER + path, key, body])
    out = json.loads(host.check_output(cmd))
    return out["status"], out["body"]


def main_pid(host):
    return int(host.check_output("systemctl show -p MainPID --value sglang-router.service"))


def test_the_pinned_gateway_is_in_its_own_virtualenv(host):
    version = host.check_output(f"{VENV}/bin/python -c 'import importlib.metadata as m; print(m.version(\"smg\"))'")
    assert version == "1.13.0"
    lock = host.file(f"{VENV}/sglang-deploy/lock.txt")
    assert lock.contains("^smg==1.13.0$") and not lock.contains("--hash")  # what the venv holds: names only
    assert host.file(VENV).user == "root"
    assert not host.file("/opt/sglang-router").exists  # the other gateway's virtualenv: never made


def test_the_unit_is_active_enabled_and_verified(host):
    router = host.service("sglang-router")
    assert router.is_running
    assert router.is_enabled
    assert "\nDescription=smg 1.13.0 gateway in front of 4 SGLang workers\n" in host.file(UNIT).content_string
    verify = host.run(f"systemd-analyze verify {UNIT}")
    assert verify.rc == 0 and verify.stdout.strip() == "" and verify.stderr.strip() == "", verify.stderr


def test_the_router_runs_unprivileged_and_hardened(host):
    pid = main_pid(host)
    assert host.check_output(f"ps -o uid= -p {pid}").strip() != "0"
    exposure = host.check_output("systemd-analyze security --no-pager sglang-router.service | tail -n 1")
    score = float(exposure.split("exposure level for sglang-router.service:")[1].split()[0])
    assert score <= 2.0, exposure


def test_the_unit_names_exactly_the_inventory_workers(host):
    exec_start = next(line for line in host.file(UNIT).content_string.splitlines() if line.startswith("ExecStart="))
    argv = shlex.split(exec_start.split("=", 1)[1])
    urls = argv[argv.index("--worker-urls") + 1 : argv.index("--policy")]
    assert urls == WORKERS
    assert "http://127.0.0.2:31004" not in exec_start  # the multi-node group's rank 1
    assert "31009" not in exec_start  # a host with instances that is no replica
    assert argv[3] == "smg"  # the launcher's first argument: the gateway's module
    assert argv[argv.index("--policy") + 1] == "round_robin"
    # smg's own settings, the role's values (vars/main.yml): not smg's 2 s, 3 s.
    assert argv[argv.index("--worker-stall-secs") + 1] == "5"
    assert argv[argv.index("--worker-wedge-secs") + 1] == "10"
    assert "--no-remove-unhealthy-workers" in argv
    assert argv[argv.index("--health-check-interval-secs") + 1] == "5"
    assert argv[argv.index("--health-failure-threshold") + 1] == "3"


def test_the_api_key_is_in_the_secrets_file_only(host):
    secrets = host.file("/etc/sglang-router/secrets.env")
    assert (secrets.user, secrets.group, secrets.mode) == ("root", "root", 0o600)
    assert secrets.contains(f'^SGLANG_ROUTER_API_KEY="{KEY}"$')
    assert KEY not in host.file(UNIT).content_string
    cmdline = host.check_output(f"tr '\\0' ' ' </proc/{main_pid(host)}/cmdline")
    assert KEY not in cmdline


def test_the_router_lists_every_configured_worker_healthy(host):
    status, body = http(host, "/workers")
    assert status == 200, body
    workers = json.loads(body)["workers"]
    assert sorted(w["url"] for w in workers) == WORKERS
    assert all(w["is_healthy"] and w["status"] == "ready" for w in workers), workers
    status, body = http(host, "/readiness", key="")
    assert (status, json.loads(body)["healthy_workers"]) == (200, len(WORKERS))


def test_the_router_requires_the_key_and_routes_a_generation(host):
    assert http(host, "/workers", key="")[0] == 401
    status, body = http(host, "/generate", method="POST", body='{"text": "The capital of France is"}')
    assert status == 200, body
    assert json.loads(body)["text"]


SENTINEL = "/etc/systemd/system/sglang-router-sentinel.service"


def test_the_sentinel_watches_the_gateway_unprivileged_its_key_from_the_secrets_file(host):
    sentinel = host.service("sglang-router-sentinel")
    assert sentinel.is_running and sentinel.is_enabled
    verify = host.run(f"systemd-analyze verify {SENTINEL}")
    assert verify.rc == 0 and verify.stderr.strip() == "", verify.stderr
    pid = int(host.check_output("systemctl show -p MainPID --value sglang-router-sentinel.service"))
    assert host.check_output(f"ps -o user= -p {pid}").strip() == "sglang-router"
    cmdline = host.check_output(f"tr '\\0' ' ' </proc/{pid}/cmdline")
    assert KEY not in cmdline and KEY not in host.file(SENTINEL).content_string
    argv = shlex.split(cmdline)
    assert argv[argv.index("--gateway-url") + 1] == ROUTER and argv[argv.index("--impl") + 1] == "smg"
    # Its package: the module_utils files themselves, beside its script.
    assert host.file("/usr/local/libexec/sglang-deploy/sglang_deploy/sentinel.py").contains("class Sentinel")
    # It reached the gateway with the key and probed the stand-ins: every worker generates, none taken out.
    journal = host.check_output("journalctl -u sglang-router-sentinel.service -o cat --no-pager")
    assert "sentinel: watching http://127.0.0.1:30000 (smg)" in journal
    assert "taken out" not in journal, journal  # (a first round may find the gateway still starting: skipped)
