"""End to end on the lab: nodes boot systemd, Ansible reaches them over SSH,
deploy.yml converges and is idempotent, and `lab down` leaves nothing behind.

Check mode on fresh nodes runs on a lab of its own (one node, never deployed), so that this
module does not depend on running before the others, nor its tests on their order."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from support.e2e import (
    LAB_NAME,
    ansible,
    changed_tasks,
    driver_runner,
    lab_gpu_state,
    labmod,
    podman_exec,
    recap,
    refused,
)

pytestmark = pytest.mark.lab


@pytest.fixture(scope="module")
def fresh():
    """A lab of one node that nothing has deployed to: (the lab, its hosts)."""
    the_lab = labmod.Lab(name=f"{LAB_NAME}-fresh")
    labmod.down(the_lab)
    hosts = labmod.up(the_lab, nodes=1, gpus=8, timeout=120)
    yield the_lab, hosts
    labmod.down(the_lab)


def test_nodes_boot_systemd_and_answer_over_ssh(lab):
    """Each node answers over SSH and its systemd finished booting with no unit of its own failed. A server unit
    another module's case left failed (the modules run in random order on these nodes) makes systemd say
    "degraded" without the boot being at fault: those are named, and only they are let through."""
    the_lab, hosts = lab
    assert [h["name"] for h in hosts] == ["lab-node1", "lab-node2"]
    proc = ansible(
        "ansible",
        "sglang_nodes",
        "--one-line",  # host | CHANGED | rc=0 | (stdout) <its lines, newlines written as \\n>
        "-m",
        "ansible.builtin.shell",
        "-a",
        "systemctl is-system-running; systemctl --failed --plain --no-legend | cut -d' ' -f1",
        inventory=the_lab.inventory,
    )
    out = proc.stdout
    lines = {line.split(" | ")[0]: line for line in out.splitlines() if " | " in line}
    assert set(lines) == {"lab-node1", "lab-node2"}, out
    for host, line in lines.items():
        assert " | CHANGED | rc=0 | (stdout) " in line, out
        state, *failed = line.split("(stdout) ", 1)[1].split("\\n")
        failed = [u.strip() for u in failed if u.strip()]
        assert state in ("running", "degraded"), out
        assert all(u.startswith("sglang-") for u in failed), f"{host}: units failed at boot: {failed}\n{out}"
        print(f"{host}: {state}, failed: {failed or 'none'}")


def test_nodes_resolve_each_other_by_hostname(lab):
    """As a fleet's hosts do: a multi-node instance's dist_init_addr names rank 0's host."""
    _, hosts = lab
    for host in hosts:
        other = next(h["name"] for h in hosts if h is not host)
        out = subprocess.run(
            ["podman", "exec", host["container"], "getent", "hosts", other], capture_output=True, text=True
        )
        assert out.returncode == 0 and other in out.stdout, f"{host['name']} cannot resolve {other}: {out.stderr}"


def test_each_node_has_8_simulated_gpus_with_distinct_uuids(lab):
    the_lab, _ = lab
    proc = ansible(
        "ansible",
        "sglang_nodes",
        "-m",
        "ansible.builtin.command",
        "-a",
        "nvidia-smi --query-gpu=uuid --format=csv,noheader",
        inventory=the_lab.inventory,
    )
    uuids = re.findall(r"GPU-[0-9a-f-]{36}", proc.stdout)
    assert len(uuids) == 16
    assert len(set(uuids)) == 16


def test_check_mode_on_fresh_nodes_succeeds_and_changes_nothing(fresh):
    the_lab, hosts = fresh
    proc = ansible("ansible-playbook", "playbooks/deploy.yml", "--check", "--diff", inventory=the_lab.inventory)
    out = recap(proc.stdout)
    assert set(out) == {h["name"] for h in hosts} and all(r["failed"] == 0 for r in out.values()), out
    for h in hosts:
        absent = subprocess.run(["podman", "exec", h["container"], "test", "-e", "/opt/ml-env"], check=False)
        assert absent.returncode == 1, "check mode must not create the virtualenv"
        assert (
            subprocess.run(
                ["podman", "exec", h["container"], "id", "sglang"], check=False, capture_output=True
            ).returncode
            == 1
        )


