"""Shared lab for the end-to-end tests: its own nodes (never the user's lab), torn down at the end.

Each test module sets up the lab state it reads (its fixtures) and leaves the nodes deployed,
never verified, as it found them, so that modules run in any order (pytest-randomly shuffles
them). The helpers are in tests/support/e2e.py.
"""

from __future__ import annotations

import pytest

from support.e2e import LAB_NAME, ansible, labmod


@pytest.fixture(scope="session")
def lab():
    the_lab = labmod.Lab(name=LAB_NAME)
    labmod.down(the_lab)
    hosts = labmod.up(the_lab, nodes=2, gpus=8, timeout=120)
    yield the_lab, hosts
    labmod.down(the_lab)
    assert labmod.lab_containers(the_lab) == []


@pytest.fixture(scope="session")
def deployed(lab):
    """The lab with deploy.yml applied once (units written, not enabled, not started: never verified)."""
    the_lab, hosts = lab
    ansible("ansible-playbook", "playbooks/deploy.yml", inventory=the_lab.inventory)
    return the_lab, hosts
