"""Secrets stay out of the ledger (driver/redact.py) and the ledger is private (driver/ledger.py): -e values of
declared secret variables and of any key naming a secret (plugins/module_utils/sglang_deploy/secret_rule.py, the one rule)
are redacted in the recorded argv, found by the driver's own parser whatever their spelling, and scrubbed from the
recorded event stream, the terminal and --json in every form a log carries them; the database is 0600, its
directory and the run directories 0700."""

from __future__ import annotations

import base64
import json
import os
import shlex
import stat
import sys
import urllib.parse
from types import SimpleNamespace

import pytest

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import secret_rule
from driver import cli, commands, events, ledger, redact

M = secret_rule.MASK

SECRETS = ("hf_SECRETVALUE1", "sk-SECRETVALUE2", "tok_SECRETVALUE3", "SECRETVALUE4")


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_run_with_secrets_in_extra_vars_records_none_and_its_files_are_private(
    held_inventory, ledger_path, ledger_rows, driver
):
    """A real run (ansible-runner, ansible-playbook, events) whose -e carry secrets in every form."""
    held_inventory.release.touch()  # the host's module calls fail at once
    proc = driver(
        "status",
        "-i",
        str(held_inventory.inventory),
        "--json",
        "-e",
        json.dumps({"sglang_service_secret_env": {"HF_TOKEN": SECRETS[0]}}),
        "-e",
        f"sglang_service_api_key={SECRETS[1]} sglang_service_verify_max_new_tokens=16",
        "-e",
        json.dumps(
            {"sglang_instances": [{"name": "main", "port": 30000, "gpus": [0], "env": {"HF_TOKEN": SECRETS[2]}}]}
        ),
        f"--extra-vars={{db_password: {SECRETS[3]}}}",
    )
    doc = json.loads(proc.stdout)  # --json: one document on stdout, nothing else
    assert doc["command"] == "status" and doc["run_id"] == 1, proc.stderr[-2000:]
    recorded = [ledger_path, *sorted((ledger_path.parent / "runs").rglob("*"))]
    for path in recorded:
        if path.is_file():
            data = path.read_bytes()
            for secret in SECRETS:
                assert secret.encode() not in data, f"{secret} in {path}"
    (row,) = ledger_rows(ledger_path)
    argv = json.loads(row["argv"])
    assert argv[argv.index("-e") + 1] == json.dumps({"sglang_service_secret_env": M})
    assert f"sglang_service_api_key={M} sglang_service_verify_max_new_tokens=16" in argv
    assert f'"env": {{"HF_TOKEN": "{M}"}}' in " ".join(argv) and '"gpus": [0]' in " ".join(argv)
    assert f'--extra-vars={{"db_password": "{M}"}}' in argv
    run_dir = ledger_path.parent / "runs" / "1"
    assert (run_dir / "events.jsonl").stat().st_size > 0, "the stream was recorded (scrubbed)"
    # Its last line is the driver's own: how the run ended and the exit code given (a replay checks its mapping).
    last = json.loads((run_dir / "events.jsonl").read_text().splitlines()[-1])
    assert last == {
        "event": events.RESULT,
        "runner_status": "failed",
        "rc": last["rc"],
        "interrupted": False,
        "exit_code": proc.returncode,
    }
    assert last["rc"] != 0 and proc.returncode == doc["exit_code"] != 0
    assert mode(ledger_path) == 0o600 and mode(ledger_path.parent) == 0o700
    assert mode(ledger_path.parent / "runs") == 0o700 and mode(run_dir) == 0o700
    assert mode(run_dir / "events.jsonl") == 0o600


