"""plugins/module_utils/sglang_deploy/secret_rule.py, the one secret rule (#30): the names it calls secret, the same for the
driver (driver/redact.py), the modules (a tune grid, the filter's flags) and the evidence bundle; one mask; the
patterns; a known value redacted in every form a log carries it; no second list of names or mask anywhere."""

from __future__ import annotations

import ast
import base64
import json
import re
import shlex
import urllib.parse
from pathlib import Path

import pytest

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import evidence, tune
from driver import redact

REPO = Path(__file__).resolve().parents[1]

# (name, secret?): each a case the driver and the hosts once disagreed on, or one a looser rule would get wrong.
NAMES = [
    ("api_key", True),
    ("admin_api_key", True),
    ("--admin-api-key", True),
    ("HF_TOKEN", True),
    ("DB_PASSWORD", True),
    ("DB_PASS", True),  # `pass` as the last part: a password (the hosts said so, the driver did not)
    ("AWS_SECRET_ACCESS_KEY", True),
    ("sglang_service_secret_env", True),
    ("secrets_content", True),  # the modules' option (the driver said so, the hosts did not)
    ("ssl_keyfile_password", True),
    ("passphrase", True),
    ("apiKey", True),
    ("accessToken", True),
    ("api_key_file", False),  # a path, not a secret (the driver redacted it, the hosts did not)
    ("speculative_token_map", False),  # a path; its token is no last part (the driver and a tune grid refused it)
    ("secrets_path", False),
    ("hf_token_path", False),
    ("max_total_tokens", False),
    ("max_new_tokens", False),
    ("tokenizer_path", False),
    ("known_good_keep", False),
    ("pass_rate", False),
    ("AWS_ACCESS_KEY_ID", False),
    ("ssl_keyfile", False),
]
VALUE = "v4lue-0123456789"


@pytest.mark.parametrize(("name", "secret"), NAMES)
def test_the_rule(name, secret):
    from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import secret_rule

    assert secret_rule.secret_name(name) is secret


@pytest.mark.parametrize(("name", "secret"), NAMES)
def test_the_driver_the_modules_and_the_evidence_bundle_call_the_same_names_secret(name, secret):
    assert redact.is_secret(name) is secret, "the driver"
    masked = evidence.Redactor([]).data({name: VALUE})[name] != VALUE
    assert masked is secret, "the evidence bundle (a secret-named key's value)"
    text = evidence.Redactor([]).text(f"{name}={VALUE} {name}: '{VALUE}'")
    assert (VALUE not in text) is secret, "the evidence bundle (a secret-named assignment in a journal)"
    if re.fullmatch(r"[a-z][a-z0-9_]*|[A-Z_][A-Z0-9_]*", name):  # a key a tune grid takes
        try:
            tune.parse_grid([f"{name}=a,b"])
            refused = False
        except tune.GridError as exc:
            refused = "names a secret" in str(exc)
        assert refused is secret, "a tune grid"
    if re.fullmatch(r"[A-Za-z_]\w*", name):  # a variable an -e sets
        recorded = redact.Redactor().argv(["status", "-e", f"{name}={VALUE}"])
        assert (VALUE not in recorded[-1]) is secret, "the driver's recorded argv"


def test_one_mask_for_the_driver_the_modules_and_the_bundle():
    from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import secret_rule
    from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.instance import masked

    driver = redact.Redactor().argv(["status", "-e", "api_key=abcd1234"])[-1].split("=", 1)[1]
    bundle = evidence.Redactor([]).text("api_key=abcd1234").split("=", 1)[1]
    command_line = masked(["python", "--api-key", "abcd1234"])[-1]
    assert driver == bundle == command_line == secret_rule.MASK


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "ServerArgs(api_key='abc12345', max_total_tokens=4096)",
            "ServerArgs(api_key='{M}', max_total_tokens=4096)",
        ),
        (
            '{"admin_api_key": "xyz98765", "tokenizer_path": "/m"}',
            '{"admin_api_key": "{M}", "tokenizer_path": "/m"}',
        ),
        ('HF_TOKEN="hf_abcdef" NCCL_DEBUG=WARN', 'HF_TOKEN="{M}" NCCL_DEBUG=WARN'),
        ("python -m x --api-key abc12345 --port 1", "python -m x --api-key {M} --port 1"),
        ("['--hf-token', 'abc12345', '--tp', '2']", "['--hf-token', '{M}', '--tp', '2']"),
        ("Authorization: Basic dXNlcjpwYXNz", "Authorization: Basic {M}"),
        ("curl -H 'Authorization: Bearer sk-abcdefgh1234'", "curl -H 'Authorization: Bearer {M}'"),
        ("git+https://user:pw123@host/r.git", "git+https://{M}@host/r.git"),
        ("DB_PASS=hunter22 api_key_file=/etc/k", "DB_PASS={M} api_key_file=/etc/k"),
        ("api_key=None speculative_token_map=/m/map.json max_prefill_tokens=16384", None),
        ("token throughput 123.4 tok/s, 5 tokens", None),
    ],
)
def test_the_patterns(text, expected):
    from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import secret_rule

    want = text if expected is None else expected.replace("{M}", secret_rule.MASK)
    assert secret_rule.Redactor([]).text(text) == want


