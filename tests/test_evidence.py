"""plugins/module_utils/sglang_deploy/evidence (the crash evidence bundle) and plugins/modules/sglang_collect.

With fakes behind evidence.EvidencePorts (commands, clock, /proc and the cgroup root, the GPU snapshot): every
item in the tar, no secret anywhere in it, never the secrets file, the budget, missing tools, pruning, modes.
With real processes: a parent and two children dumped by the real py-spy (requirements.lock pins it;
SGLANG_DEPLOY_PY_SPY names another, else .venv/bin/py-spy or PATH).
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import (
    evidence,
    evidence_items,
    gpu,
    secret_rule,
)
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.instance import Instance

REPO = Path(__file__).resolve().parent.parent
API_KEY = "sk-EVIDENCE-9f8e7d6c5b4a"  # the secrets file's SGLANG_API_KEY
ODD_SECRET = 'pa"ss$wo\\rd-42'  # another secrets file value: escaped in the file, in a repr, in JSON
ARGV_SECRET = "argv-admin-key-1234567"  # only on the command line (--admin-api-key)
ENV_SECRET = "hf_envfile_token_abcdef"  # HF_TOKEN in the environment file
URL_PASSWORD = "hunter2urlpassword"  # in a pip freeze line
SECRETS = (API_KEY, ODD_SECRET, ARGV_SECRET, ENV_SECRET, URL_PASSWORD)
SECRETS_MARKER = "# SECRETS-FILE-ONLY-MARKER"
INVOCATION = "0123456789abcdef0123456789abcdef"
UNIT = "sglang-main.service"
MAIN, RANK0, RANK1 = 4100, 4101, 4102


def env_quoted(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$") + '"'


def make_instance(tmp_path: Path) -> Instance:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").touch()
    meta = venv / "sglang-deploy"
    meta.mkdir()
    (meta / "patches.json").write_text(json.dumps({"series": "0.5.23", "patches": ["fix-eagle3-first-decode"]}))
    (meta / "generation.json").write_text(json.dumps({"id": "gen-1", "sglang": "0.5.23"}))
    etc = tmp_path / "etc"
    etc.mkdir()
    secrets = etc / "main.secrets"
    secrets.write_text(f'{SECRETS_MARKER}\nSGLANG_API_KEY="{API_KEY}"\nDB_PASS={env_quoted(ODD_SECRET)}\n')
    env = etc / "main.env"
    env.write_text(f'CUDA_VISIBLE_DEVICES="0,1"\nNCCL_DEBUG="WARN"\nHF_TOKEN="{ENV_SECRET}"\n')
    unit = etc / UNIT
    argv = [
        str(venv / "bin" / "python"),
        "/usr/local/libexec/sglang-deploy/sglang-launch",
        "sglang.launch_server",
        "--model-path",
        "/models/m",
        "--port",
        "30000",
        "--max-total-tokens",
        "4096",
        "--admin-api-key",
        ARGV_SECRET,
    ]
    unit.write_text(
        "[Service]\n"
        f"EnvironmentFile={env}\nEnvironmentFile={secrets}\n"
        'Environment="PYTHONUNBUFFERED=1"\n'
        f"ExecStart={' '.join(argv)}\n"
    )
    return Instance(
        name="main",
        unit=UNIT,
        unit_path=str(unit),
        env_path=str(env),
        secrets_path=str(secrets),
        pending_dir=str(tmp_path / "pending"),
        port=30000,
        gpus=[0, 1],
        argv=argv,
        profile="eagle3",
        profiles_argv={"eagle3": argv},
        state_dir=str(tmp_path / "state"),
    )


JOURNAL = f"""\
2026-12-01T00:00:01+0000 node sglang-launch[{MAIN}]: server_args=ServerArgs(admin_api_key={ARGV_SECRET!r}, api_key={API_KEY!r}, max_total_tokens=4096, model_path='/models/m', tokenizer_path='/models/m')
2026-12-01T00:00:01+0000 node sglang-launch[{MAIN}]: env DB_PASS={ODD_SECRET!r} HF_TOKEN={ENV_SECRET}
2026-12-01T00:00:02+0000 node sglang-launch[{MAIN}]: GET /health Authorization: Bearer {API_KEY}
2026-12-01T00:00:03+0000 node sglang-launch[{RANK0}]: Scheduler hit an exception: Traceback (most recent call last):
2026-12-01T00:00:03+0000 node sglang-launch[{RANK0}]:   File "eagle_worker.py", line 1, in forward_batch_generation
2026-12-01T00:00:03+0000 node sglang-launch[{RANK0}]: AttributeError: 'NoneType' object has no attribute 'hidden_states'
"""
SHOW = f"""\
Type=simple
MainPID={MAIN}
ControlGroup=/system.slice/{UNIT}
InvocationID={INVOCATION}
ActiveState=active
SubState=running
Environment=SGLANG_API_KEY={API_KEY}
"""
NVIDIA_SMI_Q = "==============NVSMI LOG==============\nDriver Version : 570.86.15\nAttached GPUs : 2\n"
KERNEL = """\
2026-12-01T00:00:00+0000 node kernel: Linux version 6.8.0
2026-12-01T00:00:04+0000 node kernel: NVRM: Xid (PCI:0000:1b:00): 79, pid=4101, GPU has fallen off the bus.
2026-12-01T00:00:04+0000 node kernel: usb 1-1: new device
2026-12-01T00:00:05+0000 node kernel: NVRM: GPU 0000:1b:00.0: GPU has fallen off the bus.
"""
PIP_FREEZE = f"sglang==0.5.23\ntorch==2.8.0\nprivate-pkg @ https://ci:{URL_PASSWORD}@pypi.example.internal/p.whl\n"


def py_spy_dump(pid: int, frame: str) -> str:
    # py-spy's first line is the process's command line: the key on it when a server was started by hand.
    return (
        f"Process {pid}: /opt/ml-env/bin/python -m sglang.launch_server --api-key {API_KEY}\n"
        f'Python v3.11.7 (/usr/bin/python3.11)\n\nThread {pid} (idle): "MainThread"\n    {frame} (scheduler.py:120)\n'
    )


class Host:
    """One host's commands, clock, /proc and cgroup tree. Each command takes `delays[name]` fake seconds; a command
    longer than its timeout raises TimeoutExpired after the timeout, as subprocess.run does."""

    def __init__(self, tmp_path: Path):
        self.now = 1000.0
        self.wall_now = 1_764_547_200.0  # 2025-12-01T00:00:00Z
        self.calls: list[list[str]] = []
        self.delays: dict[str, float] = {}
        self.missing: set[str] = set()
        self.journal_for_invocation = JOURNAL
        self.show = SHOW
        self.snapshot_error: Exception | None = None
        self.proc = tmp_path / "proc"
        self.cgroup = tmp_path / "cgroup"
        for pid, ppid, exe in ((MAIN, 1, "python3.11"), (RANK0, MAIN, "python3.11"), (RANK1, MAIN, "python3.11")):
            d = self.proc / str(pid)
            d.mkdir(parents=True)
            (d / "stat").write_text(f"{pid} (python3) S {ppid} {pid} {pid} 0 -1")
            (d / "cmdline").write_text("/opt/ml-env/bin/python\0-m\0sglang.launch_server\0")
            (d / "exe").symlink_to(f"/usr/bin/{exe}")
        other = self.proc / "999"  # another process of the host: not the unit's
        other.mkdir()
        (other / "stat").write_text("999 (bash) S 1 999 999 0 -1")
        group = self.cgroup / "system.slice" / UNIT
        group.mkdir(parents=True)
        (group / "cgroup.procs").write_text(f"{MAIN}\n{RANK0}\n")  # RANK1 is found as the main pid's descendant

    def clock(self) -> float:
        return self.now

    def wall(self) -> float:
        return self.wall_now

    def which(self, name: str) -> str | None:
        return None if name in self.missing else f"/usr/bin/{name}"

    def snapshot(self, timeout: float) -> dict:
        self.take("gpu-state", timeout)
        if self.snapshot_error:
            raise self.snapshot_error
        return {
            "gpus": [{"index": 0, "uuid": "GPU-0", "memory_used_mib": 120000}],
            "processes": [{"pid": RANK0, "gpu": 0, "cmdline": f"python -m sglang.launch_server --api-key {API_KEY}"}],
        }

    def take(self, name: str, timeout: float) -> None:
        delay = self.delays.get(name, 0.01)
        if delay > timeout:
            self.now += timeout
            raise subprocess.TimeoutExpired(name, timeout)
        self.now += delay

    def run(self, argv: list[str], timeout: float) -> subprocess.CompletedProcess:
        self.calls.append(list(argv))
        prog = os.path.basename(argv[0])
        name = {"python": "pip-freeze"}.get(prog, prog)
        if name in self.missing:
            raise FileNotFoundError(argv[0])
        if argv[:2] == ["journalctl", "-k"]:
            name = "kernel"
        self.take(name, timeout)

        def ok(out: str = "", rc: int = 0, err: str = "") -> subprocess.CompletedProcess:
            return subprocess.CompletedProcess(argv, rc, out, err)

        if prog == "systemctl":
            return ok(self.show)
        if name == "kernel":
            return ok(KERNEL)
        if prog == "journalctl":
            if any(a.startswith("_SYSTEMD_INVOCATION_ID=") for a in argv):
                return ok(self.journal_for_invocation)
            return ok("-- unit fallback --\n" + JOURNAL)
        if prog == "py-spy":
            pid = int(argv[-1])
            return ok(py_spy_dump(pid, "event_loop_overlap" if pid != MAIN else "launch_server"))
        if prog == "nvidia-smi":
            return ok(NVIDIA_SMI_Q)
        if name == "pip-freeze":
            return ok(PIP_FREEZE)
        if prog == "dmesg":
            return ok(rc=1, err="dmesg: read kernel buffer failed: Operation not permitted")
        raise AssertionError(f"unexpected command {argv}")

    def ports(self) -> evidence.EvidencePorts:
        return evidence.EvidencePorts(
            run=self.run,
            which=self.which,
            snapshot=self.snapshot,
            clock=self.clock,
            wall=self.wall,
            hostname=lambda: "gpu-node-01",
            proc_root=str(self.proc),
            cgroup_root=str(self.cgroup),
        )


FAILURE = {
    "phase": "generate",
    "cause": "AttributeError: 'NoneType' object has no attribute 'hidden_states'",
    "journal_tail": JOURNAL.splitlines(),
    "traceback": [
        "Traceback (most recent call last):",
        '  File "eagle_worker.py", line 1, in forward_batch_generation',
        "AttributeError: 'NoneType' object has no attribute 'hidden_states'",
    ],
    "response": {"status": 500, "body": f"upstream said api_key={API_KEY}"},
}
REQUEST = {"url": "http://127.0.0.1:30000/generate", "headers": {"Authorization": f"Bearer {API_KEY}"}, "text": "Hi"}


def members(path: str) -> dict[str, str]:
    """Every file of the bundle by its name under the bundle's top directory."""
    with tarfile.open(path) as tar:
        out = {}
        for m in tar.getmembers():
            assert m.isfile(), m.name
            top, _, name = m.name.partition("/")
            assert top == os.path.basename(path)[: -len(".tar.gz")]
            out[name] = tar.extractfile(m).read().decode()
        return out