def test_modes_an_older_driver_left_are_narrowed(tmp_path, monkeypatch):
    monkeypatch.delenv("SGLANG_DEPLOY_LEDGER", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    home = tmp_path / "sglang-deploy"
    (home / "runs" / "7").mkdir(parents=True)
    (home / "ledger.sqlite3").touch()
    (home / "runs" / "7" / "events.jsonl").touch()
    for path, old in [(home, 0o755), (home / "runs", 0o755), (home / "runs" / "7", 0o755)]:
        os.chmod(path, old)
    os.chmod(home / "ledger.sqlite3", 0o644)
    os.chmod(home / "runs" / "7" / "events.jsonl", 0o644)
    ledger.Ledger().close()
    assert mode(home) == mode(home / "runs") == mode(home / "runs" / "7") == 0o700
    assert mode(home / "ledger.sqlite3") == mode(home / "runs" / "7" / "events.jsonl") == 0o600


def test_a_directory_the_user_named_is_left_as_it_is_but_the_ledger_in_it_is_private(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o755)
    book = ledger.Ledger(shared / "ledger.sqlite3")
    run_dir = book.events_dir(book.start("status", [], None, None))
    book.close()
    assert mode(shared) == 0o755, "not the ledger's to narrow (it may be /tmp or a home directory)"
    assert mode(shared / "ledger.sqlite3") == 0o600 and mode(shared / "runs") == mode(run_dir) == 0o700


@pytest.mark.parametrize(
    "argv,recorded",
    [
        (["-e", "sglang_service_api_key=abcd1234"], ["-e", f"sglang_service_api_key={M}"]),
        (["-e", "HF_TOKEN='a b c' x=1"], ["-e", f"HF_TOKEN={M} x=1"]),
        (
            ["-e", 'sglang_service_secret_env={"HF_TOKEN": "hf_1234"}'],  # Ansible splits it at the space too
            ["-e", f"sglang_service_secret_env={M} {M}"],
        ),
        (['-e{"sglang_service_secret_env": {"K": "v1234"}}'], [f'-e{{"sglang_service_secret_env": "{M}"}}']),
        (["--extra-vars", "{api_key: k1234, n: 2}"], ["--extra-vars", f'{{"api_key": "{M}", "n": 2}}']),
        (["--extra", "db_passwd=p1234"], ["--extra", f"db_passwd={M}"]),
        (["-e", "@secrets.yml", "-e@vars/prod.yml"], ["-e", "@secrets.yml", "-e@vars/prod.yml"]),
        (
            ["-e", "sglang_profile=eagle3_topk1 max_new_tokens=16"],
            ["-e", "sglang_profile=eagle3_topk1 max_new_tokens=16"],
        ),
        (["-e", "{unparsable: [ my_token"], ["-e", M]),
        (["-e", "{unparsable: [ x"], ["-e", M]),  # no name can be read in it to say it holds no secret
        (["--profile", "p", "-i", "inventory/prod"], ["--profile", "p", "-i", "inventory/prod"]),
        (["-e", "api_key_file=/etc/k DB_PASS=hunter22"], ["-e", f"api_key_file=/etc/k DB_PASS={M}"]),
        # Ansible's parse_kv reads these as words (a variable _raw_params), not key=value, and still takes them.
        (["-e", "hf_token = v1234567"], ["-e", M]),
        (["-e", "hf_token: v1234567"], ["-e", M]),
        (["-e", "x=1 hf_token: v1234567"], ["-e", f"x=1 {M}"]),
        (["-e", "hf_token\\=v1234567"], ["-e", M]),
        (["-e", "---\nhf_token: v1234567"], ["-e", M]),
        (["-e", "k=v k2=v2"], ["-e", "k=v k2=v2"]),
        (["-e", "just some words"], ["-e", "just some words"]),
    ],
)
def test_extra_vars_are_redacted_in_every_form(argv, recorded):
    assert redact.Redactor().argv(["status", *argv]) == ["status", *recorded]


@pytest.mark.parametrize(
    "text", ["hf_token = v1234567", "hf_token: v1234567", "hf_token\\=v1234567", "x=1 hf_token: v1234567"]
)
def test_a_secret_ansible_reads_as_words_is_kept_to_be_scrubbed(text):
    """Ansible takes these -e (parse_kv: the variable _raw_params): the value is scrubbed from the events too."""
    from ansible.parsing.splitter import parse_kv

    assert "_raw_params" in parse_kv(text), "Ansible's own reading of it"
    r = redact.Redactor()
    r.argv(["status", "-e", text])
    assert r.secrets == {"v1234567"}
    assert r.scrub({"msg": "token v1234567"}) == {"msg": f"token {M}"}


@pytest.mark.parametrize("suffix", ["yml", "json"])
def test_an_extra_vars_file_is_read_with_ansibles_loader_and_its_secrets_scrubbed(tmp_path, suffix):
    """-e @file: the path stays in the recorded argv, the file's secret-named values (at any depth, declared
    no_log or named so) are remembered, to be scrubbed from the events, the terminal and --json."""
    doc = {"sglang_service_secret_env": {"HF_TOKEN": "hf_FILESECRET1"}, "db": {"password": "FILESECRET2"}, "n": 3}
    path = tmp_path / f"vars.{suffix}"
    path.write_text(json.dumps(doc) if suffix == "json" else "---\n" + json.dumps(doc).replace('"', ""))
    r = redact.Redactor()
    assert r.argv(["status", "-e", f"@{path}", f"-e@{path}"]) == ["status", "-e", f"@{path}", f"-e@{path}"]
    assert r.secrets == {"hf_FILESECRET1", "FILESECRET2"}
    event = {"res": {"msg": "HF_TOKEN=hf_FILESECRET1 p=" + json.dumps("FILESECRET2")}}
    assert "FILESECRET" not in json.dumps(r.scrub(event))


def test_an_unreadable_extra_vars_file_stays_a_path(tmp_path):
    r = redact.Redactor()
    assert r.argv(["status", "-e", f"@{tmp_path}/missing.json"]) == ["status", "-e", f"@{tmp_path}/missing.json"]
    assert r.secrets == set()


def test_an_extra_vars_file_secret_reaches_no_record_and_no_output(tmp_path, ledger_path, monkeypatch, capsys):
    """python -m driver status -e @file --json, its playbook (ansible-runner, faked) echoing the file's secret:
    the recorded stream, --json and the terminal hold none of it."""
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(
        "all:\n  children:\n    sglang_nodes:\n      hosts:\n        n1: {ansible_connection: local}\n"
    )
    secrets = tmp_path / "secrets.yml"
    secrets.write_text(f"sglang_service_api_key: {json.dumps(ODD)}\n")

    def fake_run(**kwargs):
        res = {"failed": True, "msg": f"ServerArgs(api_key={ODD!r})", "failure": {"journal_tail": escaped_lines(ODD)}}
        kwargs["event_handler"]({"event": "verbose", "stdout": f"fatal: api_key={ODD!r}"})
        kwargs["event_handler"](
            {"event": "runner_on_failed", "event_data": {"host": "n1", "task": "t", "task_action": "x", "res": res}}
        )
        return SimpleNamespace(status="failed", rc=2)

    monkeypatch.setitem(sys.modules, "ansible_runner", SimpleNamespace(run=fake_run))
    code = cli.main(["status", "-i", str(inventory), "--json", "-e", f"@{secrets}"])
    out, err = capsys.readouterr()
    assert code != 0 and json.loads(out)["run_id"] == 1
    stream = (ledger_path.parent / "runs" / "1" / "events.jsonl").read_text()
    assert M in stream, "the events were recorded, scrubbed"
    for where, text in {"events": stream, "stdout": out, "stderr": err}.items():
        assert "Zq9" not in text and base64.b64encode(ODD.encode()).decode() not in text, where


# Every spelling argparse accepts for -e (#30: `-ve KEY=SECRET` was stored in plaintext), found by the driver's
# own parser (driver/cli.py): clustered short options, an attached value, '=', abbreviations, after other options.
SPELLINGS = [
    ["-ve", "api_key=k1234567"],
    ["-veapi_key=k1234567"],
    ["-vvve", "api_key=k1234567"],
    ["-vvveapi_key=k1234567"],
    ["-eapi_key=k1234567"],
    ["-e=api_key=k1234567"],
    ["--extra-vars=api_key=k1234567"],
    ["--extra-vars", "api_key=k1234567"],
    ["--ex=api_key=k1234567"],
    ["--extra-v", "api_key=k1234567"],
    ["--json", "-v", "-e", "api_key=k1234567", "--check"],
]


@pytest.mark.parametrize("spelling", SPELLINGS, ids=" ".join)
def test_every_spelling_of_extra_vars_the_parser_accepts_is_redacted(spelling):
    argv = ["restart", "--limit", "n1", *spelling]
    assert commands.parser().parse_args(argv).extra_vars == ["api_key=k1234567"], "the parser reads it as -e"
    r = redact.Redactor()
    recorded = r.argv(argv)
    assert "k1234567" not in json.dumps(recorded) and M in " ".join(recorded)
    assert len(recorded) == len(argv) and recorded[:3] == ["restart", "--limit", "n1"]
    assert r.secrets == {"k1234567"}, "kept, to be scrubbed from the event stream"


def test_a_value_that_looks_like_an_option_is_still_found():
    """argparse hands -e a value that starts with a dash when it is attached: the recorded one is redacted."""
    argv = ["status", "--extra-vars=-x api_key=k1234567"]
    assert commands.parser().parse_args(argv).extra_vars == ["-x api_key=k1234567"]
    assert "k1234567" not in " ".join(redact.Redactor().argv(argv))


# A secret as hostile as they get: a backslash, both quotes, $, %, a newline, regex metacharacters.
ODD = "Zq9\\k'e\"y$H%h\nW.*+?[(|"


def escaped_lines(value: str) -> list[str]:
    """What a module's result or a task's output carries of a value: as is, as SGLang logs it (a repr), as JSON,
    a repr inside JSON, URL-quoted, shell-quoted, base64."""
    line = f"server_args=ServerArgs(api_key={value!r})"
    return [
        f"key {value}",
        line,
        json.dumps({"api_key": value}),
        json.dumps([line]),
        "http://h/?k=" + urllib.parse.quote(value, safe=""),
        "sh -c " + shlex.quote(value),
        "b64 " + base64.b64encode(value.encode()).decode(),
    ]


def test_the_event_stream_is_scrubbed_of_every_redacted_value():
    r = redact.Redactor()
    r.argv(["status", "-e", json.dumps({"sglang_service_secret_env": {"HF_TOKEN": "hf_abcdef", "N": 1}})])
    event = {"event_data": {"res": {"msg": ["HF_TOKEN=hf_abcdef failed"], "rc": 1}}, "counter": 3}
    assert r.scrub(event) == {"event_data": {"res": {"msg": [f"HF_TOKEN={M} failed"], "rc": 1}}, "counter": 3}


def test_the_event_stream_is_scrubbed_of_a_secret_in_every_form_a_log_carries_it():
    """#30: SGLang logs ServerArgs(api_key='a\\\\b'), a repr: the literal value alone is not what the event holds."""
    r = redact.Redactor()
    r.argv(["status", "-e", json.dumps({"sglang_service_api_key": ODD})])
    assert r.secrets == {ODD}
    lines = escaped_lines(ODD)
    event = {"event_data": {"res": {"failure": {"journal_tail": lines}}}}
    out = r.scrub(event)["event_data"]["res"]["failure"]["journal_tail"]
    for before, after in zip(lines, out, strict=True):
        assert "Zq9" not in after and base64.b64encode(ODD.encode()).decode() not in after, (before, after)
        assert M in after


def test_a_clustered_extra_vars_secret_reaches_no_record_and_no_output(
    tmp_path, ledger_path, ledger_rows, monkeypatch, capsys
):
    """python -m driver status -ve '{"sglang_service_api_key": ODD}' --json, its playbook (ansible-runner, faked)
    reporting the key as SGLang logs it: the ledger's argv, the recorded stream and --json hold no trace of it."""
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(
        "all:\n  children:\n    sglang_nodes:\n      hosts:\n        n1: {ansible_connection: local}\n"
    )
    res = {"failed": True, "msg": f"ServerArgs(api_key={ODD!r})", "failure": {"journal_tail": escaped_lines(ODD)}}
    data = {"host": "n1", "task": "Run the action on each instance", "resolved_action": "sglang_server", "res": res}

    def fake_run(**kwargs):
        handler = kwargs["event_handler"]
        handler({"event": "verbose", "stdout": f"fatal: api_key={ODD!r}"})
        handler({"event": "runner_on_failed", "event_data": {**data, "task_action": "sglang_server"}})
        return SimpleNamespace(status="failed", rc=2)

    monkeypatch.setitem(sys.modules, "ansible_runner", SimpleNamespace(run=fake_run))
    secret = json.dumps({"sglang_service_api_key": ODD})
    code = cli.main(["status", "-i", str(inventory), "--json", "-ve", secret])
    out, err = capsys.readouterr()
    assert code != 0 and json.loads(out)["run_id"] == 1
    (row,) = ledger_rows(ledger_path)
    assert json.loads(row["argv"])[-2:] == ["-ve", json.dumps({"sglang_service_api_key": M})]
    stream = (ledger_path.parent / "runs" / "1" / "events.jsonl").read_text()
    assert M in stream, "the events were recorded, scrubbed"
    places = {
        "ledger": ledger_path.read_bytes().decode(errors="replace"),
        "events": stream,
        "stdout": out,
        "stderr": err,
    }
    for where, text in places.items():  # every form the fake logged keeps "Zq9", but base64
        assert "Zq9" not in text and base64.b64encode(ODD.encode()).decode() not in text, where


def test_declared_no_log_variables_are_secret_whatever_their_name(monkeypatch):
    assert "sglang_service_api_key" in redact.declared()  # no_log: true in roles/sglang_service/meta/argument_specs.yml
    monkeypatch.setattr(redact, "declared", lambda: frozenset({"innocent_name"}))
    assert redact.is_secret("innocent_name") and not redact.is_secret("innocent_other")
