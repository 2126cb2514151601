"""Run by tests/test_status_render.py in a process of its own: the roles' rendering and status's action plugin's,
side by side, each as Ansible runs it (its templar, the collection's filters found by Ansible's collection loader,
which must be installed before anything imports the collection: hence a process of its own, not pytest's).

    python render_probe.py  <- {"own": host variables, "args": the task's args, "answers": {instance: result}}
                            -> {"roles": render.yml's records, "result": the plugin's result, "calls": [module args]}
"""

from __future__ import annotations

import importlib.util
import json
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import yaml

from support import trusted  # tests/ on PYTHONPATH (tests/test_status_render.py), the collections not

REPO = Path(__file__).resolve().parents[2]

SGLANG = REPO / "roles" / "sglang"
SERVICE = REPO / "roles" / "sglang_service"
HOST = "gpu-node-01.example.internal"


def load(path: Path) -> dict:
    return trusted(yaml.safe_load(path.read_text()) or {})


def templar(variables: dict):
    from ansible.parsing.dataloader import DataLoader
    from ansible.template import Templar

    return Templar(loader=DataLoader(), variables=variables)


def set_fact(tasks_file: Path, name: str, variables: dict) -> dict:
    """One set_fact task of a role rendered as Ansible renders it: its own vars lazily, over `variables`."""
    task = next(t for t in yaml.safe_load(tasks_file.read_text()) if t["name"] == name)
    return templar({**variables, **trusted(task.get("vars", {}))}).template(trusted(task["ansible.builtin.set_fact"]))


def service(own: dict) -> dict:
    """sglang_service's task variables on the host: the role's defaults and vars under the host's own."""
    return {
        **load(SERVICE / "defaults" / "main.yml"),
        **load(SERVICE / "vars" / "main.yml"),
        **own,
        "hostvars": {HOST: own},
        "inventory_hostname": HOST,
        "role_path": str(SERVICE),
    }


def roles(own: dict) -> list[dict] | str:
    """render.yml's records after the sglang role's preflight names the generation (identity only)."""
    from ansible.errors import AnsibleError

    # The preflight's task as render.yml includes it: in the sglang role (its files/ first in the search path).
    search = [str(SGLANG), str(SGLANG / "tasks")]
    variables = {
        **load(SGLANG / "defaults" / "main.yml"),
        **service(own),
        "role_path": str(SGLANG),
        "ansible_search_path": search,
    }
    preflight = SGLANG / "tasks" / "preflight.yml"
    names = (
        ()
        if "sglang_software" in own
        else (  # render.yml's include: when sglang_software is not defined
            "Choose the lock and read the patch series",
            "Name the software generation (sglang_software, with its patch manifest)",
            "Add the generation's patch manifest to sglang_software",
        )
    )
    try:
        for name in names:
            variables.update(set_fact(preflight, name, variables))
        render = SERVICE / "tasks" / "render.yml"
        facts = set_fact(render, "Render each instance's record", {**variables, "role_path": str(SERVICE)})
    except AnsibleError as exc:
        return str(exc)
    return facts["_sglang_service_instances"]


def plugin(own: dict, args: dict, answers: dict) -> tuple[dict, list[dict]]:
    from ansible.parsing.dataloader import DataLoader

    spec = importlib.util.spec_from_file_location(
        "sglang_server_action", REPO / "plugins" / "action" / "sglang_server.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    task = SimpleNamespace(args=args, async_val=0, check_mode=False, action="sglang.deploy.sglang_server")
    connection = SimpleNamespace(_shell=SimpleNamespace(tmpdir="/nonexistent"))
    action = mod.ActionModule(task, connection, SimpleNamespace(check_mode=False), DataLoader(), templar({}), None)
    calls = []

    def execute(module_name, module_args, task_vars):
        calls.append({"module": module_name, **module_args})
        name = (module_args.get("instance") or {}).get("name", "?")
        if (answers.get(name) or {}).get("raise"):  # the connection failing as Ansible's ssh plugin fails it
            from ansible.errors import AnsibleConnectionFailure

            raise AnsibleConnectionFailure(answers[name]["raise"])
        return answers.get(name) or {"changed": False, "outcome": "status", "instance": name, "msg": f"{name}: active"}

    action._execute_module = execute
    return action.run(task_vars=service(own)), calls


def main() -> None:
    from ansible.plugins.loader import init_plugin_loader

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        init_plugin_loader([str(REPO / "collections")])
    ask = json.loads(sys.stdin.read())
    own = trusted(ask["own"])
    result, calls = plugin(own, ask["args"], ask.get("answers") or {})
    json.dump({"roles": roles(own), "result": result, "calls": calls}, sys.stdout, default=str)


if __name__ == "__main__":
    main()
