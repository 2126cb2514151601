"""The controller's own CPU per host as the fleet grows (issue #12, docs/fleet-scale.md): medians of several runs.

    make lab-up LAB_NODES=8 && ansible-playbook playbooks/deploy.yml        # every node deployed once
    .venv/bin/python bench/fleet_scale.py [--sizes 1,4,8,32,64] [--runs 3] [--out docs/bench/fleet-scale.json]

For each size N: a no-op `playbooks/deploy.yml` (everything already in place) and a `playbooks/status.yml` (what
`python -m driver status` runs), each --runs times, over an inventory of N hosts. Up to the lab's node count they
are the first N nodes; past it, each node is reached by several inventory hosts (aliases: `<node>-sim<k>`, its
variables, its address and port, a control path of their own, so each alias has its own SSH master as a host of
a real fleet does), so that the controller does the per-host work of N hosts on the lab's few. Measured per run,
the controller's CPU time (user + system) of:

- the playbook's process tree: ansible-playbook, its forked workers and the ssh clients they start (each waits for
  its children, so os.wait4's rusage of ansible-playbook holds them all);
- the SSH connection masters (ControlMaster/ControlPersist: detached from the tree, they carry every module's
  bytes): each run gets a fresh control path directory, and its masters' CPU is read from /proc at the end.

Lab nodes share this machine's cores, so wall time mixes the nodes' work with the controller's; the CPU time of the
controller's processes does not. From the medians: the cost per host at each size, the fit cost = fixed + N x
per-host (least squares over the sizes), and the extrapolation to 100 and 1000 hosts: the controller's CPU
seconds, and how many of its cores `forks` (ansible.cfg) keeps busy at most.
"""

from __future__ import annotations

import argparse
import configparser
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
LAB_INVENTORY = REPO / "inventory" / "lab" / "hosts.yml"
# Each measured playbook with its extra arguments. deploy_every_role: the no-op deploy without the state check (every
# role runs: the lever off, as before it); one_call: the floor, one module call per host and nothing else.
PLAYBOOKS = {
    "deploy_noop": ("playbooks/deploy.yml",),
    "deploy_every_role": ("playbooks/deploy.yml", "-e", "sglang_deploy_state=false"),
    "status": ("playbooks/status.yml",),
    "drift": ("playbooks/drift.yml",),
    "one_call": ("bench/playbooks/one_call.yml",),
}
TICK = os.sysconf("SC_CLK_TCK")


def proc_cpu(pid: int) -> float:
    """utime + stime of a live process, in seconds (0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK  # fields 14 and 15 of proc(5), after "pid (comm)"


def masters(control_dir: str) -> list[int]:
    """The SSH connection masters whose control sockets are in control_dir."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if cmd.startswith("ssh") and control_dir in cmd:
                out.append(int(d.name))
    return out


def inventory(lab: dict, n: int, path: Path) -> None:
    """An inventory of n hosts: the lab's nodes in turn, each past the first round an alias of its node."""
    nodes = lab["all"]["children"]["sglang_nodes"]["hosts"]
    names = sorted(nodes)
    hosts = {}
    for i in range(n):
        node = names[i % len(names)]
        alias = node if i < len(names) else f"{node}-sim{i // len(names)}"
        # A control path per alias: one SSH master per inventory host, as on a fleet of distinct hosts.
        hosts[alias] = {**nodes[node], "ansible_control_path": f"%(directory)s/{alias}"}
    doc = {"all": {**lab["all"], "children": {"sglang_nodes": {"hosts": hosts}}}}
    path.write_text(yaml.safe_dump(doc, sort_keys=True))


