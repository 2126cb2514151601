"""Secrets out of what the driver records: `-e` values in the argv the ledger keeps, and the event stream.

A value is secret when its variable is declared so (an option with ``no_log: true`` in a role's
meta/argument_specs.yml) or its key names one (key, token, password, secret: sglang_service_secret_env,
sglang_service_api_key, HF_TOKEN: SECRET_WORDS), at any depth of a JSON or YAML `-e`. `@file` arguments stay paths.
"""

from __future__ import annotations

import functools
import json
import re
import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
REDACTED = "<redacted>"
# A key naming a secret has one of these words (split at anything not a letter or digit): HF_TOKEN,
# sglang_service_api_key, db_password; max_new_tokens and known_good_keep do not.
SECRET_WORDS = frozenset(
    {"key", "apikey", "token", "password", "passwd", "passphrase", "secret", "secrets", "credential", "credentials"}
)
SECRET_TEXT = re.compile(r"key|token|passw|secret|credential", re.I)  # an unparsable -e that may hold one
# Short values (true, 1, "") are not worth hiding in the event stream, and would blank out ordinary words.
MIN_SCRUB_LEN = 4


@functools.cache
def declared() -> frozenset[str]:
    """Variables the roles declare no_log (meta/argument_specs.yml)."""
    import yaml

    names = set()
    for spec in sorted(REPO.glob("roles/*/meta/argument_specs.yml")):
        data = yaml.safe_load(spec.read_text(encoding="utf-8")) or {}
        for entry in (data.get("argument_specs") or {}).values():
            for name, option in ((entry or {}).get("options") or {}).items():
                if isinstance(option, dict) and option.get("no_log"):
                    names.add(name)
    return frozenset(names)


def is_secret(key) -> bool:
    if not isinstance(key, str):
        return False
    return key in declared() or not SECRET_WORDS.isdisjoint(re.split(r"[^a-z0-9]+", key.lower()))


class Redactor:
    """Redacts `-e` values and remembers the secret strings it removed, to scrub them from anything else."""

    def __init__(self):
        self.secrets: set[str] = set()

    def keep(self, value) -> None:
        """Remember every string in a secret value."""
        if isinstance(value, dict):
            for v in value.values():
                self.keep(v)
        elif isinstance(value, list):
            for v in value:
                self.keep(v)
        elif value is not None and not isinstance(value, bool):
            text = str(value)
            if len(text) >= MIN_SCRUB_LEN:
                self.secrets.add(text)

    def data(self, value):
        """A parsed value with every secret key's value replaced."""
        if isinstance(value, dict):
            out = {}
            for k, v in value.items():
                if is_secret(k):
                    self.keep(v)
                    out[k] = REDACTED
                else:
                    out[k] = self.data(v)
            return out
        if isinstance(value, list):
            return [self.data(v) for v in value]
        if isinstance(value, str) and value.lstrip()[:1] in ("{", "["):
            parsed = _structured(value)
            if parsed is not None:
                redacted = self.data(parsed)
                return value if redacted == parsed else json.dumps(redacted)
        return value

    def extra_vars(self, text: str) -> str:
        """One `-e` argument as ansible-playbook reads it: @file, JSON or YAML, or key=value pairs."""
        stripped = text.strip()
        if stripped.startswith("@"):
            return text
        if stripped[:1] in ("{", "["):
            parsed = _structured(stripped)
            if parsed is None:
                return self.whole(text)
            redacted = self.data(parsed)
            return text if redacted == parsed else json.dumps(redacted)
        from ansible.parsing.splitter import parse_kv  # Ansible's own reading of key=value pairs

        try:
            pairs = parse_kv(text)
        except Exception:
            return self.whole(text)
        raw = pairs.pop("_raw_params", None)  # words that are no key=value: may be the rest of a secret
        secret = [k for k in pairs if is_secret(k)]
        out = {k: REDACTED if k in secret else self.data(v) for k, v in pairs.items()}
        if not secret and out == pairs:
            return text
        for k in secret:
            whole = f"{pairs[k]} {raw}" if raw else pairs[k]  # a JSON value with spaces is split by Ansible too
            parsed = _structured(whole) if whole.lstrip()[:1] in ("{", "[") else None
            self.keep(parsed if parsed is not None else whole)
        if raw and secret:
            raw = REDACTED
        words = [f"{k}={shlex.quote(str(v)) if k not in secret else v}" for k, v in out.items()]
        return " ".join(words + ([raw] if raw else []))

    def whole(self, text: str) -> str:
        """An `-e` that cannot be parsed: kept only when it names nothing secret."""
        if SECRET_TEXT.search(text) or any(name in text for name in declared()):
            self.keep(text)
            return REDACTED
        return text

    def argv(self, argv: list[str]) -> list[str]:
        """The driver's argv with every -e/--extra-vars value redacted (any spelling argparse accepts)."""
        out, i = [], 0
        while i < len(argv):
            arg = argv[i]
            if arg == "--":
                out += argv[i:]
                break
            opt, eq, inline = arg.partition("=")
            if arg in ("-e",) or (arg.startswith("--") and not eq and _is_extra_vars(arg)):
                out.append(arg)
                if i + 1 < len(argv):
                    out.append(self.extra_vars(argv[i + 1]))
                i += 2
                continue
            if arg.startswith("--") and eq and _is_extra_vars(opt):
                out.append(f"{opt}={self.extra_vars(inline)}")
            elif arg.startswith("-e") and not arg.startswith("--") and len(arg) > 2:
                out.append("-e" + self.extra_vars(arg[2:]))
            else:
                out.append(arg)
            i += 1
        return out

    def scrub(self, value):
        """value (an event: dicts, lists, strings) with every remembered secret replaced in its strings."""
        if isinstance(value, str):
            for secret in sorted(self.secrets, key=len, reverse=True):
                if secret in value:
                    value = value.replace(secret, REDACTED)
            return value
        if isinstance(value, dict):
            return {k: self.scrub(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.scrub(v) for v in value]
        return value


def _is_extra_vars(opt: str) -> bool:
    """--extra-vars or an abbreviation argparse accepts (--ex, --extra, ...)."""
    return len(opt) >= 3 and "--extra-vars".startswith(opt)


def _structured(text: str):
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        try:
            return json.loads(text)
        except ValueError:
            return None
