"""One instance's rendered record: its unit, paths, argv, GPUs and port, as the role renders it once.

The filter plugin (plugins/filter/sglang_config.py, ``sglang_instance``) builds the record on
the controller; the unit template, validation and the modules read it. Nothing here
rebuilds a unit name or a path from strings.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from .procinfo import API_KEY_VAR
from .secret_rule import WEAK_MIN, Redactor, file_secrets, masked, named_secrets

NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")


def kg_dir(state_dir: str, name: str) -> str:
    """Where an instance's known-good generations live (known_good.Store, the unit's boot guard)."""
    return os.path.join(state_dir, "known-good", name)


@dataclass
class Instance:
    name: str
    unit: str
    unit_path: str
    env_path: str
    secrets_path: str
    pending_dir: str
    port: int
    gpus: list[int]
    argv: list[str]
    profile: str
    service_user: str = "sglang"
    profiles_argv: dict[str, list[str]] = field(default_factory=dict)
    nnodes: int = 1
    node_rank: int = 0
    state_dir: str = "/var/lib/sglang"

    dist_init_addr: str | None = None

    @classmethod
    def from_params(cls, p: dict) -> Instance:
        names = cls.__dataclass_fields__
        inst = cls(**{k: v for k, v in p.items() if k in names and v is not None})
        if not NAME.match(inst.name):  # it names files and a lock: never a path
            raise ValueError(f"instance name {inst.name!r}: lowercase letters, digits, '-' and '_' only")
        if not NAME.match(inst.profile):  # it goes raw into the unit's Description= (the filter refuses it first)
            raise ValueError(
                f"instance {inst.name}: profile name {inst.profile!r}: lowercase letters, digits, '-' and '_' only"
            )
        return inst

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def serves_http(self) -> bool:
        """Only rank 0 of an instance spanning nodes has an HTTP server."""
        return self.node_rank == 0

    @property
    def config_files(self) -> list[str]:
        """The versioned configuration: rolled back, recorded. Secrets are not among them."""
        return [self.unit_path, self.env_path]

    def pending_path(self, live: str) -> str:
        return os.path.join(self.pending_dir, os.path.basename(live))

    @property
    def pending_files(self) -> dict[str, str]:
        """{live path: its pending path} for the files a deploy staged."""
        return {live: self.pending_path(live) for live in self.config_files if os.path.exists(self.pending_path(live))}

    @property
    def kg_dir(self) -> str:
        return kg_dir(self.state_dir, self.name)

    @property
    def venv(self) -> str | None:
        """The virtualenv the unit runs: argv[0] is <venv>/bin/python."""
        if not self.argv or not self.argv[0].endswith("/bin/python"):
            return None
        return os.path.dirname(os.path.dirname(self.argv[0]))

    def api_key(self) -> str | None:
        """The instance's API key: the secrets file's current one (the launcher passes the same to SGLang)."""
        return read_env_file(self.secrets_path).get(API_KEY_VAR) or None

    def secret_values(self) -> list[str]:
        """Every value of the secrets file: a module never reports them (Ansible's no_log_values)."""
        return [v for v in read_env_file(self.secrets_path).values() if v]

    def redactor(self, more: Iterable[str] = ()) -> Redactor:
        """What strips the secrets file's values (and more: this run's) from a module's result, in every form a
        journal tail carries them (SGLang logs its server_args as a repr, 'a\\b'), not the literal value only."""
        return Redactor([*self.secret_values(), *more])

    def profile_of(self, running: list[str]) -> str | None:
        """The profile a running command line is: the configured one, another known one, or None."""
        if not running:
            return None
        if masked(running) == masked(self.argv):
            return self.profile
        return next((name for name, a in self.profiles_argv.items() if masked(a) == masked(running)), None)


def env_secrets(record: dict, env_content: str | None = None) -> list[str]:
    """The values of secret-named variables of a rendered instance's env (sglang_server_env, a profile's or the
    instance's own: HF_TOKEN), in its record and its env file's content: a module's no_log values, for both are
    its arguments (invocation.module_args) and may be in what it returns. Found by name only, a value shorter than
    WEAK_MIN is left out, as the Redactor leaves it: Ansible masks a no_log value everywhere, and a flag's "1" would
    turn every 1 in the result (GPU indices, counts) into a mask."""
    found = [*named_secrets(record.get("env")), *file_secrets(env_content or "")]
    return [v for v in found if len(v) >= WEAK_MIN]


def read_env_file(path: str) -> dict[str, str]:
    """The assignments of an environment file (parse_env); {} when it cannot be read."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError:
        return {}
    return parse_env(text)


def parse_env(text: str) -> dict[str, str]:
    """NAME="value" assignments as the role writes them (env_file_line) and systemd reads them: a quoted value
    may span lines (a multi-line secret), its quotes and backslash escapes undone; # and ; lines are comments."""
    out: dict[str, str] = {}
    i, n = 0, len(text)
    while i < n:
        eol = text.find("\n", i)
        line_end = n if eol < 0 else eol
        line = text[i:line_end].strip()
        if not line or line[0] in "#;" or "=" not in line:
            i = line_end + 1
            continue
        eq = text.index("=", i)
        name = text[i:eq].strip()
        j = eq + 1
        while j < n and text[j] in " \t":
            j += 1
        if j < n and text[j] in "\"'":
            quote, chars, j = text[j], [], j + 1
            while j < n and text[j] != quote:
                if quote == '"' and text[j] == "\\" and j + 1 < n:
                    j += 1
                chars.append(text[j])
                j += 1
            value = "".join(chars)
            eol = text.find("\n", j)
            i = n if eol < 0 else eol + 1
        else:
            value = text[j:line_end].strip()
            i = line_end + 1
        out[name] = value
    return out