def test_deploy_converges_then_changes_nothing(lab):
    """The second deploy ends each host after its state check (one task: its record matches); every role run again
    (sglang_deploy_state=false) changes nothing either."""
    the_lab, _ = lab
    first = recap(ansible("ansible-playbook", "playbooks/deploy.yml", inventory=the_lab.inventory).stdout)
    assert set(first) == {"lab-node1", "lab-node2"}
    assert all(r["failed"] == 0 and r["unreachable"] == 0 for r in first.values())
    second = recap(ansible("ansible-playbook", "playbooks/deploy.yml", inventory=the_lab.inventory).stdout)
    assert {h: (r["changed"], r["ok"]) for h, r in second.items()} == {"lab-node1": (0, 1), "lab-node2": (0, 1)}
    every = ansible(
        "ansible-playbook", "playbooks/deploy.yml", "-e", "sglang_deploy_state=false", inventory=the_lab.inventory
    )
    assert {h: r["changed"] for h, r in recap(every.stdout).items()} == {"lab-node1": 0, "lab-node2": 0}
    assert all(r["ok"] > 50 for r in recap(every.stdout).values())
    ansible("ansible-playbook", "playbooks/drift.yml", inventory=the_lab.inventory)  # and recorded: current again


def changed_on(output: str) -> set[tuple[str, str]]:
    """(task, host) of every task that reported a change."""
    out = set()
    for block in re.split(r"^(?=TASK \[|RUNNING HANDLER \[)", output, flags=re.M):
        m = re.match(r"(?:TASK|RUNNING HANDLER) \[([^\]]+)\]", block)
        if m:
            out |= {(m.group(1), host) for host in re.findall(r"^changed: \[([^\]]+)\]", block, re.M)}
    return out


def test_a_file_edited_by_hand_is_drift_check_mode_says_the_same_with_the_digest_or_without_and_deploy_mends_it(
    deployed, tmp_path
):
    """Issue #36: status --drift names what moved (exit 10); deploy --check reports the same changes whether the
    state check ends the unmoved host or every role runs; the deploy mends it and the drift is gone."""
    the_lab, hosts = deployed
    node1 = next(h["container"] for h in hosts if h["name"] == "lab-node1")
    ansible("ansible-playbook", "playbooks/deploy.yml", inventory=the_lab.inventory)  # each host's record written
    launcher = "/usr/local/libexec/sglang-deploy/sglang-launch"
    podman_exec(node1, "sh", "-c", f"echo '# edited by hand' >> {launcher}")
    run = driver_runner(the_lab, tmp_path / "ledger.sqlite3", None)
    code, doc, _ = run("status", "--drift")
    rows = {r["host"]: r for r in doc["rows"]}
    assert code == 10 and rows["lab-node1"]["result"] == "drifted" and rows["lab-node2"]["result"] == "ok", doc
    assert "/usr/local/libexec/sglang-deploy changed since the deploy" in rows["lab-node1"]["detail"], doc
    with_digest = ansible("ansible-playbook", "playbooks/deploy.yml", "--check", "--diff", inventory=the_lab.inventory)
    every_role = ansible(
        "ansible-playbook", "playbooks/deploy.yml", "--check", "--diff", "-e", "sglang_deploy_state=false",
        inventory=the_lab.inventory,
    )  # fmt: skip
    changed = changed_on(with_digest.stdout)
    assert changed == changed_on(every_role.stdout)
    assert changed == {("sglang.deploy.sglang_service : Install the GPU gate and the launcher", "lab-node1")}
    assert recap(with_digest.stdout)["lab-node2"]["ok"] == 1  # ended after its state check
    code, doc, _ = run("status", "--drift")  # check mode set no record aside
    assert code == 10 and [r["host"] for r in doc["rows"] if r["result"] == "ok"] == ["lab-node2"], doc
    ansible("ansible-playbook", "playbooks/deploy.yml", inventory=the_lab.inventory)
    assert "edited by hand" not in podman_exec(node1, "cat", launcher)
    code, doc, _ = run("status", "--drift")
    assert code == 0 and {r["result"] for r in doc["rows"]} == {"ok"}, doc
    # A part of a deploy (--tags) vouches for no whole state: the records set aside, then the next whole deploy's.
    ansible(
        "ansible-playbook", "playbooks/deploy.yml", "--tags", "sglang_service_configure", inventory=the_lab.inventory
    )
    code, doc, _ = run("status", "--drift")
    assert code == 10 and {r["detail"] for r in doc["rows"]} == {"drifted: no record of a complete deploy"}, doc
    ansible("ansible-playbook", "playbooks/deploy.yml", inventory=the_lab.inventory)
    assert run("status", "--drift")[0] == 0


