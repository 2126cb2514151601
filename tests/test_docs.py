"""The docs: variable pages generated from the roles' argument specs and current; a short README; no dead links."""

import re
from pathlib import Path
from urllib.parse import unquote

import pytest
import yaml

from tools import argspec_tables

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
README_MAX_LINES = 150
# [text](target) and ![alt](target), the target up to whitespace or ")"; fenced code is left out first.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)


def markdown_files() -> list[Path]:
    return [README, *sorted((REPO / "docs").rglob("*.md"))]


def relative_links(path: Path) -> list[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code is not a link
    links = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("#"):
            continue  # http:, mailto:, an anchor in the same page
        links.append(unquote(target.split("#", 1)[0]))
    return links


def test_every_role_has_an_argument_spec():
    roles = sorted(p.name for p in (REPO / "roles").iterdir() if p.is_dir())
    assert roles == argspec_tables.roles()


def test_every_default_is_in_an_argument_spec():
    for defaults in REPO.glob("roles/*/defaults/main.yml"):
        role = defaults.parts[-3]
        spec_file = REPO / "roles" / role / "meta" / "argument_specs.yml"
        assert spec_file.is_file(), f"{role}: defaults without meta/argument_specs.yml"
        spec = yaml.safe_load(spec_file.read_text())["argument_specs"]
        # A default serves the entry point that reads it (roles/sglang_monitoring's node_exporter, say).
        declared = set().union(*(entry.get("options", {}) for entry in spec.values()))
        missing = set(yaml.safe_load(defaults.read_text())) - declared
        assert not missing, f"{role}: defaults without an argument spec: {sorted(missing)}"


def test_variable_pages_are_current():
    assert argspec_tables.stale() == [], "run: python tools/argspec_tables.py --write"


def test_the_readme_links_the_variable_pages():
    """The generated index links every role's page, and the README links the index."""
    assert "](docs/variables/index.md)" in README.read_text(encoding="utf-8")
    index = argspec_tables.index()
    for role in argspec_tables.roles():
        assert f"]({role}.md)" in index, role


def test_the_readme_is_short_and_starts_with_the_two_commands():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; at most {README_MAX_LINES}"
    assert lines[0] == "# sglang-deploy"
    head = "\n".join(lines[:8])
    assert "make demo" in head and "make test" in head


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(path):
    dead = [t for t in relative_links(path) if not (path.parent / t).exists()]
    assert not dead, f"{path.relative_to(REPO)}: links to nothing: {dead}"


def test_the_link_finder_finds_links_and_skips_code(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        '[a](docs/a.md) ![b](b.svg "title") [c](https://x.org/c) [d](#d) [e](e.md#part) `[f](f.md)`\n'
        "```\n[g](g.md)\n```\n"
    )
    assert relative_links(page) == ["docs/a.md", "b.svg", "e.md"]
