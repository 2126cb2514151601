"""What the ledger records of an `-e` and which secrets it remembers to scrub (issue #31: the behaviours behind the
mutants the unit suite let survive in driver/redact.py).

The recorded argv: each -e redacted whole, never a shorter -e that ends it; JSON/YAML at any depth (lists, strings
that hold JSON or YAML themselves, with or without a secret); an -e with nothing secret kept as the operator wrote it;
key=value words quoted so that they read back as they were. The remembered secrets (scrubbed from the event stream,
the terminal and --json): each string of a secret value as Ansible would read it (a JSON or YAML value's strings, a
YAML-looking number as written), nothing shorter than 4 characters, no None, no booleans; an -e that cannot be read
is remembered whole.
"""

from __future__ import annotations

import json

import pytest

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import secret_rule
from driver import redact

M = secret_rule.MASK


def recorded(*extra: str) -> tuple[list[str], set[str]]:
    """The argv the ledger keeps of `status *extra` (less the command), and the secrets remembered."""
    r = redact.Redactor()
    out = r.argv(["status", *extra])
    assert out[0] == "status"
    return out[1:], r.secrets


def test_an_attached_extra_vars_is_redacted_whole_even_when_a_shorter_one_ends_it():
    """-e b=1 and -eapi_key=K b=1: the second argument ends with the first -e's value, and holds its own."""
    argv, secrets = recorded("-e", "b=1", "-eapi_key=k1234567 b=1")
    assert argv == ["-e", "b=1", f"-eapi_key={M} b=1"]
    assert secrets == {"k1234567"}


# ------------------------------------------------------------------ structured -e, at any depth


def test_a_json_extra_vars_keeps_its_lists_and_masks_its_secrets():
    argv, secrets = recorded("-e", json.dumps({"hosts": ["a", "b"], "api_key": "k1234567"}))
    assert argv == ["-e", json.dumps({"hosts": ["a", "b"], "api_key": M})]
    assert secrets == {"k1234567"}


def test_a_top_level_list_is_read_as_json_too():
    argv, secrets = recorded("-e", '[1, {"api_key": "k1234567"}]')
    assert argv == ["-e", f'[1, {{"api_key": "{M}"}}]'] and secrets == {"k1234567"}


def test_strings_that_hold_json_are_redacted_inside_and_left_as_written_without_a_secret():
    """An object (after blanks) and a list, each with a secret, rewritten with it masked; one with none untouched."""
    value = {
        "cfg": ' {"HF_TOKEN": "hf_12345"}',
        "list": '[{"api_key": "k7654321"}]',
        "plain": '{"a":1}',
    }
    argv, secrets = recorded("-e", json.dumps(value))
    masked = {"cfg": json.dumps({"HF_TOKEN": M}), "list": json.dumps([{"api_key": M}]), "plain": '{"a":1}'}
    assert argv == ["-e", json.dumps(masked)]
    assert secrets == {"hf_12345", "k7654321"}


def test_a_json_extra_vars_without_a_secret_is_recorded_as_written():
    assert recorded("-e", '{"n":1}') == (["-e", '{"n":1}'], set())


def test_an_extra_vars_that_cannot_be_read_is_withheld_and_remembered_whole():
    """No name in it can be read to say it holds no secret: masked, and its text scrubbed wherever it shows."""
    for text in ("{unparsable: [ k1234567", 'a="b'):  # YAML that fails; key=value Ansible cannot split
        argv, secrets = recorded("-e", text)
        assert (argv, secrets) == (["-e", M], {text}), text


# ------------------------------------------------------------------ key=value -e


def test_key_value_words_without_a_secret_are_recorded_as_written():
    assert recorded("-e", 'x="a b"  y=2') == (["-e", 'x="a b"  y=2'], set())


def test_a_non_secret_value_with_spaces_is_quoted_beside_a_masked_one():
    """Read back as Ansible would read it: msg is still the one word 'a b'."""
    assert recorded("-e", 'api_key=x msg="a b"') == (["-e", f"api_key={M} msg='a b'"], set())


def test_a_secret_inside_a_json_value_of_a_key_value_word_is_masked():
    argv, secrets = recorded("-e", 'cfg={"api_key":"k1234567"}')
    assert argv == ["-e", "cfg=" + "'" + json.dumps({"api_key": M}) + "'"]
    assert secrets == {"k1234567"}


@pytest.mark.parametrize(
    "text,secrets",
    [
        # Ansible splits a JSON value at its spaces: the value and the words after it are the secret, parsed.
        ('sglang_service_secret_env={"HF_TOKEN": "hf_1234"}', {"hf_1234"}),
        ('api_key=" {\\"a\\": \\"k1234567\\"}"', {"k1234567"}),
        ('api_key=\'["k1234567", "k7654321"]\'', {"k1234567", "k7654321"}),
        ("api_key=0x1F2E3D4C", {"0x1F2E3D4C"}),  # YAML would read a number: the secret is what was written
    ],
    ids=["split JSON", "JSON after a blank", "a list", "a YAML number"],
)
def test_a_secret_key_values_strings_are_remembered_as_ansible_reads_them(text, secrets):
    argv, kept = recorded("-e", text)
    assert M in argv[1] and kept == secrets
    r = redact.Redactor()
    r.argv(["status", "-e", text])
    event = {"msg": " ".join(f"saw {s}" for s in sorted(secrets))}
    assert r.scrub(event) == {"msg": " ".join(f"saw {M}" for _ in secrets)}


def test_nothing_shorter_than_4_characters_no_none_and_no_boolean_is_remembered():
    """They would blank out ordinary words ("None", "True") in every event."""
    value = {"sglang_service_secret_env": {"A": None, "B": True, "C": "abcd", "D": "abc", "E": ["wxyz", False]}}
    argv, secrets = recorded("-e", json.dumps(value))
    assert argv == ["-e", json.dumps({"sglang_service_secret_env": M})]
    assert secrets == {"abcd", "wxyz"}