def test_deploy_in_check_mode_changes_nothing(deployed):
    the_lab, _ = deployed
    proc = ansible("ansible-playbook", "playbooks/deploy.yml", "--check", "--diff", inventory=the_lab.inventory)
    out = recap(proc.stdout)
    # Changed here means a module before this one left a node other than as deployed (back_to_deployed).
    assert {h: r["changed"] for h, r in out.items()} == {"lab-node1": 0, "lab-node2": 0}, changed_tasks(proc.stdout)


def test_deploy_fails_clearly_when_the_gpu_count_is_wrong(lab):
    proc = refused(lab[0], "playbooks/deploy.yml", "-e", "gpu_node_expected_gpus=4")
    assert "shows 8 GPU(s) but gpu_node_expected_gpus is 4" in proc.flat


def test_deploy_fails_clearly_when_nvidia_smi_fails(lab):
    the_lab, hosts = lab
    with lab_gpu_state(hosts[1]["container"], ["fail", "driver-mismatch"], ["fail", "none"]):
        proc = refused(the_lab, "playbooks/deploy.yml")
    assert (
        "lab-node2: `nvidia-smi` failed (rc=18): Failed to initialize NVML: Driver/library version mismatch"
        in proc.flat
    )
    assert recap(proc.stdout)["lab-node1"]["failed"] == 0


def test_a_wrong_variable_type_is_refused_by_the_argument_spec(lab):
    proc = refused(lab[0], "playbooks/deploy.yml", "-e", "gpu_node_expected_gpus=eight")
    # The role's argument spec (roles/gpu_node/meta/argument_specs.yml) refuses it before any task of the role runs,
    # naming the variable, what it holds and the type it must be (ansible-core 2.19's words).
    assert (
        "TASK [sglang.deploy.gpu_node : Validating arguments against arg spec 'main' - Base of a GPU node for SGLang servers]"
        in proc.flat
    )
    assert (
        "Validation of arguments failed: argument 'gpu_node_expected_gpus' is of type str and we were unable to "
        "convert to int: \"'eight'\" cannot be converted to an int" in proc.flat
    )
    assert {h: (r["failed"], r["changed"]) for h, r in recap(proc.stdout).items()} == {
        "lab-node1": (1, 0),
        "lab-node2": (1, 0),
    }


def test_lab_down_leaves_no_container_network_or_inventory():
    the_lab = labmod.Lab(name=f"{LAB_NAME}-down")
    labmod.up(the_lab, nodes=1, gpus=2, timeout=120)
    assert the_lab.inventory.exists()
    labmod.down(the_lab)
    assert labmod.lab_containers(the_lab) == []
    assert subprocess.run(["podman", "network", "exists", the_lab.network], check=False).returncode == 1
    assert not the_lab.inventory.exists()
    assert not the_lab.state.exists()
    images = json.loads(
        subprocess.run(["podman", "images", "--format", "json"], capture_output=True, text=True, check=True).stdout
    )
    assert any(labmod.IMAGE in (img.get("Names") or []) for img in images), "the cached image must stay"
    assert not Path("/var/tmp/sglang-deploy-image-build").exists(), "the image build directory must not stay"