def collect(tmp_path: Path, host: Host, **kw) -> dict:
    inst = kw.pop("inst", None) or make_instance(tmp_path)
    args = dict(invocation=INVOCATION, failure=FAILURE, request=REQUEST, ports=host.ports())
    args.update(kw)
    return evidence.collect(inst, **args)


def install_py_spy(inst: Instance) -> Path:
    spy = Path(inst.venv) / "bin" / "py-spy"
    spy.write_text("#!/bin/sh\nexit 1\n")
    spy.chmod(0o755)
    return spy


# --------------------------------------------------------------------------- the bundle


def test_every_item_is_in_the_bundle(tmp_path):
    host = Host(tmp_path)
    inst = make_instance(tmp_path)
    spy = install_py_spy(inst)
    res = collect(tmp_path, host, inst=inst)
    assert res["path"] == os.path.join(inst.state_dir, "evidence", "main", os.path.basename(res["path"]))
    assert os.path.basename(res["path"]) == f"20251201T000000.000Z-{INVOCATION}.tar.gz"
    assert res["bytes"] == os.path.getsize(res["path"]) > 0
    assert [i["name"] for i in res["items"]] == list(evidence_items.ITEMS)
    assert all(i["ok"] for i in res["items"]), res["items"]
    assert res["truncated"] is False and res["host"] == "gpu-node-01"
    files = members(res["path"])
    assert set(files) == {
        "manifest.json",
        "unit-state.txt",
        f"py-spy/{MAIN}.txt",
        f"py-spy/{RANK0}.txt",
        f"py-spy/{RANK1}.txt",
        "journal.txt",
        "failure.json",
        "traceback.txt",
        f"config/{UNIT}",
        "config/main.env",
        "config/instance.json",
        "patches.json",
        "generation.json",
        "gpu-state.json",
        "nvidia-smi-q.txt",
        "kernel-xid.txt",
        "pip-freeze.txt",
    }
    # The venv's own py-spy, every process of the cgroup and the main pid's descendants; not the host's others.
    dumped = sorted(int(c[-1]) for c in host.calls if c[0] == str(spy))
    assert dumped == [MAIN, RANK0, RANK1]
    assert "event_loop_overlap" in files[f"py-spy/{RANK1}.txt"]
    journal_calls = [c for c in host.calls if c[0] == "journalctl" and c[1] != "-k"]
    assert journal_calls[0][-3:] == [f"_SYSTEMD_INVOCATION_ID={INVOCATION}", "+", f"INVOCATION_ID={INVOCATION}"]
    assert "AttributeError: 'NoneType' object has no attribute 'hidden_states'" in files["journal.txt"]
    assert "-- unit fallback --" not in files["journal.txt"]
    kernel = files["kernel-xid.txt"].splitlines()
    assert [line for line in kernel if not line.startswith("#")] == [
        line for line in KERNEL.splitlines() if "NVRM" in line
    ]
    failure = json.loads(files["failure.json"])
    assert failure["failure"]["phase"] == "generate" and failure["request"]["text"] == "Hi"
    assert failure["response"]["status"] == 500
    assert "forward_batch_generation" in files["traceback.txt"]
    manifest = json.loads(files["manifest.json"])
    assert manifest["invocation"] == INVOCATION and manifest["items"] == res["items"]
    assert json.loads(files["patches.json"])["patches"] == ["fix-eagle3-first-decode"]
    assert "sglang==0.5.23" in files["pip-freeze.txt"] and "NVSMI LOG" in files["nvidia-smi-q.txt"]
    assert json.loads(files["gpu-state.json"])["processes"][0]["pid"] == RANK0
    assert "NCCL_DEBUG" in files["config/main.env"] and "ExecStart=" in files[f"config/{UNIT}"]


