"""GPU test doubles shared by test_nvsim, test_gpu_gate, test_gpu_state and test_gpu_verdict.

The real H200 captures (tests/vectors) parsed into sections; the lab's simulated nvidia-smi
(lab/gpu_sim/nvsim.py) behind a PATH shim, with real processes holding its GPUs; the GPU gate
installed as tasks/gate.yml lays it out on a host; plugins/modules/gpu_state.py run as Ansible runs it.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import yaml

import nvsim
from support import COLLECTIONS, MODULE_UTILS, REPO, env_with_pythonpath

GPU_SIM = REPO / "lab" / "gpu_sim"

# ---------------------------------------------------------------- the captures

VECTORS = REPO / "tests" / "vectors" / "nvidia-smi-h200.md"
UUID_1GPU = "GPU-b2819aac-de39-ce4f-64d5-7aafac82d681"
UUIDS_2GPU = ["GPU-81d1a10d-2b95-d5f4-b2ab-083d424a2e21", "GPU-82ef1e35-d99e-a4c9-6554-afe7e2603d37"]


def sections() -> dict[str, list[tuple[str, str]]]:
    """{section title: [(command, expected output), ...]} from the vectors file."""
    out: dict[str, list[tuple[str, str]]] = {}
    title = None
    in_block = False
    cmd = None
    buf: list[str] = []
    for line in VECTORS.read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            title = line[3:].strip()
            out[title] = []
        elif line.startswith("```"):
            if in_block and cmd is not None:
                out[title].append((cmd, "\n".join(buf)))
            in_block, cmd, buf = not in_block, None, []
        elif in_block and line.startswith("$ nvidia-smi"):
            if cmd is not None:
                out[title].append((cmd, "\n".join(buf)))
            cmd, buf = line[2:], []
        elif in_block:
            if cmd is None and title and "plain nvidia-smi" in title:
                cmd = "nvidia-smi"
            buf.append(line)
    return out


VEC = sections()


def expected_text(raw: str) -> str:
    return "" if raw.strip() == "(no output, exit status 0)" else raw + "\n"


# ---------------------------------------------------------------- the simulator


def simulated(where: Path, count: int = 4, seed: str = "gate") -> tuple[str, dict]:
    """`count` simulated GPUs under where, and an environment whose nvidia-smi reads them: (state file, env).

    The nvidia-smi shim finds nvsim through its own PYTHONPATH (the environment returned leaves
    PYTHONPATH alone: the gate under test must not see lab/gpu_sim) and logs each call, one line
    of arguments, to where/nvidia-smi.calls.
    """
    state = where / "state.json"
    nvsim.write_state(nvsim.default_state(count, seed=seed), str(state))
    bin_dir = where / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "nvidia-smi"
    shim.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> {shlex.quote(str(where / "nvidia-smi.calls"))}\n'
        f"PYTHONPATH={shlex.quote(str(GPU_SIM))} exec {shlex.quote(sys.executable)} "
        "-c 'import nvsim; nvsim.main_nvidia_smi()' \"$@\"\n"
    )
    shim.chmod(0o755)
    return str(state), {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "LAB_GPU_STATE": str(state)}


def nvidia_smi_calls(state: str) -> int:
    """How many times the shim of simulated() has been run."""
    calls = Path(state).parent / "nvidia-smi.calls"
    return len(calls.read_text().splitlines()) if calls.exists() else 0


@contextlib.contextmanager
def holding(state: str, argv: list[str], gpu: int, mib: int) -> Iterator[subprocess.Popen]:
    """A real process (argv) registered as holding `mib` on simulated GPU `gpu`; killed on exit."""
    holder = subprocess.Popen(argv)
    try:
        nvsim.lab_gpu(["hold", "--pid", str(holder.pid), "--gpu", str(gpu), "--mib", str(mib)], path=state)
        yield holder
    finally:
        holder.kill()
        holder.wait()


# ---------------------------------------------------------------- the gate, as installed on a host

GATE = REPO / "roles" / "sglang_service" / "files" / "sglang-gpu-gate"
PACKAGE = MODULE_UTILS / "sglang_deploy"


def _gate_package() -> tuple[str, ...]:
    """What roles/sglang_service/tasks/gate.yml installs beside the gate, read from its task (one list)."""
    tasks = yaml.safe_load((REPO / "roles" / "sglang_service" / "tasks" / "gate.yml").read_text(encoding="utf-8"))
    (task,) = [t for t in tasks if t.get("name") == "Install the GPU logic the gate runs"]
    return tuple(task["loop"])


GATE_PACKAGE = _gate_package()


def imports_beyond(package: tuple[str, ...]) -> list[str]:
    """What the files of `package` (names in sglang_deploy, as a host gets them beside a script) import that is
    neither the standard library nor one of those files: empty when they run on a host's bare Python."""
    shipped = {name[:-3] for name in package} - {"__init__"}
    beyond = []
    for name in package:
        for node in ast.walk(ast.parse((PACKAGE / name).read_text())):
            if isinstance(node, ast.Import):
                tops = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                tops = {node.module.split(".")[0]}
            elif isinstance(node, ast.ImportFrom):
                if not (node.level == 1 and (node.module in shipped or {a.name for a in node.names} <= shipped)):
                    beyond.append(f"{name}: from {'.' * node.level}{node.module or ''} import ...")
                continue
            else:
                continue
            beyond += [f"{name}: {top}" for top in sorted(tops - set(sys.stdlib_module_names))]
    return beyond


def install_gate(root: Path) -> Path:
    """The host layout under root: root/sglang-gpu-gate and root/sglang_deploy/{GATE_PACKAGE}; the gate's path."""
    (root / "sglang_deploy").mkdir(parents=True)
    for name in GATE_PACKAGE:
        shutil.copy2(PACKAGE / name, root / "sglang_deploy" / name)
    shutil.copy2(GATE, root / "sglang-gpu-gate")
    return root / "sglang-gpu-gate"


# ---------------------------------------------------------------- plugins/modules/gpu_state.py

GPU_STATE_RUNNER = """\
import sys
sys.argv = ['gpu_state', {argfile!r}]
exec(compile(open({module!r}).read(), {module!r}, 'exec'), {{'__name__': '__main__'}})
"""


def run_gpu_state(env: dict, args: dict, workdir: Path | None = None) -> tuple[int, dict]:
    """plugins/modules/gpu_state.py run as Ansible runs it (arguments as JSON, the package from collections/).

    Files go to workdir (default: beside LAB_GPU_STATE); the package comes from PYTHONPATH (collections/).
    """
    workdir = workdir or Path(env["LAB_GPU_STATE"]).parent
    argfile = workdir / "args.json"
    argfile.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": args}))
    runner = workdir / "ansible_module_runner.py"
    runner.write_text(
        GPU_STATE_RUNNER.format(argfile=str(argfile), module=str(REPO / "plugins" / "modules" / "gpu_state.py"))
    )
    proc = subprocess.run(
        [sys.executable, str(runner)],
        env=env_with_pythonpath(env, COLLECTIONS),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.stdout.strip(), f"gpu_state printed no result (exit {proc.returncode}): {proc.stderr}"
    return proc.returncode, json.loads(proc.stdout)
