"""Secrets stay out of the ledger (driver/redact.py) and the ledger is private (driver/ledger.py): -e values of
declared secret variables and of any key naming a secret are redacted in the recorded argv and scrubbed from
the recorded event stream; the database is 0600, its directory and the run directories 0700."""

from __future__ import annotations

import json
import os
import stat

import pytest

from driver import events, ledger, redact

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
    assert argv[argv.index("-e") + 1] == json.dumps({"sglang_service_secret_env": "<redacted>"})
    assert "sglang_service_api_key=<redacted> sglang_service_verify_max_new_tokens=16" in argv
    assert '"env": {"HF_TOKEN": "<redacted>"}' in " ".join(argv) and '"gpus": [0]' in " ".join(argv)
    assert '--extra-vars={"db_password": "<redacted>"}' in argv
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
        (["-e", "sglang_service_api_key=abcd1234"], ["-e", "sglang_service_api_key=<redacted>"]),
        (["-e", "HF_TOKEN='a b c' x=1"], ["-e", "HF_TOKEN=<redacted> x=1"]),
        (
            ["-e", 'sglang_service_secret_env={"HF_TOKEN": "hf_1234"}'],  # Ansible splits it at the space too
            ["-e", "sglang_service_secret_env=<redacted> <redacted>"],
        ),
        (['-e{"sglang_service_secret_env": {"K": "v1234"}}'], ['-e{"sglang_service_secret_env": "<redacted>"}']),
        (["--extra-vars", "{api_key: k1234, n: 2}"], ["--extra-vars", '{"api_key": "<redacted>", "n": 2}']),
        (["--extra", "db_passwd=p1234"], ["--extra", "db_passwd=<redacted>"]),
        (["-e", "@secrets.yml", "-e@vars/prod.yml"], ["-e", "@secrets.yml", "-e@vars/prod.yml"]),
        (
            ["-e", "sglang_profile=eagle3_topk1 max_new_tokens=16"],
            ["-e", "sglang_profile=eagle3_topk1 max_new_tokens=16"],
        ),
        (["-e", "{unparsable: [ my_token"], ["-e", "<redacted>"]),
        (["--profile", "p", "-i", "inventory/prod"], ["--profile", "p", "-i", "inventory/prod"]),
    ],
)
def test_extra_vars_are_redacted_in_every_form(argv, recorded):
    assert redact.Redactor().argv(argv) == recorded


def test_declared_no_log_variables_are_secret_whatever_their_name(monkeypatch):
    assert "sglang_service_api_key" in redact.declared()  # no_log: true in roles/sglang_service/meta/argument_specs.yml
    monkeypatch.setattr(redact, "declared", lambda: frozenset({"innocent_name"}))
    assert redact.is_secret("innocent_name") and not redact.is_secret("innocent_other")


def test_the_event_stream_is_scrubbed_of_every_redacted_value():
    r = redact.Redactor()
    r.argv(["-e", json.dumps({"sglang_service_secret_env": {"HF_TOKEN": "hf_abcdef", "N": 1}})])
    event = {"event_data": {"res": {"msg": ["HF_TOKEN=hf_abcdef failed"], "rc": 1}}, "counter": 3}
    assert r.scrub(event) == {"event_data": {"res": {"msg": ["HF_TOKEN=<redacted> failed"], "rc": 1}}, "counter": 3}
