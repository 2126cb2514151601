"""Secrets out of what the driver records and shows: `-e` values in the argv the ledger keeps, and the event
stream (events.jsonl, the terminal, --json).

What names a secret, the mask and the forms a value is logged in are the hosts' own:
plugins/module_utils/sglang_deploy/secret_rule.py, the one secret rule. A value is secret when its variable is declared so
(an option with ``no_log: true`` in a role's meta/argument_specs.yml) or its name says so (secret_rule.secret_name:
sglang_service_secret_env, sglang_service_api_key, HF_TOKEN), at any depth of a JSON or YAML `-e`. The `-e` values
are the ones the driver's own parser (driver/commands.py) reads, so every spelling argparse accepts is found (-e X, -eX,
-ve X, -veX, --extra-vars=X, --extra X); `@file` arguments stay paths, the secrets in their files are remembered.
"""

from __future__ import annotations

import functools
import json
import shlex

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import secret_rule
from driver import paths

# Short values (true, 1, "") are not worth hiding in the event stream, and would blank out ordinary words.
MIN_SCRUB_LEN = 4


@functools.cache
def declared() -> frozenset[str]:
    """Variables the roles declare no_log (meta/argument_specs.yml)."""
    import yaml

    names = set()
    for spec in sorted(paths.collection().glob("roles/*/meta/argument_specs.yml")):
        data = yaml.safe_load(spec.read_text(encoding="utf-8")) or {}
        for entry in (data.get("argument_specs") or {}).values():
            for name, option in ((entry or {}).get("options") or {}).items():
                if isinstance(option, dict) and option.get("no_log"):
                    names.add(name)
    return frozenset(names)


def is_secret(key) -> bool:
    """A variable whose value is secret: declared no_log by a role, or named so by the one rule."""
    return isinstance(key, str) and (key in declared() or secret_rule.secret_name(key))


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
                    out[k] = secret_rule.MASK
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
            self.from_file(stripped[1:])
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
        # Ansible takes `hf_token: v`, `hf_token = v` or `hf_token\=v` as words too (a variable _raw_params): a
        # secret-named assignment among them, as the one rule's patterns read it, withholds them all.
        raw_secret = bool(raw) and secret_rule.patterns(raw) != raw
        secret = [k for k in pairs if is_secret(k)]
        out = {k: secret_rule.MASK if k in secret else self.data(v) for k, v in pairs.items()}
        if not secret and not raw_secret and out == pairs:
            return text
        if raw_secret:
            for value in secret_rule.file_secrets(raw):
                self.keep(value)
        for k in secret:
            whole = f"{pairs[k]} {raw}" if raw else pairs[k]  # a JSON value with spaces is split by Ansible too
            parsed = _structured(whole) if whole.lstrip()[:1] in ("{", "[") else None
            self.keep(parsed if parsed is not None else whole)
        if raw and (secret or raw_secret):
            raw = secret_rule.MASK
        words = [f"{k}={shlex.quote(str(v)) if k not in secret else v}" for k, v in out.items()]
        return " ".join(words + ([raw] if raw else []))

    def from_file(self, path: str) -> None:
        """An `-e @file`: its path stays in the argv, its secret values are remembered (read with Ansible's own
        loader, as ansible-playbook reads it) to be scrubbed from the events, the terminal and --json."""
        from ansible.parsing.dataloader import DataLoader

        try:
            self.data(DataLoader().load_from_file(path))
        except Exception:  # unreadable (missing, vaulted): ansible-playbook says so; nothing to keep
            return

    def whole(self, text: str) -> str:
        """An `-e` that cannot be parsed: withheld whole, for no name in it can be read to say it holds no secret."""
        self.keep(text)
        return secret_rule.MASK

    def argv(self, argv: list[str]) -> list[str]:
        """The driver's argv with every `-e` value redacted, the values found by the driver's own parser.

        argparse hands an option its value as a whole argument (-e X, -ve X, --extra-vars X) or as an argument's
        tail (-eX, -veX, --extra-vars=X, --ex=X): each argument that is a value, or ends with one, has it redacted.
        """
        from driver import commands

        values = sorted(set(commands.parser().parse_args(argv).extra_vars), key=len, reverse=True)
        out = []
        for arg in argv:
            if arg in values:
                arg = self.extra_vars(arg)
            else:
                tail = next((v for v in values if v and arg.startswith("-") and arg.endswith(v)), None)
                if tail is not None:
                    arg = arg[: -len(tail)] + self.extra_vars(tail)
            out.append(arg)
        return out

    def scrub(self, value):
        """value (an event: dicts, lists, strings) with every remembered secret replaced in its strings, in every
        form a log carries it (secret_rule.forms: repr, JSON, URL, shell-quoted, base64, ...)."""
        return _known(frozenset(self.secrets)).scrub(value)


@functools.lru_cache(maxsize=4)
def _known(secrets: frozenset[str]) -> secret_rule.Redactor:
    """The one rule's Redactor of these values (its pattern compiled once per set, not per event)."""
    return secret_rule.Redactor(secrets)


def _structured(text: str):
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        try:
            return json.loads(text)
        except ValueError:
            return None
