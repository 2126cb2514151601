"""The crash evidence bundle on lab nodes, through the driver (issue #13).

A restart whose server hangs, and one whose server dies on its first decode (the seed's), each leave
one tar.gz for the run on the controller, named in the --json result and the ledger: per host, the
bundle the host took before the rollback. The hang's holds a py-spy dump of every rank showing where
it hangs; the crash's holds the traceback. No secret (the instance's API key) in either.

lab-node2's `main` (8 GPUs) is verified first, then restarted with the faults; at the end the node is
put back as deployed, never verified (back_to_deployed: main stopped, no known-good record, no secrets
file, its configuration rendered again from group_vars), and its evidence removed.
"""

from __future__ import annotations

import json
import sqlite3

import pytest

from support.e2e import back_to_deployed, driver_runner, members, podman_exec

pytestmark = pytest.mark.lab

NODE = "lab-node2"
SECRET = "sk-evidence-e2e-7c1d2e9f"
GPUS = 8


def instance(**env: str) -> str:
    main = {"name": "main", "port": 30000, "gpus": list(range(GPUS)), "env": env}
    return json.dumps({"sglang_instances": [main], "sglang_service_api_key": SECRET})


@pytest.fixture(scope="module")
def verified(deployed, tmp_path_factory):
    the_lab, hosts = deployed
    node = next(h["container"] for h in hosts if h["name"] == NODE)
    ledger = tmp_path_factory.mktemp("ledger") / "ledger.sqlite3"
    run = driver_runner(the_lab, ledger, NODE)
    code, doc, proc = run("restart", "-e", instance())
    assert code == 0, (proc.stdout + proc.stderr)[-3000:]
    assert doc["evidence"] is None  # nothing failed: no bundle
    yield run, ledger
    podman_exec(node, "rm", "-rf", "/var/lib/sglang/evidence/main")
    back_to_deployed(the_lab, node, NODE)  # the API key's secrets file and the 8-GPU unit too


def failed_restart(verified, **env: str) -> tuple[dict, dict[str, bytes]]:
    run, ledger = verified
    # 20 s to ready: the rollback's start shares it, and SGLang's parser takes seconds on a busy machine.
    code, doc, proc = run("restart", "-e", instance(**env), "-e", "sglang_service_ready_timeout=20")
    assert code == 5, (proc.stdout + proc.stderr)[-3000:]  # rolled back, serving
    path = doc["evidence"]
    assert path and path.endswith(f"evidence-{doc['run_id']}.tar.gz")
    db = sqlite3.connect(ledger)
    (recorded,) = db.execute("SELECT evidence_path FROM runs WHERE id = ?", (doc["run_id"],)).fetchone()
    db.close()
    assert recorded == path
    files = members(path)
    for name, data in files.items():
        assert SECRET.encode() not in data, f"the API key is in {name}"
    return doc, files


def test_a_hang_leaves_a_py_spy_dump_of_every_rank_where_it_hangs(verified):
    _, files = failed_restart(verified, LAB_STANDIN_FAULT="hang")
    dumps = {n: d.decode() for n, d in files.items() if n.startswith(f"{NODE}/") and "/py-spy/" in n}
    ranks = [d for d in dumps.values() if "hang_in_cuda_graph_capture" in d]
    assert len(ranks) == GPUS, sorted(dumps)
    assert any("wait_for_schedulers_ready" in d for d in dumps.values()), "the launcher's frame"
    journal = next(d.decode() for n, d in files.items() if n.startswith(f"{NODE}/") and n.endswith("journal.txt"))
    assert "Capture cuda graph begin" in journal


def test_a_crash_on_the_first_decode_leaves_its_traceback(verified):
    _, files = failed_restart(verified, LAB_STANDIN_FAULT="crash-first-decode")
    cause = "AttributeError: 'EAGLEWorkerV2' object has no attribute 'adaptive_controller'"
    tb = next(d.decode() for n, d in files.items() if n.startswith(f"{NODE}/") and n.endswith("traceback.txt"))
    assert cause in tb
    failure = json.loads(next(d for n, d in files.items() if n.startswith(f"{NODE}/") and n.endswith("failure.json")))
    assert cause in json.dumps(failure)
    unit = next(d.decode() for n, d in files.items() if n.startswith(f"{NODE}/") and n.endswith("sglang-main.service"))
    assert "sglang-launch" in unit
