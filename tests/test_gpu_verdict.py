"""The unit's gate and the modules give one verdict, on every vector in tests/vectors and every simulated state.

For each state one test runs the gate (a subprocess, installed as on the host, with an
nvidia-smi on PATH that answers from that state) and gpu.wait_clean (the wait both
modules run), and asserts that they say the same: the outcome (clean; refused; failed,
that is nvidia-smi failed or a GPU is missing), every offender line, and the message or
note. Another does the same with the gate and the gpu_state module, on every state that
holds still. Both assert the verdict the state calls for too, so that agreeing on a
wrong verdict fails as well.

Two nvidia-smi doubles answer. The lab's simulator (lab/gpu_sim), with real processes
holding its GPUs. And a replay: the captures of tests/vectors, field by field (checked
against every recorded query), plus the states the simulator cannot show ([N/A] and
[Not Supported] values, output nvidia-smi should never print).
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import nvsim
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import gpu
from support import started
from support.gpus import VEC, VECTORS, expected_text, run_gpu_state, simulated

ONE_IDLE = "1 GPU, idle"
ONE_BUSY = "1 GPU, one python3 process holding 20 GB (torch.empty on cuda)"
TWO_IDLE = "2 GPUs: idle, with header and units"
TWO_BUSY = "2 GPUs: process 564 holds 8 GB on each GPU; process 565 holds 3 GB on GPU 1 and a 518 MiB context on GPU 0"
RELEASE = "Release timing: SIGKILL of a process holding 30 GB on GPU 0, polled with nvidia-smi"
TABLE = "2 GPUs: plain nvidia-smi, idle"
# Sections that show no GPU state (memory, processes): nothing to judge.
NOT_A_GPU_STATE = {
    "2 GPUs: nvidia-smi topo -m": "links and CPU affinity between GPUs: no memory, no processes",
    "NCCL all-reduce, 2 GPUs, torch.distributed, 256 MiB fp32, mean of 10": "all-reduce timings, not nvidia-smi output",
}
HEADERS = {"gpus": nvsim.GPU_FIELDS, "apps": nvsim.APP_FIELDS}  # field: (header, unit), as nvidia-smi 580 prints

# ---------------------------------------------------------------- the replay (a recorded nvidia-smi)

REPLAY = '''#!{python}
"""Recorded nvidia-smi (a test double): answers CSV queries from the polls in $NV_REPLAY.