def test_no_secret_anywhere_in_the_bundle(tmp_path):
    host = Host(tmp_path)
    inst = make_instance(tmp_path)
    install_py_spy(inst)
    res = collect(tmp_path, host, inst=inst)
    files = members(res["path"])
    everything = gzip.decompress(Path(res["path"]).read_bytes()).decode(errors="replace")  # names and headers too
    for secret in SECRETS:
        for form in secret_rule.forms(secret):
            assert form not in everything, f"{form!r} leaked"
            assert form not in json.dumps(res)
    # Redacted in place, the lines kept: what is not secret is still there.
    journal = files["journal.txt"]
    assert f"api_key='{secret_rule.MASK}'" in journal and "max_total_tokens=4096" in journal
    assert "tokenizer_path='/models/m'" in journal and f"Authorization: Bearer {secret_rule.MASK}" in journal
    assert f'HF_TOKEN="{secret_rule.MASK}"' in files["config/main.env"]
    assert f"--admin-api-key {secret_rule.MASK}" in files[f"config/{UNIT}"]
    assert f"Environment=SGLANG_API_KEY={secret_rule.MASK}" in files["unit-state.txt"]
    assert f"--api-key {secret_rule.MASK}" in files[f"py-spy/{RANK0}.txt"]
    assert f"https://{secret_rule.MASK}@pypi.example.internal" in files["pip-freeze.txt"]
    assert json.loads(files["config/instance.json"])["argv"][-1] == secret_rule.MASK
    assert json.loads(files["failure.json"])["request"]["headers"]["Authorization"] == f"Bearer {secret_rule.MASK}"


