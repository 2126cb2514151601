"""The rollout's gateways (sglang_deploy.rollout.rollout_routers, the sglang_rollout_routers filter): every host of
sglang_routers as the first of them reaches it, as playbooks/vars/rollout.yml derives sglang_rollout_routers
(tests/test_router_impl.py renders it through Ansible)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import pytest
import yaml
from ansible.errors import AnsibleFilterError

from ansible_collections.sglang.deploy.plugins.filter.sglang_config import FilterModule
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.rollout import rollout_routers
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.worker_urls import worker_url

REPO = Path(__file__).resolve().parents[1]
DEFAULTS = yaml.safe_load((REPO / "roles" / "sglang_router" / "defaults" / "main.yml").read_text())


def urls(host_vars: dict, key="") -> list[tuple[str, str]]:
    """(url, metrics_url) of each gateway of `host_vars` (its order the group's), with the role's defaults."""
    return [(g["url"], g["metrics_url"]) for g in rollout_routers(list(host_vars), host_vars, DEFAULTS, key)]


def listening(host: str, prometheus: str | None = None, **more) -> dict:
    return {"sglang_router_host": host, "sglang_router_prometheus_host": prometheus or host, **more}


def test_one_address_is_reached_there_from_anywhere_an_ipv6_one_in_brackets():
    got = urls({"r1": listening("10.0.0.1", "fd00::1"), "r2": listening("fd00::2", "10.0.0.2")})
    assert got == [
        ("http://10.0.0.1:30000", "http://[fd00::1]:29000"),
        ("http://[fd00::2]:30000", "http://10.0.0.2:29000"),
    ]


def test_every_address_is_the_first_routers_own_loopback_of_that_family():
    assert urls({"r1": listening("0.0.0.0", "::")}) == [("http://127.0.0.1:30000", "http://[::1]:29000")]
    assert urls({"r1": listening("::", "0.0.0.0")}) == [("http://[::1]:30000", "http://127.0.0.1:29000")]


def test_every_address_on_another_router_is_its_sglang_router_address_else_its_inventory_name():
    got = urls(
        {
            "r1": {},
            "r2": listening("0.0.0.0", "::", sglang_router_address="fd00::2"),
            "r3": listening("::", "0.0.0.0", sglang_router_address="10.0.0.3"),
            "r4": {"ansible_host": "127.0.0.1"},  # the controller's way in (a tunnel): not how r1 reaches r4
        }
    )
    assert got == [
        ("http://127.0.0.1:30000", "http://127.0.0.1:29000"),
        ("http://[fd00::2]:30000", "http://[fd00::2]:29000"),
        ("http://10.0.0.3:30000", "http://10.0.0.3:29000"),
        ("http://r4:30000", "http://r4:29000"),
    ]


def test_an_address_is_bracketed_by_the_worker_urls_one_rule():
    # an address written with its brackets, or with white space, gets them once: sglang_worker_url's rule
    got = urls({"r1": {}, "r2": {"sglang_router_address": " [fd00::2] "}})
    assert (
        got[1]
        == (worker_url("fd00::2", 30000), worker_url("fd00::2", 29000))
        == (
            "http://[fd00::2]:30000",
            "http://[fd00::2]:29000",
        )
    )


def test_a_hosts_own_settings_win_over_the_roles_defaults():
    own = {
        "sglang_router_impl": "sglang-router",
        "sglang_router_port": "30200",  # a port as a string, as an inventory may give it
        "sglang_router_prometheus_port": 29200,
        "sglang_router_discovery": "file",
        "sglang_router_discovery_file": "/srv/workers.json",
    }
    first, other = rollout_routers(["r1", "r2"], {"r1": own, "r2": {}}, DEFAULTS)
    assert first == {
        "name": "r1",
        "impl": "sglang-router",
        "url": "http://127.0.0.1:30200",
        "metrics_url": "http://127.0.0.1:29200",
        "api_key": "",
        "discovery_file": "/srv/workers.json",
    }
    assert other == {
        "name": "r2",
        "impl": DEFAULTS["sglang_router_impl"],
        "url": f"http://r2:{DEFAULTS['sglang_router_port']}",
        "metrics_url": f"http://r2:{DEFAULTS['sglang_router_prometheus_port']}",
        "api_key": "",
        "discovery_file": None,
    }


def test_the_key_is_the_hosts_else_the_services():
    host_vars = {"r1": {"sglang_router_api_key": "k1"}, "r2": {"sglang_router_api_key": ""}, "r3": {}}
    assert [g["api_key"] for g in rollout_routers(list(host_vars), host_vars, DEFAULTS, "fleet")] == [
        "k1",
        "fleet",
        "fleet",
    ]
    assert [g["api_key"] for g in rollout_routers(list(host_vars), host_vars, DEFAULTS)] == ["k1", "", ""]


@pytest.mark.parametrize(("mode", "file"), [("file", "/srv/w.json"), ("api", None), (None, None)])
def test_the_discovery_file_only_in_file_mode(mode, file):
    own = {"sglang_router_discovery_file": "/srv/w.json", **({"sglang_router_discovery": mode} if mode else {})}
    (gateway,) = rollout_routers(["r1"], {"r1": own}, DEFAULTS)
    assert gateway["discovery_file"] == file
    assert DEFAULTS["sglang_router_discovery"] == "api"  # the role's default: no file


def test_no_routers_no_gateways():
    assert rollout_routers([], {}, DEFAULTS) == rollout_routers(None, {}, DEFAULTS) == []


class Lazy(Mapping):
    """A host's variables as Ansible's hostvars gives them: each templated when read (here: refused when read)."""

    def __init__(self, data: dict, refused: set):
        self.data, self.refused = data, refused

    def __getitem__(self, key):
        if key in self.refused:
            raise AssertionError(f"{key} read")
        return self.data[key]

    def __iter__(self):
        return iter(self.data)

    def __len__(self):
        return len(self.data)


def test_only_what_a_gateway_needs_is_read_of_its_hosts_variables():
    # the first router, or one listening on one address, has its sglang_router_address unread
    own = {"sglang_router_address": "{{ undefined }}"}
    host_vars = {"r1": Lazy(own, set(own)), "r2": Lazy({**own, **listening("10.0.0.2")}, set(own))}
    assert urls(host_vars) == [
        ("http://127.0.0.1:30000", "http://127.0.0.1:29000"),
        ("http://10.0.0.2:30000", "http://10.0.0.2:29000"),
    ]


def test_a_port_that_is_not_a_whole_number_reaches_the_play_naming_its_gateway():
    host_vars = {"r1": {}, "r2": {"sglang_router_port": "30k"}}
    with pytest.raises(AnsibleFilterError, match=r"^sglang_routers host r2: "):
        FilterModule().filters()["sglang_rollout_routers"](["r1", "r2"], host_vars, DEFAULTS)


def test_the_filter_is_the_function():
    host_vars = {"r1": {}, "r2": {"sglang_router_address": "fd00::2"}}
    f = FilterModule().filters()["sglang_rollout_routers"]
    want = rollout_routers(["r1", "r2"], host_vars, DEFAULTS, "k")
    assert (
        f(["r1", "r2"], host_vars, DEFAULTS, "k") == f(["r1", "r2"], host_vars, DEFAULTS, service_api_key="k") == want
    )