Each --query-gpu answers the next poll (the last one, once all are used); a
--query-compute-apps answers the poll of the --query-gpu before it.
"""
import json
import os
import sys

path = os.environ["NV_REPLAY"]
with open(path, encoding="utf-8") as fh:
    state = json.load(fh)
if state.get("fail"):
    sys.stdout.write(state["fail"]["stdout"])
    sys.stderr.write(state["fail"]["stderr"])
    sys.exit(state["fail"]["rc"])
opts = dict(arg.split("=", 1) for arg in sys.argv[1:] if arg.startswith("--") and "=" in arg)
kind = "gpus" if "--query-gpu" in opts else "apps"
fields = opts.get("--query-gpu", opts.get("--query-compute-apps", "")).split(",")
fmt = opts.get("--format", "").split(",")
counter = path + ".polls"
answered = int(open(counter).read()) if os.path.exists(counter) else 0
if kind == "gpus":
    answered += 1
    # Atomically: the --query-compute-apps of the same snapshot runs at the same time and reads it.
    with open(counter + f".{{os.getpid()}}", "w") as fh:
        fh.write(str(answered))
    os.replace(counter + f".{{os.getpid()}}", counter)
poll = state["polls"][min(max(answered - 1, 0), len(state["polls"]) - 1)]
headers = state["headers"][kind]
unknown = [f for f in fields if f not in headers or any(f not in row for row in poll[kind])]
if unknown:
    sys.stderr.write(f"replay: {{unknown}} not recorded for this state\\n")
    sys.exit(99)


def cell(row, f):
    value, unit = row[f], headers[f][1]
    return f"{{value}} {{unit}}" if unit and "nounits" not in fmt and not value.startswith("[") else value


lines = [] if "noheader" in fmt else [", ".join(headers[f][0] for f in fields)]
lines += [", ".join(cell(row, f) for f in fields) for row in poll[kind]]
sys.stdout.write("".join(line + "\\n" for line in lines))
'''


def replay_env(where: Path, polls: list[dict], fail: dict | None = None) -> dict:
    """An environment whose nvidia-smi replays `polls` ({gpus, apps}: rows of {field: value without units})."""
    where.mkdir(parents=True, exist_ok=True)
    (where / "replay.json").write_text(json.dumps({"polls": polls, "fail": fail, "headers": HEADERS}))
    (where / "bin").mkdir(exist_ok=True)
    smi = where / "bin" / "nvidia-smi"
    smi.write_text(REPLAY.format(python=sys.executable))
    smi.chmod(0o755)
    return {**os.environ, "PATH": f"{where / 'bin'}:{os.environ['PATH']}", "NV_REPLAY": str(where / "replay.json")}


def rewind(env: dict) -> None:
    """The replay starts again from its first poll."""
    if "NV_REPLAY" in env:
        Path(env["NV_REPLAY"] + ".polls").unlink(missing_ok=True)


# ---------------------------------------------------------------- the vectors as states


def recorded_rows(cmd: str, out: str) -> tuple[str, list[dict]]:
    """(gpus|apps, rows as {field: value without units}) of one recorded CSV query."""
    opts = dict(arg.split("=", 1) for arg in cmd.split()[1:] if "=" in arg)
    kind = "gpus" if "--query-gpu" in opts else "apps"
    fields = opts["--query-gpu" if kind == "gpus" else "--query-compute-apps"].split(",")
    fmt = opts["--format"].split(",")
    lines = expected_text(out).splitlines()[0 if "noheader" in fmt else 1 :]
    rows = []
    for line in lines:
        row = {}
        for f, value in zip(fields, line.split(", "), strict=True):
            unit = HEADERS[kind][f][1]
            row[f] = value[: -len(unit) - 1] if unit and "nounits" not in fmt and value.endswith(f" {unit}") else value
        rows.append(row)
    return kind, rows


def captured_poll(title: str) -> dict:
    """The state one section's CSV queries show: GPUs merged by index, processes (None: not queried)."""
    gpus: dict[str, dict] = {}
    apps = None
    for cmd, out in VEC[title]:
        if "--query-" not in cmd:
            continue
        kind, rows = recorded_rows(cmd, out)
        if kind == "apps":
            assert apps is None or apps == rows, f"{title}: two queries disagree on the processes"
            apps = rows
        for row in rows if kind == "gpus" else ():
            known = gpus.setdefault(row["index"], {})
            assert all(known.get(f, v) == v for f, v in row.items()), f"{title}: two queries disagree on a GPU"
            known.update(row)
    return {"gpus": list(gpus.values()), "apps": apps}


def completed(poll: dict, host: dict) -> dict:
    """poll's GPUs with the fields it lacks taken from another capture of the same host (by index)."""
    by_index = {g["index"]: g for g in host["gpus"]}
    return {**poll, "gpus": [{**by_index[g["index"]], **g} for g in poll["gpus"]]}


def section_block(title: str) -> list[str]:
    """The lines of a section's code block, for the sections that are not nvidia-smi commands."""
    text = VECTORS.read_text(encoding="utf-8").split(f"## {title}\n", 1)[1]
    return text.split("```\n", 2)[1].splitlines()


def release_polls() -> list[dict]:
    """'Release timing': two polls of a 2-GPU host, logged as pids and memory.used per GPU.

    The log records neither the process's own memory nor its name: they replay as [N/A].
    The GPUs' other fields are those of the 2-GPU host's captures.
    """
    polls = []
    host = captured_poll(TWO_IDLE)
    for line in section_block(RELEASE):
        m = re.fullmatch(r"t=[\d.]+s apps=\[(.*)\] used=\[(.*)\]", line)
        pids, used = re.findall(r"'(\d+)'", m.group(1)), re.findall(r"'(\d+)'", m.group(2))
        gpus = [{"index": str(i), "memory.used": mib} for i, mib in enumerate(used)]
        uuid0 = host["gpus"][0]["uuid"]  # "a process holding 30 GB on GPU 0"
        apps = [{"pid": p, "gpu_uuid": uuid0, "used_memory": "[N/A]", "process_name": "[N/A]"} for p in pids]
        polls.append(completed({"gpus": gpus, "apps": apps}, host))
    return polls