# A value as hostile as a secret gets: a backslash, both quotes, $, %, a newline and regex metacharacters.
ODD = "Zq9\\k'e\"y$H%h\nW.*+?[(|"


def logged(value: str) -> dict[str, str]:
    """Lines a log carries the value in, each in one of its escaped forms."""
    line = f"server_args=ServerArgs(api_key={value!r}, port=30000)"  # SGLang at start: a repr
    return {
        "raw": f"key {value} end",
        "repr": line,
        "json": json.dumps({"api_key": value, "port": 30000}),
        "json of a repr": json.dumps({"journal_tail": [line]}),  # a module's failure.journal_tail in an event
        "repr of a repr": repr([line]),
        "url": "http://h/?k=" + urllib.parse.quote(value, safe="") + "&q=" + urllib.parse.quote_plus(value),
        "shell": "curl -d " + shlex.quote(value) + " http://h/",
        "base64": "data " + base64.b64encode(value.encode()).decode() + " end",
        "base64 url-safe": "data " + base64.urlsafe_b64encode(value.encode()).decode().rstrip("=") + " end",
        "env file": 'SOME_VAR="' + value.replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$") + '"',
    }


def gone(text: str, value: str) -> bool:
    """No trace of the value: neither its letters (every form but base64 keeps them) nor its base64."""
    b64 = base64.b64encode(value.encode()).decode().rstrip("=")
    url64 = base64.urlsafe_b64encode(value.encode()).decode().rstrip("=")
    return "Zq9" not in text and b64[:16] not in text and url64[:16] not in text


@pytest.mark.parametrize("form", list(logged(ODD)))
def test_a_known_value_is_redacted_in_every_form_a_log_carries_it(form):
    from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import secret_rule

    line = logged(ODD)[form]
    assert not gone(line, ODD)
    out = secret_rule.Redactor([ODD]).values(line)
    assert gone(out, ODD) and secret_rule.MASK in out, out
    assert secret_rule.Redactor([ODD]).scrub({"a": [line]}) == {"a": [out]}
    assert secret_rule.Redactor([ODD]).leaks(out) is False


def test_a_short_value_has_no_base64_form():
    """Two or three base64 characters would match inside any base64 text."""
    from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import secret_rule

    assert secret_rule.forms("ab") == {"ab"}
    assert base64.b64encode(b"abcd").decode() in secret_rule.forms("abcd")


def test_data_masks_secret_named_keys_and_redacts_every_string():
    from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import secret_rule

    r = secret_rule.Redactor([ODD])
    M = secret_rule.MASK
    assert r.data({"a": [ODD], "password": "plain", "api_key_file": "/k", "token": None}) == {
        "a": [M],
        "password": M,
        "api_key_file": "/k",
        "token": None,
    }


# --------------------------------------------------------------------------- one rule, in one place

CODE = ["driver", "plugins", "lab", "tools", "bench"]
OLD_MASK = "<" + "redacted>"  # spelled in parts: this file holds no such string either


def python_files(*tops: str) -> list[Path]:
    return sorted(p for top in tops for p in (REPO / top).rglob("*.py") if ".venv" not in p.parts)


def test_no_second_list_of_secret_names_and_no_second_mask():
    """Outside secret_rule.py no code defines a name list, pattern or mask of secrets (a module-level name with
    SECRET, MASK or REDACT in it) nor spells the mask; no test expects the driver's old mask."""
    from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import secret_rule

    offences = []
    for path in python_files(*CODE):
        if path.name == "secret_rule.py":
            continue
        tree = ast.parse(path.read_text())
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            for t in targets:
                if isinstance(t, ast.Name) and re.search(r"SECRET|MASK|REDACT", t.id):
                    offences.append(f"{path.relative_to(REPO)}:{node.lineno}: {t.id}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in (secret_rule.MASK, OLD_MASK):
                offences.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}")
    for path in python_files("tests"):
        if OLD_MASK in path.read_text():
            offences.append(f"{path.relative_to(REPO)}: the driver's old mask")
    assert offences == []


def test_the_rule_stays_importable_by_the_hosts_modules():
    """Shipped with the modules and beside the gate: Python 3.9's syntax, the standard library only, and a name
    that shadows no module of the standard library, wherever its directory lands on sys.path."""
    import sys

    path = REPO / "plugins" / "module_utils" / "sglang_deploy" / "secret_rule.py"
    tree = ast.parse(path.read_text(), feature_version=(3, 9))
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}, imported
    assert path.stem not in sys.stdlib_module_names