def test_the_manifest_says_what_was_redacted(tmp_path):
    """The manifest's note on the redaction is under a name the secret rule does not take for a secret's (under
    "secrets" it was itself masked: the note read "<secret>")."""
    res = collect(tmp_path, Host(tmp_path))
    manifest = json.loads(members(res["path"])["manifest.json"])
    assert manifest["redaction"] == (
        f"every value of the secrets file, secret flags and secret-named settings replaced by {secret_rule.MASK}"
    )


def test_the_secrets_file_is_never_included(tmp_path):
    host = Host(tmp_path)
    inst = make_instance(tmp_path)
    # Even a record whose environment file is the secrets file (a wrong record) does not bring it in.
    inst.env_path = inst.secrets_path
    res = collect(tmp_path, host, inst=inst)
    everything = gzip.decompress(Path(res["path"]).read_bytes()).decode(errors="replace")
    assert SECRETS_MARKER not in everything and "main.secrets" not in [n.split("/")[-1] for n in members(res["path"])]
    for secret in SECRETS:
        assert secret not in everything


def test_the_budget_is_respected(tmp_path):
    host = Host(tmp_path)
    inst = make_instance(tmp_path)
    install_py_spy(inst)
    host.delays["nvidia-smi"] = 60.0  # a hung GPU: nvidia-smi -q never answers
    t0 = host.now
    res = collect(tmp_path, host, inst=inst, budget_s=3.2)
    items = {i["name"]: i for i in res["items"]}
    assert host.now - t0 <= 3.2 and res["seconds"] <= 3.2
    assert items["nvidia-smi"]["ok"] is False and "timed out" in items["nvidia-smi"]["detail"]
    for name in ("kernel", "pip-freeze"):
        assert items[name] == {"name": name, "ok": False, "seconds": 0.0, "detail": "skipped: budget"}
    assert all(items[n]["ok"] for n in ("unit-state", "py-spy", "journal", "failure", "config", "patches"))
    assert res["truncated"] is True
    assert "pip-freeze.txt" not in members(res["path"])