def table_poll() -> dict:
    """'plain nvidia-smi': GPUs and memory from the table; uuids by bus id from the same host's CSV capture."""
    ((_, text),) = VEC[TABLE]
    uuid_of = {g["pci.bus_id"]: g["uuid"] for g in captured_poll(TWO_IDLE)["gpus"]}
    lines = text.splitlines()
    gpus = []
    for n, line in enumerate(lines):
        m = re.match(r"\|\s+(\d+)\s+(.+?)\s+(?:On|Off)\s+\|\s+(\S+)\s", line)
        if m:
            used, total = re.search(r"(\d+)MiB / (\d+)MiB", lines[n + 1]).groups()
            uuid = uuid_of[m.group(3)]
            gpus.append(
                {"index": m.group(1), "uuid": uuid, "name": m.group(2), "memory.used": used, "memory.total": total}
            )
    assert any("No running processes found" in line for line in lines), "teach table_poll to read process rows"
    return {"gpus": gpus, "apps": []}


def vector_polls() -> dict[str, list[dict]]:
    """{section title: the polls it shows}, for every section that shows a GPU state."""
    busy_one = captured_poll(ONE_BUSY)
    assert {a["gpu_uuid"] for a in busy_one["apps"]} <= {g["uuid"] for g in captured_poll(ONE_IDLE)["gpus"]}
    idle_two = captured_poll(TWO_IDLE)
    # Its processes were not queried; the table of the same host, idle, lists none (and 0 MiB used).
    idle_two["apps"] = table_poll()["apps"]
    return {
        ONE_IDLE: [captured_poll(ONE_IDLE)],
        ONE_BUSY: [completed(busy_one, captured_poll(ONE_IDLE))],  # same host: the process is on the idle GPU's uuid
        TWO_IDLE: [idle_two],
        TWO_BUSY: [captured_poll(TWO_BUSY)],
        RELEASE: release_polls(),
        TABLE: [table_poll()],
    }


VECTOR_POLLS = vector_polls()


def derived(polls_of: str, gpus: dict[int, dict] | None = None, apps: list[dict] = ()) -> list[dict]:
    """A capture's state with some GPU fields replaced and these processes instead of its own."""
    poll = json.loads(json.dumps(VECTOR_POLLS[polls_of][0]))
    for g in poll["gpus"]:
        g.update((gpus or {}).get(int(g["index"]), {}))
    poll["apps"] = [{"gpu_uuid": poll["gpus"][a.pop("gpu")]["uuid"], "process_name": "python3", **a} for a in apps]
    return [poll]


# ---------------------------------------------------------------- the cases


@dataclass
class Case:
    """A state, the GPUs asked for, and the verdict it calls for."""

    id: str
    gpus: list[int]
    expect: str  # clean | refused | failed (nvidia-smi failed, or a GPU is missing)
    expect_lines: list[str] = field(default_factory=list)  # without the /proc part; {pid}: the case's own process
    timeout: float = 0.0
    max_used_mib: int = 1024
    vector: str | None = None  # the section of tests/vectors the state is
    polls: Callable[[int], list[dict]] | None = None  # the replay's polls, given the pid of a live process
    fail: dict | None = None  # the replay's nvidia-smi fails: {rc, stdout, stderr}
    sim: Callable[[str, int], object] | None = None  # sets up the simulator's state file, given a live pid
    module: str = "compared"  # or why the gpu_state module is not compared on this state


SHORT = {  # test ids
    ONE_IDLE: "1gpu-idle",
    ONE_BUSY: "1gpu-held",
    TWO_IDLE: "2gpu-idle-units",
    TWO_BUSY: "2gpu-held",
    RELEASE: "release-log",
    TABLE: "2gpu-table",
}


def vector_case(title: str, gpus: list[int], expect: str, lines: list[str] = (), **kw) -> Case:
    name = f"vector-{SHORT[title]}-gpus{''.join(map(str, gpus))}-{kw.get('timeout', 0):g}s"
    return Case(name, gpus, expect, list(lines), vector=title, polls=lambda pid: VECTOR_POLLS[title], **kw)


