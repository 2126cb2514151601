"""Each verify check fails on the condition docs/restart.md's table names, with the words it promises (issue #17).

docs/restart.md, "verify checks": unit fails when the unit is "not active/running, or restarted since it
started"; gpu_processes when "a process of another unit is on the instance's GPUs"; speculative_algorithm
when "/server_info reports another algorithm than configured"; patches when "a patched file no longer
matches the patch manifest of the software the unit runs (<venv>/sglang-deploy/patches.json)". A failed
check fails verify: `verify` ends verify_failed (docs/operate.md: exit 7, "verification failed") with the
check named in its message, and inside a restart the verify phase fails with it (then the rollback).

One healthy instance (a server on loopback answering as SGLang does, the unit running the rendered argv, only
its processes on its GPUs, its patched files as the manifest says) verifies; each case changes one thing
and must fail exactly that check, with exactly its message.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import operate, outcomes, phases
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.checks import Thresholds
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.checks import verify as run_checks
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.failure import Failure
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.instance import Instance
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.machine import Machine, Ports, Settings
from driver import exitcodes

UNIT = "sglang-m.service"
PATCHED = "sglang/srt/speculative/eagle_worker.py"


class Sglang(BaseHTTPRequestHandler):
    """What verify asks of SGLang: /health_generate, /generate (with spec_accept_length), /server_info."""

    def log_message(self, *args) -> None:
        pass

    def reply(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/health_generate":
            self.reply({})
        elif self.path == "/server_info":
            self.reply(
                {"speculative_algorithm": self.server.algorithm, "internal_states": [{"avg_spec_accept_length": 2.4}]}
            )
        else:
            self.send_error(404)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        tokens = body["sampling_params"]["max_new_tokens"]
        self.reply({"text": " Paris.", "meta_info": {"completion_tokens": tokens, "spec_accept_length": 2.4}})


@dataclass
class Host:
    """systemd, /proc and nvidia-smi as verify reads them (restart.Ports), and the evidence port."""

    argv: list[str]
    props: dict = field(
        default_factory=lambda: {
            "ActiveState": "active",
            "SubState": "running",
            "MainPID": 4242,
            "NRestarts": 0,
            "InvocationID": "inv-1",
        }
    )
    processes: list[dict] = field(default_factory=list)
    bundles: list[dict] = field(default_factory=list)

    def show(self, unit: str) -> dict:
        assert unit == UNIT
        return dict(self.props)

    def cmdline(self, pid: int) -> list[str]:
        return list(self.argv) if pid == self.props["MainPID"] else []

    def snapshot(self) -> dict:
        gpus = [
            {"index": g, "memory_used_mib": sum(p["used_mib"] for p in self.processes if p["gpu"] == g)}
            for g in range(4)
        ]
        return {"gpus": gpus, "processes": list(self.processes)}

    def evidence(self, inst, failure, invocation, *, request=None, budget_s=10.0) -> dict:
        self.bundles.append({"failure": failure, "invocation": invocation})
        return {"path": f"/var/lib/sglang/evidence/{inst.name}/bundle.tar.gz"}

    def ports(self, tmp: Path) -> Ports:
        return Ports(
            show=self.show,
            cmdline=self.cmdline,
            snapshot=self.snapshot,
            evidence=self.evidence,
            lock_dir=str(tmp / "locks"),
        )


@dataclass
class World:
    inst: Instance
    host: Host
    server: ThreadingHTTPServer
    installed: Path  # the patched file as installed
    tmp: Path

    def machine(self) -> Machine:
        thresholds = Thresholds(load_requests=2, load_max_new_tokens=8)
        return Machine(self.inst, Settings(thresholds=thresholds), self.host.ports(self.tmp))

    def checks(self) -> dict:
        return run_checks(self.inst, Thresholds(load_requests=2, load_max_new_tokens=8), self.host.ports(self.tmp))


def own(gpu: int) -> dict:
    return {"gpu": gpu, "pid": 4242, "used_mib": 70000, "user": "sglang", "unit": UNIT, "cmdline": "python -m sglang"}


@pytest.fixture
def world(tmp_path, monkeypatch):
    for var in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    server = ThreadingHTTPServer(("127.0.0.1", 0), Sglang)
    server.daemon_threads = True
    server.algorithm = "EAGLE"
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True).start()
    port = server.server_address[1]
    venv = tmp_path / "venv"
    site = venv / "lib" / "python3.11" / "site-packages"
    installed = site / PATCHED
    installed.parent.mkdir(parents=True)
    installed.write_text("patched\n")
    (venv / "sglang-deploy").mkdir()
    (venv / "sglang-deploy" / "patches.json").write_text(
        json.dumps(
            {
                "site_packages": str(site),
                "patches": [{"name": "0001-eagle-fix"}],
                "files": {PATCHED: {"after": hashlib.sha256(b"patched\n").hexdigest()}},
            }
        )
    )
    argv = [
        f"{venv}/bin/python",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/models/m",
        "--port",
        str(port),
        "--speculative-algorithm",
        "EAGLE",
        "--speculative-num-steps",
        "3",
    ]
    inst = Instance(
        name="m",
        unit=UNIT,
        unit_path=str(tmp_path / "systemd" / UNIT),
        env_path=str(tmp_path / "etc" / "m.env"),
        secrets_path=str(tmp_path / "etc" / "secrets" / "m.env"),
        pending_dir=str(tmp_path / "etc" / "pending"),
        port=port,
        gpus=[0, 1],
        argv=argv,
        profile="eagle",
        profiles_argv={"eagle": argv},
        state_dir=str(tmp_path / "state"),
    )
    host = Host(argv=list(argv), processes=[own(0), own(1)])
    yield World(inst, host, server, installed, tmp_path)
    server.shutdown()
    server.server_close()


def test_the_healthy_instance_verifies_with_every_check(world):
    v = world.checks()
    assert v["ok"] and v["failed_checks"] == [], v["failed_checks"]
    assert [c["name"] for c in v["checks"]] == [
        "unit",
        "drift",
        "gpu_processes",
        "health_generate",
        "generate",
        "speculative_algorithm",
        "accept_length",
        "patches",
    ]


def restarted_behind_our_back(w: World) -> None:
    w.host.props["NRestarts"] = 2  # Restart=on-failure brought it back: still active/running


def foreign_process_on_a_gpu(w: World) -> None:
    w.host.processes.append(
        {
            "gpu": 1,
            "pid": 999999,
            "used_mib": 2048,
            "user": "alice",
            "unit": "session-7.scope",
            "cmdline": "python train.py",
        }
    )


def eagle3_running_where_eagle_is_configured(w: World) -> None:
    w.server.algorithm = "EAGLE3"


def eagle_running_where_eagle3_is_configured(w: World) -> None:
    i = w.inst.argv.index("--speculative-algorithm")
    w.inst.argv[i + 1] = "EAGLE3"
    w.host.argv[i + 1] = "EAGLE3"  # runs what is configured: only /server_info tells the algorithm apart
    w.server.algorithm = "EAGLE"


def patched_file_changed(w: World) -> None:
    w.installed.write_text("reinstalled without the patch\n")


# (id, the change, the one failed check as verify reports it: "name: detail")
CASES = [
    (
        "unit-restarted",
        restarted_behind_our_back,
        f"unit: {UNIT} active/running, restarted 2 times since started",
    ),
    (
        "foreign-process",
        foreign_process_on_a_gpu,
        "gpu_processes: not the service's: GPU 1: pid 999999 holds 2048 MiB "
        "(user alice, unit session-7.scope, command python train.py)",
    ),
    (
        "eagle3-for-eagle",
        eagle3_running_where_eagle_is_configured,
        "speculative_algorithm: server reports speculative_algorithm EAGLE3, configured EAGLE",
    ),
    (
        "eagle-for-eagle3",
        eagle_running_where_eagle3_is_configured,
        "speculative_algorithm: server reports speculative_algorithm EAGLE, configured EAGLE3",
    ),
    (
        "patch-manifest",
        patched_file_changed,
        f"patches: installed files differ from the patch manifest: ['{PATCHED}'] (reinstall: deploy.yml)",
    ),
]
IDS = [c[0] for c in CASES]


@pytest.mark.parametrize("case,change,failed", CASES, ids=IDS)
def test_the_check_fails_alone_with_its_message(world, case, change, failed):
    change(world)
    v = world.checks()
    assert v["ok"] is False
    assert v["failed_checks"] == [failed]
    name = failed.split(":", 1)[0]
    [check] = [c for c in v["checks"] if c["name"] == name]
    assert check == {"name": name, "ok": False, "severity": "fail", "detail": failed.split(": ", 1)[1]}


@pytest.mark.parametrize("case,change,failed", CASES, ids=IDS)
def test_verify_ends_verify_failed_naming_the_check_and_bundles_the_evidence(world, case, change, failed):
    change(world)
    res = operate.verify(world.machine())
    assert res["outcome"] == outcomes.VERIFY_FAILED
    assert exitcodes.OUTCOME_CODES[res["outcome"]] == exitcodes.VERIFY_FAILED == 7
    assert res["msg"] == f"m: verification failed: {failed}"
    assert res["failure"] == {"phase": outcomes.VERIFY, "cause": failed}
    assert world.host.bundles == [{"failure": res["failure"], "invocation": None}]


@pytest.mark.parametrize("case,change,failed", CASES, ids=IDS)
def test_the_restarts_verify_phase_fails_with_the_check(world, case, change, failed):
    """The restart runs the same checks as its verify phase: a failure there is what recover() rolls back."""
    change(world)
    m = world.machine()
    with pytest.raises(Failure) as exc:
        phases.verify(m)
    assert exc.value.phase == outcomes.VERIFY
    assert exc.value.cause == f"verification failed: {failed}"
    assert exc.value.details["verify"]["failed_checks"] == [failed]
    assert phases.VERIFY in phases.RESTART and phases.VERIFY in phases.ROLLBACK


def test_a_process_of_another_unit_on_a_gpu_the_instance_does_not_use_is_not_its_business(world):
    world.host.processes.append(
        {
            "gpu": 3,
            "pid": 999999,
            "used_mib": 2048,
            "user": "alice",
            "unit": "session-7.scope",
            "cmdline": "python train.py",
        }
    )
    assert world.checks()["failed_checks"] == []


def test_the_algorithm_check_ignores_case(world):
    world.server.algorithm = "eagle"
    assert world.checks()["failed_checks"] == []
