"""The boot guard as its callers read it (issue #31: the behaviours behind the mutants the unit suite let survive in
sglang_deploy/boot.py; tests/test_boot_guard.py runs the installed guard in its own process, which mutmut does not
reach).

check's verdict and what the journal is told (the generation on disk, named); the put-back count verify reads
(put_backs: each refused start counted, with the generation put back); the restart's mark; the modes of what the
guard leaves under /run (directories 0700, files 0600, whatever the umask); a bad instance name refused, never
joined into a path.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import boot, known_good
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.instance import kg_dir

GOOD = {"unit": "[Service]\nExecStart=/venv-good/bin/python -m sglang.launch_server\n", "env": 'P="good"\n'}
NEW = {"unit": "[Service]\nExecStart=/venv-new/bin/python -m sglang.launch_server\n", "env": 'P="new"\n'}


pytestmark = pytest.mark.usefixtures("usual_umask")


@pytest.fixture
def host(tmp_path) -> dict:
    """One instance's files, its state directory and the guard's run directories (never this machine's /run)."""
    files = {"unit": tmp_path / "systemd" / "sglang-m.service", "env": tmp_path / "etc" / "m.env"}
    for p in files.values():
        p.parent.mkdir(parents=True)
    return {
        "files": files,
        "state": str(tmp_path / "state"),
        "unverified": str(tmp_path / "run" / "unverified"),
        "put_back": str(tmp_path / "run" / "put-back"),
        "reloads": [],
    }


def write(host, contents) -> None:
    for k, p in host["files"].items():
        p.write_text(contents[k])


def record(host, contents) -> dict:
    """A known-good generation of these contents, as the restart records it."""
    gens = Path(kg_dir(host["state"], "m"), "generations")
    gens.mkdir(parents=True, exist_ok=True)
    as_files = {str(host["files"][k]): contents[k] for k in host["files"]}
    rec = {"argv": [], "files": as_files, "profile": "p", "config_hash": known_good.content_hash(as_files)}
    rec["generation"] = f"{len(list(gens.iterdir())) + 1:06d}-x-{rec['config_hash']}"
    (gens / f"{rec['generation']}.json").write_text(json.dumps(rec))
    return rec


def check(host) -> tuple[int, str]:
    return boot.check(
        "m",
        host["state"],
        lambda: host["reloads"].append(1),
        directory=host["unverified"],
        put_back_dir=host["put_back"],
    )


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_the_known_good_configuration_starts_and_the_journal_names_its_generation(host):
    write(host, GOOD)
    rec = record(host, GOOD)
    assert check(host) == (boot.GO, f"m: the configuration on disk is known-good generation {rec['generation']}")
    assert host["reloads"] == [] and not os.path.exists(host["put_back"])


def test_each_refused_start_is_counted_with_the_generation_put_back_in_a_private_marker(host):
    """verify counts the restarts the guard caused as no crash: every one of them, the count read back each time."""
    write(host, GOOD)
    rec = record(host, GOOD)
    for n in (1, 2):
        write(host, NEW)  # a restart cut short again
        code, said = check(host)
        assert code == boot.PUT_BACK and f"known-good generation {rec['generation']} put back" in said
        assert {k: p.read_text() for k, p in host["files"].items()} == GOOD
        assert boot.put_backs("m", host["put_back"]) == {"count": n, "generation": rec["generation"]}
    assert host["reloads"] == [1, 1]
    marker = boot.marker("m", host["put_back"])
    assert json.loads(Path(marker).read_text()) == {"count": 2, "generation": rec["generation"]}
    assert mode(host["put_back"]) == 0o700 and mode(marker) == 0o600


def test_a_restarts_mark_is_private_and_lets_the_start_go(host):
    write(host, GOOD)
    record(host, GOOD)
    write(host, NEW)
    boot.mark("m", host["unverified"])
    marker = boot.marker("m", host["unverified"])
    assert Path(marker).read_text() == f"{os.getpid()}\n"
    assert mode(host["unverified"]) == 0o700 and mode(marker) == 0o600
    assert check(host) == (boot.GO, "m: a restart is verifying the configuration on disk: it starts")
    boot.unmark("m", host["unverified"])
    assert check(host)[0] == boot.PUT_BACK


def test_a_mark_already_there_is_rewritten_with_this_restarts_pid(host):
    os.makedirs(host["unverified"], mode=0o700)
    Path(boot.marker("m", host["unverified"])).write_text("12345678\nold\n")
    boot.mark("m", host["unverified"])
    assert Path(boot.marker("m", host["unverified"])).read_text() == f"{os.getpid()}\n"


@pytest.mark.parametrize("name", ["../etc", "M", "a/b", ""])
def test_a_bad_instance_name_is_refused_in_words_not_joined_into_a_path(name, tmp_path):
    with pytest.raises(ValueError) as e:
        boot.marker(name, str(tmp_path))
    assert str(e.value) == f"instance name {name!r}: lowercase letters, digits, '-' and '_' only"
    assert boot.put_backs(name, str(tmp_path)) == {"count": 0}