def test_a_slow_item_gets_its_own_timeout_only(tmp_path):
    host = Host(tmp_path)
    host.delays["py-spy"] = 30.0  # every dump hangs (a process stuck in the kernel)
    inst = make_instance(tmp_path)
    install_py_spy(inst)
    ports = host.ports()
    ports.workers = 1  # the fake clock is one for all threads: one dump at a time keeps its arithmetic exact
    res = evidence.collect(inst, invocation=INVOCATION, failure=FAILURE, request=REQUEST, ports=ports)
    items = {i["name"]: i for i in res["items"]}
    assert items["py-spy"]["ok"] is False and items["py-spy"]["seconds"] <= evidence_items.CAPS["py-spy"]
    assert res["seconds"] <= evidence.BUDGET_S
    files = members(res["path"])
    first = files[f"py-spy/{MAIN}.txt"]
    assert "dump --pid 4100  (" in first and "dump --nonblocking --pid 4100  (" in first and "timed out" in first
    assert files[f"py-spy/{RANK1}.txt"] == "[no time left for another attempt]\n"
    assert "timed out after" in items["py-spy"]["detail"]
    assert items["journal"]["ok"] and items["failure"]["ok"]


def test_a_refused_attach_is_named(tmp_path):
    host = Host(tmp_path)
    inst = make_instance(tmp_path)
    install_py_spy(inst)
    original = host.run
    denied = "Permission Denied: Try running again with elevated permissions by going 'sudo env \"PATH=$PATH\" !!'"

    def no_ptrace(argv, timeout):
        if argv[0].endswith("py-spy"):
            return subprocess.CompletedProcess(argv, 1, "", denied)
        return original(argv, timeout)

    host.run = no_ptrace
    res = collect(tmp_path, host, inst=inst)
    item = next(i for i in res["items"] if i["name"] == "py-spy")
    assert item["ok"] is False and item["detail"].endswith(f"(see py-spy/<pid>.txt): {denied}")
    assert "dump --nonblocking --pid" in members(res["path"])[f"py-spy/{MAIN}.txt"]  # tried both ways