def run(playbook: tuple[str, ...], inv: Path) -> dict:
    """One run: wall seconds, the tree's CPU, the masters' CPU, its exit status."""
    control_dir = tempfile.mkdtemp(prefix="sgd-cp-")
    env = {
        **os.environ,
        "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
        "ANSIBLE_SSH_CONTROL_PATH_DIR": control_dir,
    }
    cmd = [str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(inv), *playbook]
    with tempfile.TemporaryFile("w+") as out:
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.monotonic() - t0
        mux = masters(control_dir)
        mux_cpu = sum(proc_cpu(p) for p in mux)
        for p in mux:  # this run's own masters, done with (they would idle out after ControlPersist)
            try:
                os.kill(p, signal.SIGTERM)
            except ProcessLookupError:
                pass
        out.seek(0)
        text = out.read()
    shutil.rmtree(control_dir, ignore_errors=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{text[-3000:]}")
    return {
        "wall_s": round(wall, 2),
        "tree_cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
        "ssh_masters_cpu_s": round(mux_cpu, 2),
        "masters": len(mux),
    }


def fit(sizes: list[int], costs: list[float]) -> tuple[float, float]:
    """Least squares cost = fixed + n x per_host."""
    n_mean, c_mean = statistics.fmean(sizes), statistics.fmean(costs)
    per_host = sum((n - n_mean) * (c - c_mean) for n, c in zip(sizes, costs, strict=True)) / sum(
        (n - n_mean) ** 2 for n in sizes
    )
    return c_mean - per_host * n_mean, per_host


def main() -> int:
    ap, a = parse_args()
    sizes = sorted({int(s) for s in a.sizes.split(",")})
    if len(sizes) < 2:
        ap.error("--sizes: at least two sizes (the fit takes a fixed and a per-host cost)")
    if not LAB_INVENTORY.exists():
        print("no lab: make lab-up LAB_NODES=8 && ansible-playbook playbooks/deploy.yml", file=sys.stderr)
        return 2
    lab = yaml.safe_load(LAB_INVENTORY.read_text())
    chosen = a.playbooks.split(",")
    if not set(chosen) <= set(PLAYBOOKS):
        ap.error(f"--playbooks: some of {','.join(PLAYBOOKS)}")
    work = Path(tempfile.mkdtemp(prefix="sgd-fleet-"))
    invs = inventories(lab, sizes, work)
    forks = ansible_forks()
    nodes = len(lab["all"]["children"]["sglang_nodes"]["hosts"])
    results: dict = {
        "sizes": sizes,
        "lab_nodes": nodes,
        "runs": a.runs,
        "forks": forks,
        "cores": os.cpu_count(),
        "playbooks": {},
    }
    for name in chosen:
        playbook = PLAYBOOKS[name]
        run(playbook, invs[min(sizes[-1], nodes)])  # warm: the lab's own caches (nothing is measured)
        per_size = measure(name, playbook, invs, sizes, a.runs)
        results["playbooks"][name] = costs(playbook, per_size, sizes, forks)
    shutil.rmtree(work, ignore_errors=True)
    results["command"] = "bench/fleet_scale.py " + " ".join(sys.argv[1:])
    if a.merge and a.out.exists():
        old = json.loads(a.out.read_text())
        results["playbooks"] = {**old.get("playbooks", {}), **results["playbooks"]}
        results["command"] = "; ".join(filter(None, [old.get("command"), results["command"]]))
    a.out.write_text(json.dumps(results, indent=1) + "\n")
    print_table(results)
    return 0


def parse_args() -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The command line; the parser too, for the errors main finds in it (--playbooks after the lab's check)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,4,8,32,64")
    ap.add_argument("--playbooks", default=",".join(PLAYBOOKS), help=f"some of {','.join(PLAYBOOKS)}")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "bench" / "fleet-scale.json")
    ap.add_argument("--merge", action="store_true", help="keep --out's other playbooks, replace these")
    return ap, ap.parse_args()


def inventories(lab: dict, sizes: list[int], work: Path) -> dict[int, Path]:
    """An inventory file in `work` for each size."""
    invs = {}
    for n in sizes:
        invs[n] = work / f"hosts-{n}.yml"
        inventory(lab, n, invs[n])
    return invs


def ansible_forks() -> int:
    """ansible.cfg's forks: at most that many hosts' workers busy at once."""
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "ansible.cfg")
    return cfg.getint("defaults", "forks")


def measure(name: str, playbook: tuple[str, ...], invs: dict[int, Path], sizes: list[int], runs: int) -> dict:
    """The playbook `runs` times at each size: the samples, the medians of CPU (tree and SSH masters), per host, of
    wall time; each size printed as it is done."""
    per_size = {}
    for n in sizes:
        samples = [run(playbook, invs[n]) for _ in range(runs)]
        cpu = [s["tree_cpu_s"] + s["ssh_masters_cpu_s"] for s in samples]
        per_size[n] = {
            "samples": samples,
            "median_cpu_s": round(statistics.median(cpu), 2),
            "median_cpu_per_host_s": round(statistics.median(cpu) / n, 3),
            "median_wall_s": round(statistics.median(s["wall_s"] for s in samples), 2),
        }
        print(f"{name} on {n} host(s): {per_size[n]['median_cpu_s']} s CPU, {per_size[n]['median_wall_s']} s wall")
    return per_size


def costs(playbook: tuple[str, ...], per_size: dict, sizes: list[int], forks: int) -> dict:
    """A playbook's entry in --out: its measures by size, the fit, the largest size's cost per host over the
    smallest's, and the extrapolation to 100, 1000 and 5000 hosts."""
    fixed, per_host = fit(sizes, [per_size[n]["median_cpu_s"] for n in sizes])
    ratio = per_size[sizes[-1]]["median_cpu_per_host_s"] / per_size[sizes[0]]["median_cpu_per_host_s"]
    return {
        "playbook": " ".join(playbook),
        "by_size": per_size,
        "fit": {"fixed_cpu_s": round(fixed, 2), "per_host_cpu_s": round(per_host, 3)},
        f"per_host_{sizes[-1]}_over_{sizes[0]}": round(ratio, 2),
        "extrapolated": {
            str(n): {
                "cpu_s": round(fixed + per_host * n, 1),
                # the cores that do that CPU in a minute (the hosts' own work and the forks' bound aside)
                "cores_for_one_minute": math.ceil((fixed + per_host * n) / 60),
                # forks hosts at a time: at most `forks` workers (and their ssh) busy at once
                "busy_cores_at_most": forks,
            }
            for n in (100, 1000, 5000)
        },
    }


def print_table(results: dict) -> None:
    """Every playbook's medians by size and its fit, as docs/fleet-scale.md's table."""
    print("| playbook | N | CPU s (median) | CPU s per host | wall s |\n|---|---|---|---|---|")
    for name, r in results["playbooks"].items():
        for n, s in r["by_size"].items():
            print(f"| {name} | {n} | {s['median_cpu_s']} | {s['median_cpu_per_host_s']} | {s['median_wall_s']} |")
        print(f"| {name} | fit | fixed {r['fit']['fixed_cpu_s']} s + {r['fit']['per_host_cpu_s']} s per host | | |")


if __name__ == "__main__":
    sys.exit(main())