def hold(gpu_: int, mib: int) -> Callable[[str, int], object]:
    """The case's live process holds mib on simulated GPU gpu_."""
    return lambda state, pid: nvsim.lab_gpu(
        ["hold", "--pid", str(pid), "--gpu", str(gpu_), "--mib", str(mib)], path=state
    )


def releasing(gpu_: int, mib: int) -> Callable[[str, int], object]:
    """mib on simulated GPU gpu_, no longer listed, released so slowly it stays put (29999 MiB of 30000)."""

    def setup(state: str, pid: int) -> None:
        stray = ["--pid", "999999", "--gpu", str(gpu_), "--mib", str(mib), "--release-seconds", "1e9", "--pinned"]
        nvsim.lab_gpu(["hold", *stray], path=state)
        nvsim.lab_gpu(["release", "--pid", "999999"], path=state)

    return setup


def failing(mode: str) -> Callable[[str, int], object]:
    return lambda state, pid: nvsim.lab_gpu(["fail", mode], path=state)


def idle(state: str, pid: int) -> None:
    """The simulator as it starts: 4 idle GPUs."""


def capture_with(gpus: dict[int, dict] | None = None, apps: list[dict] = ()) -> Callable[[int], list[dict]]:
    """The 2-GPU capture with some GPU fields replaced, and the case's live process as each of `apps`."""
    return lambda pid: derived(TWO_BUSY, gpus, [{**a, "pid": str(pid)} for a in apps])


# A replay of several polls moves on at each query: the module's report snapshot (before its
# wait) takes the first poll, so its wait would judge a later state than the gate's.
SEQUENCE = "the module's report snapshot takes the replay's first poll, so its wait judges a later poll"
NA, NS = "[N/A]", "[Not Supported]"
NO_MEMORY = {i: {"memory.used": NS, "memory.total": NS} for i in (0, 1)}

CASES = [
    vector_case(ONE_IDLE, [0], "clean"),
    vector_case(ONE_IDLE, [0, 1], "failed"),
    vector_case(ONE_BUSY, [0], "refused", ["GPU 0: pid 431 holds 19592 MiB"]),
    vector_case(TWO_IDLE, [0, 1], "clean"),
    vector_case(
        TWO_BUSY,
        [0, 1],
        "refused",
        [
            "GPU 0: pid 564 holds 8148 MiB",
            "GPU 0: pid 565 holds 518 MiB",
            "GPU 1: pid 564 holds 8148 MiB",
            "GPU 1: pid 565 holds 3380 MiB",
        ],
    ),
    vector_case(TWO_BUSY, [1], "refused", ["GPU 1: pid 564 holds 8148 MiB", "GPU 1: pid 565 holds 3380 MiB"]),
    vector_case(RELEASE, [0, 1], "refused", ["GPU 0: pid 769 holds ? MiB"], module=SEQUENCE),
    vector_case(RELEASE, [0, 1], "clean", timeout=5.0, module=SEQUENCE),
    vector_case(RELEASE, [1], "clean", module=SEQUENCE),
    vector_case(TABLE, [0, 1], "clean"),
    # The lab's simulator, with a real process.
    Case("sim-clean", [0, 1], "clean", sim=idle),
    Case("sim-held-by-a-process", [0, 1], "refused", ["GPU 1: pid {pid} holds 8148 MiB"], sim=hold(1, 8148)),
    Case("sim-held-elsewhere", [0, 1], "clean", sim=hold(3, 8148)),
    Case(
        "sim-memory-busy-no-process",
        [2],
        "refused",
        ["GPU 2: 29999 MiB used with no process listed (memory still being released?)"],
        max_used_mib=100,
        sim=releasing(2, 30000),
    ),
    Case("sim-missing-gpu", [0, 7], "failed", sim=idle),
    Case("sim-no-driver", [0], "failed", sim=failing("no-driver")),
    Case("sim-driver-mismatch", [0], "failed", sim=failing("driver-mismatch")),
    # What the simulator cannot show, on the 2-GPU capture: values nvidia-smi cannot give, broken output.
    Case("na-memory-clean", [0, 1], "clean", polls=capture_with({0: {"memory.used": NA}, 1: {"memory.used": NA}})),
    Case(
        "na-memory-held",
        [0, 1],
        "refused",
        ["GPU 0: pid {pid} holds ? MiB"],
        polls=capture_with({0: {"memory.used": NA}, 1: {"memory.used": "0"}}, [{"gpu": 0, "used_memory": NA}]),
    ),
    Case(
        "na-memory-beside-a-busy-gpu",
        [0, 1],
        "refused",
        ["GPU 0: 9000 MiB used with no process listed (memory still being released?)"],
        polls=capture_with({0: {"memory.used": "9000"}, 1: {"memory.used": NA}}),
    ),
    Case("not-supported-clean", [0, 1], "clean", polls=capture_with(NO_MEMORY)),
    Case(
        "not-supported-held",
        [1],
        "refused",
        ["GPU 1: pid {pid} holds ? MiB"],
        polls=capture_with(NO_MEMORY, [{"gpu": 1, "used_memory": NS}]),
    ),
    Case("na-index-leaves-the-gpu-missing", [0, 1], "failed", polls=capture_with({1: {"index": NA}})),
    Case("unreadable-output", [0], "failed", fail={"rc": 0, "stdout": "0, GPU-x\n", "stderr": ""}),
    Case("no-nvidia-smi", [0], "failed"),
]