def test_missing_tools_are_reported_not_raised(tmp_path):
    host = Host(tmp_path)
    host.missing |= {"py-spy", "nvidia-smi"}
    host.snapshot_error = gpu.NvidiaSmiError("nvidia-smi is not installed (no NVIDIA driver on this host?)")
    res = collect(tmp_path, host)  # no <venv>/bin/py-spy either
    items = {i["name"]: i for i in res["items"]}
    assert items["py-spy"]["ok"] is False and "py-spy not found" in items["py-spy"]["detail"]
    assert items["nvidia-smi"] == {**items["nvidia-smi"], "ok": False, "detail": "nvidia-smi not found on this host"}
    assert items["gpu-state"]["ok"] is False and "not installed" in items["gpu-state"]["detail"]
    assert items["journal"]["ok"] and os.path.exists(res["path"])


def test_a_dead_unit_and_no_kernel_log(tmp_path):
    """The crash case: the unit's processes are gone (nothing to dump); a container: no kernel log to read."""
    host = Host(tmp_path)
    inst = make_instance(tmp_path)
    install_py_spy(inst)
    shutil.rmtree(host.cgroup / "system.slice")
    for pid in (MAIN, RANK0, RANK1):
        shutil.rmtree(host.proc / str(pid))
    host.show = SHOW.replace(f"MainPID={MAIN}", "MainPID=0")
    host.missing.add("dmesg")
    original = host.run

    def no_kernel(argv, timeout):
        if argv[:2] == ["journalctl", "-k"]:
            return subprocess.CompletedProcess(argv, 0, "-- No entries --\n", "")
        return original(argv, timeout)

    host.run = no_kernel
    res = collect(tmp_path, host, inst=inst)
    items = {i["name"]: i for i in res["items"]}
    assert items["py-spy"]["ok"] is False and "no process to dump" in items["py-spy"]["detail"]
    assert items["kernel"]["ok"] is False and "kernel log not readable" in items["kernel"]["detail"]
    assert "dmesg not found" in members(res["path"])["kernel-xid.txt"]


def test_journal_falls_back_to_the_unit(tmp_path):
    host = Host(tmp_path)
    host.journal_for_invocation = "-- No entries --\n"
    res = collect(tmp_path, host, invocation=None, failure=None, request=None)
    assert os.path.basename(res["path"]).endswith("Z-on-demand.tar.gz")
    files = members(res["path"])
    assert files["journal.txt"].startswith("-- unit fallback --")
    # On demand, the invocation is the unit's current one (systemctl show), tried before the fallback.
    assert any(f"_SYSTEMD_INVOCATION_ID={INVOCATION}" in c for c in host.calls)
    items = {i["name"]: i for i in res["items"]}
    assert "no lines for invocation" in items["journal"]["detail"]
    assert items["failure"]["detail"] == "on demand: no failure given"
    assert json.loads(files["manifest.json"])["on_demand"] is True


