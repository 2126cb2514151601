"""python -m driver rollout's own options, as the playbook receives them (extra variables), and the refusals of
values that are none before anything runs (argparse: exit 2 naming the flag)."""

from __future__ import annotations

import json

import pytest

from driver import commands


def extra(*argv: str) -> dict:
    out: dict = {}
    for doc in commands.extravars(commands.parser().parse_args(["rollout", *argv])):
        out.update(json.loads(doc))
    return out


def test_the_rollouts_options_become_its_variables():
    got = extra("--max-unavailable", "25%", "--max-fail", "1", "--gateway-quorum", "1")
    assert got == {
        "sglang_rollout_max_unavailable": "25%",
        "sglang_rollout_max_fail": "1",
        "sglang_rollout_gateway_quorum": 1,
    }


def test_without_a_quorum_the_playbook_keeps_its_default_every_gateway():
    assert "sglang_rollout_gateway_quorum" not in extra()


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5", ""])
def test_a_quorum_that_is_no_count_of_one_or_more_is_refused_naming_the_flag(value, capsys):
    with pytest.raises(SystemExit) as err:
        commands.parser().parse_args(["rollout", "--gateway-quorum", value])
    assert err.value.code == 2
    assert f"argument --gateway-quorum: {value!r} is not a count of 1 or more" in capsys.readouterr().err
