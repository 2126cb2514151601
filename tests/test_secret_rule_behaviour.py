"""What the one secret rule hides, and what it leaves alone (issue #31: the behaviours behind the mutants the unit
suite let survive in sglang_deploy/secret_rule.py).

Every text a secret may reach goes through it (the driver's ledger and events, the modules' results and recorded
command lines, the evidence bundle): a secret it misses is a leak, a word it masks that is no secret makes a journal
or a bundle unreadable. Each test states one form a secret is written in (a command line's --flag value,
--flag=value, a value that is the next flag; an assignment quoted or not, empty, holding another; an Authorization
header without a scheme; a known value JSON-escaped twice, as JSON that keeps its non-ASCII letters, in a unit's
Environment= with a %, URL-quoted with a space and a slash; its base64) and what comes out, word for word.
"""

from __future__ import annotations

import base64
import json

import pytest

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import secret_rule
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.secret_rule import MASK, Redactor

M = MASK


# ---------------------------------------------------------------- a command line's secret flags

SERVER = ["python", "-m", "sglang.launch_server", "--api-key", "k1", "--port", "30000", "--admin-api-key=k2=x"]
SERVER += ["--hf-token", "--tp", "2", "--ssl-keyfile-password"]  # no value, then the last word with nothing after


@pytest.mark.parametrize(
    "argv, values",
    [
        (SERVER, ["k1", "k2=x"]),
        (["--api-key", "--port", "1"], []),  # no value: the next flag is none
        (["--verbose", "--api-key", "k3"], ["k3"]),  # after a flag, and the last word
        (["api_key", "k4", "-api-key", "k5"], []),  # not a --flag
        (["--api-key=", "--hf-token", "x"], ["", "x"]),
    ],
    ids=["server", "next-flag", "last", "no-flag", "empty"],
)
def test_the_values_of_a_command_lines_secret_flags(argv, values):
    assert secret_rule.argv_secrets(argv) == values


@pytest.mark.parametrize(
    "text, expected",
    [
        ("python -m x --api-key --port 30000", None),  # no value: the next flag is left alone
        ("python -m x --api-key None --tp 2", None),  # unset
        ("python -m x --api-key abc12345 --port 1", "python -m x --api-key {M} --port 1"),
    ],
)
def test_a_secret_flag_in_text_masks_its_value_only(text, expected):
    want = text if expected is None else expected.replace("{M}", M)
    assert secret_rule.patterns(text) == want


# ---------------------------------------------------------------- assignments


@pytest.mark.parametrize(
    "text, expected",
    [
        # a password holding '(' and an assignment of its own is masked once, whole
        ("password=ab(token=cd) port=1", "password={M}) port=1"),
        ("api_key='token=abcdef' port=1", "api_key='{M}' port=1"),  # a quoted one, likewise
        ("api_key='' port=1", None),  # empty: nothing to hide, and no crash
        ('api_key="" port=1', None),
        ("password=abcdefga port=1", "password={M} port=1"),  # starts and ends with one letter: not a quote
        ("password=XsecretX port=1", "password={M} port=1"),
        ("password=a port=1", "password={M} port=1"),  # one character
        ("a=1 api_key=k1xx b=2 password=p2yy c", "a=1 api_key={M} b=2 password={M} c"),  # all the text kept
        ("Authorization: abcdefgh rest", "Authorization: {M} rest"),  # a header without a scheme
        ("Authorization: Bearer abcdefgh rest", "Authorization: Bearer {M} rest"),
    ],
)
def test_assignments(text, expected):
    want = text if expected is None else expected.replace("{M}", M)
    assert secret_rule.patterns(text) == want


def test_a_files_secret_values_are_found_whole():
    text = 'password=ab(token=cd)\nAPI_KEY="" \nHF_TOKEN=x\nPASSWORD=abcdefga\nEnvironment="DB_PASS=q1w2e3r4"\n'
    assert secret_rule.file_secrets(text) == ["ab(token=cd", "x", "abcdefga", "q1w2e3r4"]


@pytest.mark.parametrize("name", [None, 5, 1.5, b"api_key", ("api_key",)])
def test_a_name_that_is_not_text_names_no_secret(name):
    assert secret_rule.secret_name(name) is False


# ---------------------------------------------------------------- secret-named values in a record


def test_the_values_of_secret_named_keys_at_any_depth():
    record = {
        "env": {"HF_TOKEN": "hf_abc", "A": "1", "nested": {"DB_PASSWORD": "pw1"}, "B": "2"},
        "list": [{"api_key": "k1"}, "plain", ({"token": "k2"},), ["x"]],
        "password": None,  # unset
        "apiKey": "True",  # a boolean
        5: "five",  # a key that is no name
        "last": {"SMTP_PASS": "k3"},
        "tail": "t",
    }
    assert secret_rule.named_secrets(record) == ["hf_abc", "pw1", "k1", "k2", "k3"]
    assert secret_rule.named_secrets([{"api_key": "k1"}, "plain", ["x"]]) == ["k1"]
    assert secret_rule.named_secrets("api_key=k1") == []
    assert secret_rule.named_secrets({"api_key": {"value": "k1"}}) == []  # the value is no string


# ---------------------------------------------------------------- known values, in every form a log carries them