def test_pruning_keeps_the_newest(tmp_path):
    host = Host(tmp_path)
    inst = make_instance(tmp_path)
    paths = []
    for n in range(7):
        host.wall_now += 60
        paths.append(collect(tmp_path, host, inst=inst, keep=3, invocation=f"inv{n}")["path"])
    left = sorted(os.listdir(os.path.dirname(paths[0])))
    assert left == sorted(os.path.basename(p) for p in paths[-3:])
    # Two in the same millisecond: both kept, neither overwritten.
    a = collect(tmp_path, host, inst=inst, keep=10, invocation=None)["path"]
    b = collect(tmp_path, host, inst=inst, keep=10, invocation=None)["path"]
    assert a != b and os.path.exists(a) and os.path.exists(b)


def test_modes(tmp_path):
    host = Host(tmp_path)
    inst = make_instance(tmp_path)
    out_dir = tmp_path / "evidence"
    old = os.umask(0o022)
    try:
        res = collect(tmp_path, host, inst=inst, out_dir=str(out_dir))
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(res["path"]).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(out_dir / "main").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(out_dir).st_mode) == 0o700  # created by the collection
    with tarfile.open(res["path"]) as tar:
        assert {m.mode for m in tar.getmembers()} == {0o600}
    assert not [n for n in os.listdir(out_dir / "main") if n.startswith(".")]  # no temporary file left


def test_for_failure_never_raises(tmp_path):
    host = Host(tmp_path)
    inst = make_instance(tmp_path)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    out = evidence.for_failure(inst, FAILURE, INVOCATION, host.ports(), out_dir=str(blocker))
    assert set(out) == {"error"} and out["error"].startswith("no evidence bundle: ")

    def broken(argv, timeout):
        raise RuntimeError(f"a bug, with the key {API_KEY} in its message")

    ports = host.ports()
    ports.run = broken
    res = evidence.for_failure(inst, FAILURE, INVOCATION, ports)
    assert os.path.exists(res["path"])  # every command item failed; the bundle is still written
    assert not [i for i in res["items"] if i["name"] == "journal" and i["ok"]]
    assert API_KEY not in json.dumps(res)
    # The failing invocation may come in the failure itself.
    res = evidence.for_failure(inst, {**FAILURE, "invocation": "feedface"}, None, host.ports())
    assert os.path.basename(res["path"]).endswith("-feedface.tar.gz")
    ports.snapshot = None  # not even callable: still an item, not an exception
    assert "path" in evidence.for_failure(inst, None, None, ports)


# --------------------------------------------------------------------------- plugins/modules/sglang_collect.py

RUNNER = """\
import sys
sys.argv = ['sglang_collect', {argfile!r}]
exec(compile(open({module!r}).read(), {module!r}, 'exec'), {{'__name__': '__main__'}})
"""


