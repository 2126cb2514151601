"""The README's variable tables are those of the roles' argument specs; every role has one."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import argspec_tables  # noqa: E402


def test_every_role_has_an_argument_spec():
    roles = sorted(p.name for p in (REPO / "roles").iterdir() if p.is_dir())
    assert roles == sorted(p.parts[-3] for p in REPO.glob("roles/*/meta/argument_specs.yml"))


def test_every_default_is_in_the_argument_spec():
    import yaml

    for defaults in REPO.glob("roles/*/defaults/main.yml"):
        role = defaults.parts[-3]
        spec = yaml.safe_load((REPO / "roles" / role / "meta" / "argument_specs.yml").read_text())["argument_specs"][
            "main"
        ]
        missing = set(yaml.safe_load(defaults.read_text())) - set(spec["options"])
        assert not missing, f"{role}: defaults without an argument spec: {sorted(missing)}"


def test_readme_tables_are_current():
    readme = (REPO / "README.md").read_text()
    assert argspec_tables.splice(readme, argspec_tables.tables()) == readme, (
        "run: python tools/argspec_tables.py --write"
    )
