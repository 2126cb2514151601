"""The one secret rule: which names hold a secret, the patterns that find one in text, the mask that replaces it,
and the forms a known value is logged in.

Everything that hides a secret imports it: the driver (driver/redact.py: the ledger's argv, the event stream, the
terminal and ``--json``), the modules (what they return, the command lines they compare and record) and the crash
evidence bundle (evidence.py). Shipped with the modules and beside the GPU gate and the launcher
(roles/sglang_service/tasks/gate.yml): Python 3.9+, the standard library only. Not named ``secrets``: the
standard library's module of that name must stay reachable wherever this directory is on sys.path.

A name is split into lower-case parts at anything not a letter or digit and at a camelCase hump
(HF_TOKEN, --admin-api-key, db.password, apiKey). It names a secret when

- any part is one of SECRET_ANY (sglang_service_secret_env, secrets_content, DB_PASSWORD), or
- its last part is one of SECRET_LAST (api_key, AWS_SECRET_ACCESS_KEY, HF_TOKEN, DB_PASS),

unless its last part says it names where a secret is kept (PATH_LAST: api_key_file, secrets_path): a path is
shown, the file itself is root-only. speculative_token_map is no secret either: its token is not the last part.
"""

from __future__ import annotations

import base64
import json
import re
import shlex
import urllib.parse
from collections.abc import Callable, Iterable

# The one replacement everywhere. Known-good records hash the argv masked with it: another text changes their hashes.
MASK = "<secret>"

SECRET_ANY = frozenset({"password", "passwd", "passphrase", "secret", "secrets", "apikey", "credential", "credentials"})
# Only as the last part: max_total_tokens, token_map, key_count are no secrets. `pass` too: DB_PASS and SMTP_PASS
# are passwords (as sglang_service_secret_env writes them), while pass_rate or pass_through are not.
SECRET_LAST = frozenset({"key", "token", "pass"})
# A path names where a secret is kept, never the secret (the file is root-only; the path is shown to operators).
PATH_LAST = frozenset({"file", "filename", "path", "dir", "directory"})
# The SGLang flags a configuration may not set: their value is the key the launcher passes from the root-only
# secrets file (sglang_service_api_key). Not every secret-named flag: bucket_time_to_first_token or
# kt_max_deferred_experts_per_token are SGLang flags too, and ssl_keyfile_password has no other way in yet.
REFUSED_FLAGS = frozenset({"--api-key", "--admin-api-key"})
# Values that are never secrets whatever their name (an unset key, a flag's boolean, a value already masked).
NOT_SECRET = frozenset({"", "None", "none", "null", "False", "false", "True", "true", MASK})
# A value found by its name elsewhere than the secrets file is replaced everywhere from this length: shorter ones
# would blank out ordinary words.
WEAK_MIN = 8
# Nor is a shorter value's base64 replaced: two or three characters would match inside any base64 text.
BASE64_MIN = 4

_PARTS = re.compile(r"[^a-z0-9]+")
_HUMP = re.compile(r"([a-z0-9])([A-Z])")


def name_parts(name: str) -> list[str]:
    """A name's lower-case parts: apiKey, API_KEY and --api-key all give ["api", "key"]."""
    return [p for p in _PARTS.split(_HUMP.sub(r"\1_\2", name).lower()) if p]


def secret_name(name) -> bool:
    """A name whose value is a secret: api_key, --admin-api-key, HF_TOKEN, DB_PASS, AWS_SECRET_ACCESS_KEY."""
    if not isinstance(name, str):
        return False
    parts = name_parts(name)
    if not parts or parts[-1] in PATH_LAST:
        return False
    return parts[-1] in SECRET_LAST or not SECRET_ANY.isdisjoint(parts)


def secret_value(value) -> bool:
    """A secret-named setting's value worth hiding: not unset, not a boolean, not already masked."""
    return isinstance(value, str) and value not in NOT_SECRET


# --------------------------------------------------------------------------- patterns

