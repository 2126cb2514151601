"""Variable tables for the README, from each role's meta/argument_specs.yml.

python tools/argspec_tables.py            # print the tables
python tools/argspec_tables.py --write    # rewrite them in README.md between the markers
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
BEGIN = "<!-- BEGIN role variables (tools/argspec_tables.py --write) -->"
END = "<!-- END role variables -->"


def _cell(value: object) -> str:
    if isinstance(value, list):
        value = " ".join(str(v) for v in value)
    text = re.sub(r"[CI]\(([^)]*)\)", r"`\1`", str(value))  # Ansible doc markup
    return text.replace("|", "\\|").replace("\n", " ")


def _default(value: object) -> str:
    if value in ("", [], {}):
        return "`" + json.dumps(value) + "`"
    if isinstance(value, list):
        return "`" + json.dumps(value) + "`"
    return "`" + str(value) + "`"


def tables() -> str:
    out = []
    for spec_file in sorted(REPO.glob("roles/*/meta/argument_specs.yml")):
        role = spec_file.parts[-3]
        spec = yaml.safe_load(spec_file.read_text())["argument_specs"]["main"]
        out += [f"### Role `{role}`", "", _cell(spec.get("short_description", "")), ""]
        out += ["| Variable | Type | Default | Description |", "| --- | --- | --- | --- |"]
        for name, opt in spec["options"].items():
            kind = opt.get("type", "str")
            if kind == "list" and "elements" in opt:
                kind = f"list of {opt['elements']}"
            if "choices" in opt:
                kind += " (" + ", ".join(str(c) for c in opt["choices"]) + ")"
            default = "required" if opt.get("required") else (_default(opt["default"]) if "default" in opt else "")
            out.append(f"| `{name}` | {kind} | {default} | {_cell(opt.get('description', ''))} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def splice(readme: str, body: str) -> str:
    head, rest = readme.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{body}{END}{tail}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    body = tables()
    if args.write:
        path = REPO / "README.md"
        path.write_text(splice(path.read_text(), body))
    else:
        sys.stdout.write(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