def run_module(tmp_path: Path, args: dict) -> tuple[int, dict]:
    argfile = tmp_path / "args.json"
    argfile.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": args}))
    runner = tmp_path / "runner.py"
    runner.write_text(
        RUNNER.format(argfile=str(argfile), module=str(REPO / "plugins" / "modules" / "sglang_collect.py"))
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "collections"), os.environ.get("PYTHONPATH", "")])}
    env["PATH"] = str(tmp_path / "nobin")  # no systemctl, journalctl, nvidia-smi, py-spy, dmesg: all reported
    proc = subprocess.run([sys.executable, str(runner)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip(), proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def test_module_collects_on_the_host(tmp_path):
    inst = make_instance(tmp_path)
    record = {k: v for k, v in vars(inst).items() if k not in ("state_dir", "service_user")}
    rc, out = run_module(tmp_path, {"instance": record, "state_dir": str(tmp_path / "state"), "budget_s": 3})
    assert rc == 0, out
    assert out["changed"] is True and out["path"].startswith(str(tmp_path / "state" / "evidence" / "main"))
    assert [i["name"] for i in out["items"]] == list(evidence_items.ITEMS)
    assert "unit-state" in out["msg"] and os.path.exists(out["path"])
    rc, out = run_module(tmp_path, {"instance": record, "_ansible_check_mode": True})
    assert rc == 0 and out["path"] is None and out["changed"] is False
    rc, out = run_module(tmp_path, {"instance": {**record, "name": "../x"}})
    assert rc == 1 and "not a rendered instance record" in out["msg"]


# --------------------------------------------------------------------------- real processes, real py-spy

TREE = textwrap.dedent(
    """\
    import subprocess, sys, time

    CHILD = '''
    import sys, time
    def evidence_rank_sleeps_in_known_function(rank):
        print("ready", flush=True)
        time.sleep(600)
    evidence_rank_sleeps_in_known_function(int(sys.argv[1]))
    '''

    def evidence_parent_waits_for_its_ranks():
        ranks = [
            subprocess.Popen([sys.executable, "-c", CHILD, str(r), "--api-key", sys.argv[1]], stdout=subprocess.PIPE, text=True)
            for r in range(2)
        ]
        for rank in ranks:
            rank.stdout.readline()
        print(" ".join(str(r.pid) for r in ranks), flush=True)
        time.sleep(600)

    evidence_parent_waits_for_its_ranks()
    """
)


def real_py_spy() -> str | None:
    for candidate in (os.environ.get("SGLANG_DEPLOY_PY_SPY"), str(REPO / ".venv" / "bin" / "py-spy")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return shutil.which("py-spy")


def test_real_py_spy_dumps_every_rank(tmp_path):
    spy = real_py_spy()
    if spy is None:
        pytest.fail("py-spy is not installed (SGLANG_DEPLOY_PY_SPY, .venv/bin/py-spy, PATH): `make setup` installs it")
    inst = make_instance(tmp_path)
    (Path(inst.venv) / "bin" / "py-spy").symlink_to(spy)  # found as the unit's virtualenv's own
    tree = subprocess.Popen(
        [sys.executable, "-c", TREE, API_KEY], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        ranks = [int(pid) for pid in tree.stdout.readline().split()]
        assert len(ranks) == 2, "the process tree did not start"
        fake = Host(tmp_path)

        def run(argv, timeout):  # systemd is faked (the tree is no unit): everything else runs for real
            if argv[0] == "systemctl":
                return subprocess.CompletedProcess(argv, 0, f"MainPID={tree.pid}\nControlGroup=\n", "")
            if argv[0] == "journalctl" and argv[1] != "-k":
                return subprocess.CompletedProcess(argv, 0, JOURNAL, "")
            return evidence.run_command(argv, timeout)

        ports = evidence.EvidencePorts(run=run, snapshot=fake.snapshot)
        res = evidence.collect(inst, invocation=None, failure=None, request=None, ports=ports)
    finally:
        os.killpg(tree.pid, signal.SIGKILL)
        tree.wait()
    item = next(i for i in res["items"] if i["name"] == "py-spy")
    files = members(res["path"])
    if not item["ok"] and any(w in item["detail"].lower() for w in ("permission denied", "not permitted")):
        pytest.skip(f"py-spy cannot attach here: {item['detail']}")
    assert item["ok"], (item, files.get(f"py-spy/{ranks[0]}.txt"))
    assert f"dumped 3 of 3 Python processes [{tree.pid}, {ranks[0]}, {ranks[1]}]" in item["detail"]
    assert "evidence_parent_waits_for_its_ranks" in files[f"py-spy/{tree.pid}.txt"]
    for pid in ranks:
        assert "evidence_rank_sleeps_in_known_function" in files[f"py-spy/{pid}.txt"], files[f"py-spy/{pid}.txt"]
        assert f"--api-key {secret_rule.MASK}" in files[f"py-spy/{pid}.txt"]  # py-spy prints the command line
    everything = gzip.decompress(Path(res["path"]).read_bytes()).decode(errors="replace")
    assert API_KEY not in everything
    assert res["seconds"] <= evidence.BUDGET_S