# NAME=value, NAME: value, 'name': 'value', "name": "value" (the value quoted or not).
# A name starts at no word character (a match tried inside every long word made the scan quadratic: minutes
# over one logged 40k-character prompt, before a rollback) and is at most 201 characters long.
ASSIGN = re.compile(
    r"""(?<![\w.])(?P<name>[A-Za-z_][\w.\-]{0,200})(?P<nq>['"]?)(?P<sep>[ \t]*[=:][ \t]*)"""
    r"""(?P<val>'(?:\\.|[^'\\\n])*'|"(?:\\.|[^"\\\n])*"|[^\s,;()}\]'"]+)"""
)
# A secret-named bare value runs on past a '(' (ab(cd is one password); any other stops there, so that the
# assignment inside is found: server_args=ServerArgs(api_key='k'), as SGLang logs it at start.
BARE = re.compile(r"""[^\s,;)}\]'"]+""")


def _assignments(text: str):
    """(name, the value's start and end, the quote, the value inside it) of each assignment ASSIGN finds, and of
    those inside another name's value, scanned once more from its start (inside its quote): Environment="HF_TOKEN=k",
    Environment=HF_TOKEN=k (as systemctl show prints it), url=http://h/?token=k, ARGS=--api-key=k."""
    pos = 0
    while (m := ASSIGN.search(text, pos)) is not None:
        quote, bare = _unquoted(m["val"])
        start, end = m.span("val")
        if not quote and secret_name(m["name"]):
            end = BARE.match(text, start).end()
            bare = text[start:end]
        yield m, start, end, quote, bare
        pos = end if secret_name(m["name"]) else start + 1 if quote else start


# --flag value, and the flag and its value as items of a list ('--api-key', 'x').
FLAG = re.compile(r"""(?P<flag>--[A-Za-z][\w\-]*)(?P<sep>[ \t]+|['"]?[ \t]*,[ \t]*['"]?)(?P<val>[^\s'",\]]+)""")
BEARER = re.compile(r"(?i)\b(?P<kind>bearer)[ \t]+(?P<val>[A-Za-z0-9._~+/=\-]{8,})")
# Authorization: Basic|Bearer|Token <credentials> (a header logged whole).
AUTHORIZATION = re.compile(
    r"""(?i)(?P<head>\bauthorization['"]?[ \t]*[:=][ \t]*['"]?)(?P<kind>(?:basic|bearer|token|digest)[ \t]+)?(?P<val>[^\s'",]+)"""
)
URL_CREDENTIALS = re.compile(r"(?<=://)[^/\s:@'\"]+:[^/\s@'\"]+@")


def _unquoted(val: str) -> tuple[str, str]:
    """(the quote, the value inside it) of a quoted value; ("", val) of a bare one."""
    if len(val) >= 2 and val[0] in "'\"" and val[-1] == val[0]:
        return val[0], val[1:-1]
    return "", val


def _flag(m: re.Match) -> str:
    if not secret_name(m["flag"]) or m["val"].startswith("--") or not secret_value(m["val"]):
        return m.group(0)
    return f"{m['flag']}{m['sep']}{MASK}"


def patterns(text: str) -> str:
    """text with every secret-looking value replaced: secret-named assignments and flags, bearer tokens,
    Authorization headers, URL credentials."""
    out, pos = [], 0
    for m, start, end, quote, bare in _assignments(text):
        if secret_name(m["name"]) and secret_value(bare):
            out += [text[pos:start], f"{quote}{MASK}{quote}"]
            pos = end
    text = "".join(out) + text[pos:]
    text = FLAG.sub(_flag, text)
    text = BEARER.sub(lambda m: f"{m['kind']} {MASK}", text)
    text = AUTHORIZATION.sub(lambda m: f"{m['head']}{m['kind'] or ''}{MASK}", text)
    return URL_CREDENTIALS.sub(MASK + "@", text)


def clip(text: str, n: int, redact: Callable[[str], str] = patterns, last: bool = False) -> str:
    """text masked, then cut to its first n characters (its last n with last). Cut first, a secret split at the
    cut escapes both the patterns (its name is cut away) and a known value's mask (only part of it is left).

    redact: a Redactor's text where one is at hand (it knows the values as well); the patterns otherwise."""
    text = redact(text)
    return text[-n:] if last else text[:n]


def argv_secrets(argv: list[str]) -> list[str]:
    """The values of secret-named flags in a command line (--api-key X, --admin-api-key=X, --hf-token X)."""
    out = []
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if not flag.startswith("--") or not secret_name(flag):
            continue
        if eq:
            out.append(value)
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out.append(argv[i + 1])
    return out


