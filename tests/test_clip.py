"""Mask, then cut (#30): a text cut before it is masked keeps the part of a secret on its side of the cut, which
no pattern (its name cut away) and no known value's mask (only part of it left) finds any more.
secret_rule.clip masks first; every place that shortens a text a secret may be in uses it."""

from __future__ import annotations

import json

import pytest

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import http, progress, router, secret_rule

M = secret_rule.MASK
SECRET = "sk-STRADDLE0123456789abcdef"


def pieces(text: str) -> list[str]:
    """Each part of SECRET of 4 characters or more that is in text."""
    return [SECRET[i:j] for i in range(len(SECRET)) for j in range(i + 4, len(SECRET) + 1) if SECRET[i:j] in text]


@pytest.mark.parametrize("cut", range(1, len(SECRET)))
def test_a_known_value_split_at_the_head_cut_is_masked(cut):
    text = f"invalid key {SECRET} sent"
    n = len("invalid key ") + cut  # the cut inside the secret
    out = secret_rule.clip(text, n, secret_rule.Redactor([SECRET]).text)
    assert not pieces(out) and out == f"invalid key {M} sent"[:n]


@pytest.mark.parametrize("cut", range(1, len(SECRET)))
def test_a_named_value_split_at_the_tail_cut_is_masked(cut):
    """SGLang's ServerArgs line (a repr) with its last n characters kept: the name is on the other side."""
    text = f"server_args=ServerArgs(model_path='/m', api_key='{SECRET}', port=30000)"
    n = len("', port=30000)") + cut
    out = secret_rule.clip(text, n, last=True)
    assert not pieces(out) and out.endswith("', port=30000)")


def test_a_journal_lines_tail_in_the_progress_is_masked_first():
    """progress.LoadWatch keeps the newest line's last 300 characters: the ServerArgs line is longer."""
    line = f"[2025] server_args=ServerArgs(api_key='{SECRET}', " + "x" * 280 + ")"
    watch = progress.LoadWatch()
    watch.feed([line])
    assert len(watch.last_line) <= 300 and not pieces(watch.last_line), watch.last_line[:40]
    bare = "z" * 10 + SECRET + "y" * 290  # a known value without its name: the instance's Redactor knows it
    watch = progress.LoadWatch(secret_rule.Redactor([SECRET]).text)
    watch.feed([bare])
    assert not pieces(watch.last_line), watch.last_line[:40]


@pytest.mark.parametrize("body", ["answered", "status"])
def test_a_generate_error_body_is_masked_before_it_is_cut(monkeypatch, body):
    """A server echoing the key it was sent, the cut at 300 inside it."""
    pad = "e" * (300 - len('{"error": "bad key ') - 6)
    if body == "status":
        answer = (500, f'{{"error": "bad key {SECRET}"}}'.replace("bad key", "bad key " + pad[1:]).encode())
    else:
        answer = (200, json.dumps({"text": "", "meta_info": {}, "echo": pad + SECRET}).encode())
    monkeypatch.setattr(http, "request", lambda *a, **kw: answer)
    with pytest.raises(http.HttpError) as err:
        http.generate("http://127.0.0.1:1", "p", 4, api_key=SECRET)
    assert not pieces(str(err.value)), str(err.value)[-60:]


def test_a_routers_error_answer_is_masked_before_it_is_cut(monkeypatch):
    doc = {"error": "x" * 270 + f" token {SECRET} rejected"}
    monkeypatch.setattr(router, "request", lambda *a, **kw: (500, json.dumps(doc).encode()))
    with pytest.raises(router.RouterError) as err:
        router.Router("http://127.0.0.1:1", api_key=SECRET).workers()
    assert not pieces(str(err.value)), str(err.value)[-60:]


@pytest.mark.parametrize(
    "text,masked,found",
    [
        # SGLang's own start line: the assignment is inside another name's bare value (it was not masked).
        (
            "server_args=ServerArgs(api_key='k1234567', port=3)",
            f"server_args=ServerArgs(api_key='{M}', port=3)",
            ["k1234567"],
        ),
        ('Environment="HF_TOKEN=k1234567"', f'Environment="HF_TOKEN={M}"', ["k1234567"]),  # a unit's line (nor this)
        ("DB_PASSWORD=ab(cd)", f"DB_PASSWORD={M})", ["ab(cd"]),  # a secret's bare value runs on past its '('
    ],
)
def test_an_assignment_inside_another_names_value_is_found(text, masked, found):
    assert secret_rule.patterns(text) == masked
    assert secret_rule.file_secrets(text) == found