@pytest.mark.parametrize(
    "value, line, expected",
    [
        # JSON inside JSON (a journal line in a module's result), of a value with letters JSON escapes
        (
            "pässwörd-1234",
            json.dumps({"tail": [json.dumps({"api_key": "pässwörd-1234"})]}),
            json.dumps({"tail": [json.dumps({"api_key": M})]}),
        ),
        # JSON that keeps its letters (ensure_ascii=False), of a value with a quote and a newline too
        (
            'pä"ss\nwörd-1234',
            json.dumps({"api_key": 'pä"ss\nwörd-1234'}, ensure_ascii=False),
            json.dumps({"api_key": M}),
        ),
        # a unit's Environment=, where systemd reads % as a specifier: written %%
        ("ab%cd-efgh-1234", 'Environment="SOME_VAR=ab%%cd-efgh-1234"', 'Environment="SOME_VAR={M}"'),
        # URL-quoted, a slash and a space in it
        ("pass word/1234", "GET http://h/?k=pass%20word%2F1234&q=1", "GET http://h/?k={M}&q=1"),
        ("pass word/1234", "GET http://h/?k=pass+word%2F1234&q=1", "GET http://h/?k={M}&q=1"),
    ],
    ids=["json-in-json", "json-unescaped", "unit-percent", "url-quote", "url-quote-plus"],
)
def test_a_known_value_is_replaced_whole_in_the_form_a_log_carries_it(value, line, expected):
    assert Redactor([value]).values(line) == expected.replace("{M}", M)


def test_the_base64_of_a_value_is_replaced_and_another_values_is_not():
    value = "hunter2-abcW"  # 12 bytes: no padding, its base64 ends with X
    coded = base64.b64encode(value.encode()).decode()
    assert coded == "aHVudGVyMi1hYmNX"
    r = Redactor([value])
    assert r.values(f"data {coded} end") == f"data {M} end"
    other = base64.b64encode(b"hunter2-abcX").decode()  # one byte apart: all but its last character the same
    assert other == "aHVudGVyMi1hYmNY" and r.values(f"data {other} end") == f"data {other} end"


def test_no_form_is_empty():
    """An empty alternative would match between any two characters: the mask everywhere."""
    assert "" not in secret_rule.forms("")
    assert all(secret_rule.forms(v) and "" not in secret_rule.forms(v) for v in ("a", "ab", "abcd", " "))


# ---------------------------------------------------------------- which values a Redactor knows


def test_a_weak_value_is_replaced_from_8_characters():
    r = Redactor(weak=["seven77", "eight888", ""])
    assert r.values("seven77 and eight888") == f"seven77 and {M}"
    assert r.leaks("seven77") is False and r.leaks("eight888") is True
    assert Redactor(strong=["ab"]).values("cab") == f"c{M}", "a strong value whatever its length"


def test_a_value_containing_another_is_replaced_whole():
    r = Redactor(["secret12", "secret12-and-more"])
    assert r.values("x secret12-and-more y secret12 z") == f"x {M} y {M} z"
    padded = base64.b64encode(b"abcd").decode()  # YWJjZA==: its unpadded form is inside it
    assert Redactor(["abcd"]).values(f"b64 {padded} end") == f"b64 {M} end"


# ---------------------------------------------------------------- inside another name's value; bytes not UTF-8


@pytest.mark.parametrize(
    "text, expected, found",
    [
        # systemctl show prints a unit's Environment= unquoted (the evidence bundle's unit-state.txt)
        (
            "Environment=HF_TOKEN=hf_abcdef12 NCCL_DEBUG=WARN",
            "Environment=HF_TOKEN={M} NCCL_DEBUG=WARN",
            ["hf_abcdef12"],
        ),
        ("SGLANG_ARGS=--api-key=abcdef12 X=1", "SGLANG_ARGS=--api-key={M} X=1", ["abcdef12"]),
        ("callback=http://h/v1?token=abcdef12 ok", "callback=http://h/v1?token={M} ok", ["abcdef12"]),
        ('Environment="HF_TOKEN=hf_abcdef12"', 'Environment="HF_TOKEN={M}"', ["hf_abcdef12"]),
        ("a=b=c x=y:z", None, []),
    ],
    ids=["systemctl-show", "flag-in-value", "url-query", "quoted", "no-secret"],
)
def test_an_assignment_inside_another_names_value_is_found_quoted_or_not(text, expected, found):
    """As it is on its own: the name before it changes nothing."""
    want = text if expected is None else expected.replace("{M}", M)
    assert secret_rule.patterns(text) == want
    assert secret_rule.file_secrets(text) == found


def test_a_known_value_with_a_byte_that_is_not_utf8_is_redacted_not_a_crash():
    """An -e value Python decoded from a command line (a surrogate for the byte): the driver's events are scrubbed
    with it, and its base64 is the one of its surrogate's bytes."""
    value = "hunter2-\udcff-k"
    r = Redactor([value])
    coded = base64.b64encode(value.encode("utf-8", "surrogatepass")).decode()
    assert r.values(f"x {value} y {coded} z") == f"x {M} y {M} z"
    assert r.scrub({"a": [f"k={value!r}"]}) == {"a": [f"k={M}"]}  # its repr, quotes and all