def masked(argv: list[str]) -> list[str]:
    """argv with the value of every secret-named flag replaced: what is compared, recorded and reported."""
    out = []
    hide = False
    for arg in argv:
        if hide:
            out.append(MASK)
            hide = False
            continue
        flag, eq, _ = arg.partition("=")
        if flag.startswith("--") and secret_name(flag):
            out.append(f"{flag}={MASK}" if eq else flag)
            hide = not eq
        else:
            out.append(arg)
    return out


def named_secrets(obj) -> list[str]:
    """The values of secret-named keys at any depth of a mapping or list (an instance record's env: HF_TOKEN)."""
    out = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            if secret_name(k) and secret_value(v):
                out.append(v)
            else:
                out += named_secrets(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            out += named_secrets(v)
    return out


def file_secrets(text: str) -> list[str]:
    """Values of secret-named assignments in a unit or environment file (Environment="HF_TOKEN=...")."""
    out = []
    for m, _, _, _, val in _assignments(text):
        if secret_name(m["name"]) and secret_value(val):
            out.append(val)
    return out


# --------------------------------------------------------------------------- known values


def _escaped(value: str) -> set[str]:
    env = value.replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$")  # an env file's "..." (systemd)
    return {
        value,
        repr(value)[1:-1],  # SGLang logs ServerArgs(api_key='a\\b')
        json.dumps(value)[1:-1],
        json.dumps(value, ensure_ascii=False)[1:-1],
        env,
        env.replace("%", "%%"),  # a unit's Environment= (systemd specifiers)
        # a value with a byte that is not UTF-8 (a command line's: Python decodes it to a surrogate), as forms' base64
        urllib.parse.quote(value, safe="", errors="surrogatepass"),
        urllib.parse.quote_plus(value, safe="", errors="surrogatepass"),
        shlex.quote(value),
    }


def forms(value: str) -> set[str]:
    """The forms a value is logged in: as is, in a Python repr, in JSON, in an env or unit file, URL-quoted,
    shell-quoted; each of those once more inside a repr or JSON (a journal line in a JSON result); the base64 of
    the whole value (padded or not, standard or URL-safe alphabet)."""
    once = _escaped(value)
    out = once | {json.dumps(f)[1:-1] for f in once} | {repr(f)[1:-1] for f in once}
    if len(value) >= BASE64_MIN:
        raw = value.encode("utf-8", "surrogatepass")
        for coded in (base64.b64encode(raw).decode("ascii"), base64.urlsafe_b64encode(raw).decode("ascii")):
            out |= {coded, coded.rstrip("=")}
    out.discard("")
    return out


class Redactor:
    """Removes secrets from text and data: known values in every form they are logged in (values, scrub), and
    with the patterns above as well (text, data).

    strong: values known to be secret (a secrets file's, an `-e` secret's), replaced whatever their length;
    weak: values found by their name elsewhere, replaced from WEAK_MIN characters."""

    def __init__(self, strong: Iterable[str] = (), weak: Iterable[str] = ()):
        raw = {v for v in strong if v} | {v for v in weak if v and len(v) >= WEAK_MIN}
        self.raw = sorted(raw, key=len, reverse=True)
        every = set().union(*(forms(v) for v in raw)) if raw else set()
        # Longest first: a value that contains another, or a form that contains another, is replaced whole.
        alternatives = "|".join(re.escape(v) for v in sorted(every, key=len, reverse=True))
        self.known = re.compile(alternatives) if every else None

    def values(self, text: str) -> str:
        """text with every known value replaced, in any of its forms."""
        return self.known.sub(MASK, text) if self.known is not None else text

    def text(self, text: str) -> str:
        """text with every known value and every secret-looking one replaced."""
        return patterns(self.values(text))

    def scrub(self, obj):
        """A JSON-able value (a module's result, an event) with every known value replaced in its strings."""
        if isinstance(obj, str):
            return self.values(obj)
        if isinstance(obj, dict):
            return {k: self.scrub(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [self.scrub(v) for v in obj]
        return obj

    def data(self, obj):
        """A JSON-able value with every string redacted (text), and the value of every secret-named key masked."""
        if isinstance(obj, str):
            return self.text(obj)
        if isinstance(obj, dict):
            return {str(k): MASK if secret_name(str(k)) and secret_value(v) else self.data(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [self.data(v) for v in obj]
        return obj

    def leaks(self, text: str) -> bool:
        """A known secret is still in the text (a bug in the patterns above): what holds it is withheld."""
        return any(v in text for v in self.raw)