@contextlib.contextmanager
def state_for(case: Case, where: Path) -> Iterator[tuple[dict, int]]:
    """(an environment whose nvidia-smi answers the case's state, the pid of the case's live process)."""
    proc = started(["sleep", "30"])  # /proc shows "sleep 30", not an empty command line mid-exec
    try:
        if case.sim:
            state, env = simulated(where, seed="verdict")
            case.sim(state, proc.pid)
        elif case.polls or case.fail:
            env = replay_env(where, case.polls(proc.pid) if case.polls else [], case.fail)
        else:  # no nvidia-smi anywhere on PATH
            (where / "bin").mkdir()
            env = {**os.environ, "PATH": str(where / "bin")}
        yield env, proc.pid
    finally:
        proc.kill()
        proc.wait()


def without_proc(line: str) -> str:
    """An offender line without what /proc said (user, unit, command)."""
    return re.sub(r" \(user .*\)$", "", line)


def by_gate(gate: Path, env: dict, case: Case) -> dict:
    """The gate's verdict, read from its exit status and what it printed (as the unit's journal shows it)."""
    args = ["--gpus", ",".join(map(str, case.gpus)), "--timeout", f"{case.timeout:g}", "--interval", "0.05"]
    args += ["--max-used-mib", str(case.max_used_mib)]
    proc = subprocess.run(
        [sys.executable, str(gate), *args], env=env, cwd="/", capture_output=True, text=True, timeout=60
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    outcome = {0: "clean", 1: "refused", 2: "failed"}[proc.returncode]
    head, *rest = (proc.stdout if outcome == "clean" else proc.stderr).splitlines()
    assert head.startswith("sglang-gpu-gate: ") and all(line.startswith("  ") for line in rest), proc.stderr
    pattern = {
        "clean": r"GPUs \[[\d, ]+\] clean after [\d.]+s(.*)",
        "refused": r"GPUs \[[\d, ]+\] not clean after [\d.]+s; refusing to start\.(.*)",
        "failed": r"(.*)",
    }[outcome]
    detail = re.fullmatch(pattern, head.removeprefix("sglang-gpu-gate: "))
    assert detail, head
    return {"outcome": outcome, "lines": [line[2:] for line in rest], "detail": detail.group(1)}


def by_wait_clean(env: dict, case: Case, monkeypatch) -> dict:
    """gpu.wait_clean's verdict (the wait sglang_server and gpu_state run), in this process."""
    with monkeypatch.context() as m:
        for name in ("PATH", "LAB_GPU_STATE", "NV_REPLAY"):
            if name in env:
                m.setenv(name, env[name])
            else:
                m.delenv(name, raising=False)
        try:
            res = gpu.wait_clean(case.gpus, case.timeout, 0.05, case.max_used_mib)
        except gpu.NvidiaSmiError as exc:
            return {"outcome": "failed", "lines": [], "detail": str(exc)}
    if res["missing"]:
        return {"outcome": "failed", "lines": [], "detail": res["message"]}
    return {"outcome": "clean" if res["clean"] else "refused", "lines": res["lines"], "detail": res["note"]}


def by_module(env: dict, case: Case, where: Path) -> dict:
    """plugins/modules/gpu_state's verdict with wait=true, from its result as Ansible gets it."""
    args = {
        "wait": True,
        "gpus": case.gpus,
        "timeout": case.timeout,
        "interval": 0.05,
        "max_used_mib": case.max_used_mib,
    }
    rc, out = run_gpu_state(env, args, where)
    wait = out.get("wait")
    if rc == 0:
        assert wait["clean"], out
        return {"outcome": "clean", "lines": [], "detail": wait["note"]}
    if wait is None or wait["missing"]:
        return {"outcome": "failed", "lines": [], "detail": out["msg"]}
    return {"outcome": "refused", "lines": wait["lines"], "detail": wait["note"]}


def assert_expected(verdict: dict, case: Case, pid: int) -> None:
    """The verdict the state calls for: the outcome, and each offender line (ours down to its command)."""
    assert verdict["outcome"] == case.expect, verdict
    assert [without_proc(line) for line in verdict["lines"]] == [x.format(pid=pid) for x in case.expect_lines]
    for line in verdict["lines"]:
        if f"pid {pid} " in line:
            assert line.endswith(f"(user {getpass.getuser()}, unit {gpu.unit_of(pid) or '?'}, command sleep 30)")


def comparable(verdict: dict, case: Case) -> dict:
    """A capture's pids are not this machine's: what /proc says of them here is left out of the comparison."""
    return {**verdict, "lines": [without_proc(x) for x in verdict["lines"]]} if case.vector else verdict


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_the_gate_and_wait_clean_give_one_verdict(case, installed_gate, tmp_path, monkeypatch):
    with state_for(case, tmp_path) as (env, pid):
        rewind(env)
        gate = by_gate(installed_gate, env, case)
        rewind(env)
        waited = by_wait_clean(env, case, monkeypatch)
    assert_expected(gate, case, pid)
    assert comparable(waited, case) == comparable(gate, case)


MODULE_CASES = [c for c in CASES if c.module == "compared"]


@pytest.mark.parametrize("case", MODULE_CASES, ids=[c.id for c in MODULE_CASES])
def test_the_gpu_state_module_gives_the_gates_verdict(case, installed_gate, tmp_path):
    with state_for(case, tmp_path) as (env, pid):
        rewind(env)
        gate = by_gate(installed_gate, env, case)
        rewind(env)
        module = by_module(env, case, tmp_path)
    assert_expected(gate, case, pid)
    assert comparable(module, case) == comparable(gate, case)


# ---------------------------------------------------------------- the cases cover the captures, faithfully


def test_every_section_of_the_captures_is_judged_or_says_why_not():
    judged = {c.vector for c in CASES if c.vector}
    assert judged == set(VECTOR_POLLS)
    assert not judged & set(NOT_A_GPU_STATE)
    assert judged | set(NOT_A_GPU_STATE) == set(VEC)


def test_the_replay_answers_every_recorded_query_as_recorded(tmp_path):
    queries = [(title, cmd, out) for title, cmds in VEC.items() for cmd, out in cmds if "--query-" in cmd]
    assert len(queries) == 8  # the captures' CSV queries, in 4 sections
    for n, (title, cmd, out) in enumerate(queries):
        env = replay_env(tmp_path / str(n), VECTOR_POLLS[title])
        smi = tmp_path / str(n) / "bin" / "nvidia-smi"
        proc = subprocess.run([str(smi), *cmd.split()[1:]], env=env, capture_output=True, text=True, timeout=30)
        assert (proc.returncode, proc.stdout) == (0, expected_text(out)), f"{title}: {cmd}: {proc.stderr}"


def test_the_plain_table_reads_as_the_csv_capture_of_the_same_host():
    def fields(poll: dict) -> list[tuple]:
        return [(g["index"], g["uuid"], g["name"], g["memory.used"], g["memory.total"]) for g in poll["gpus"]]

    assert fields(table_poll()) == fields(captured_poll(TWO_IDLE))


def test_the_release_log_replays_as_two_polls_held_then_released():
    held, released = release_polls()
    assert [(a["pid"], a["gpu_uuid"]) for a in held["apps"]] == [("769", held["gpus"][0]["uuid"])]
    assert [g["memory.used"] for g in held["gpus"]] == ["29136", "3"]
    assert released["apps"] == [] and [g["memory.used"] for g in released["gpus"]] == ["0", "0"]
