"""systemd's own rules for what a unit file says, for tests that check what the renderer writes (issue #17).

Two ways to read a rendered unit or environment file back, used side by side:

- the documented rules, ported here: systemd.service(5) "Command lines" (words split on whitespace,
  "double" and 'single' quotes, C-style escapes, specifiers "%%", "$$" and ${VAR} at exec time) and
  systemd.exec(5) EnvironmentFile= (double-quoted values: a backslash before one of ` $ " \\ is dropped,
  before anything else it stays; values may span lines). Anything the renderer must never produce (an
  unknown escape, a specifier other than %%, an unescaped variable, an unquoted ";") raises ValueError;
- systemd itself, where it is installed: `systemd --test` loads a unit exactly as PID 1 does and dumps
  each command's argv (before the exec-time "$" expansion); the user environment generator reads an
  environment file with the EnvironmentFile= parser (then expands "$", so only "$"-free values compare).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

WHITESPACE = " \t\n\r"
# cunescape_one(): the C escapes systemd accepts in a command line word.
SIMPLE_ESCAPES = {
    "a": "\a",
    "b": "\b",
    "f": "\f",
    "n": "\n",
    "r": "\r",
    "t": "\t",
    "v": "\v",
    "\\": "\\",
    '"': '"',
    "'": "'",
    "s": " ",
}
# SHELL_NEED_ESCAPE: in a double-quoted EnvironmentFile value, a backslash before one of these is dropped.
SHELL_NEED_ESCAPE = '"\\`$'
SYSTEMD = "/lib/systemd/systemd"
ENVIRONMENT_D_GENERATOR = "/usr/lib/systemd/user-environment-generators/30-systemd-environment-d-generator"


# ------------------------------------------------------------------------------------------ command lines


def _unescape(text: str, i: int) -> tuple[str, int]:
    """The C escape at text[i] (just past the backslash): its character and the index after it."""
    if i >= len(text):
        raise ValueError("a backslash at the end of a command line")
    c = text[i]
    if c in SIMPLE_ESCAPES:
        return SIMPLE_ESCAPES[c], i + 1
    if c == "x":
        digits = text[i + 1 : i + 3]
        if len(digits) != 2 or any(d not in "0123456789abcdefABCDEF" for d in digits) or int(digits, 16) == 0:
            raise ValueError(f"invalid escape \\x{digits}")
        return chr(int(digits, 16)), i + 3
    raise ValueError(f"an escape systemd refuses in a command line: \\{c}")


def split_command_line(value: str) -> list[str]:
    """An ExecStart= value split into words as systemd does (extract_first_word with UNQUOTE|CUNESCAPE):
    whitespace separates words; "..." and '...' quote; C escapes are resolved in and out of quotes."""
    words: list[str] = []
    i, n = 0, len(value)
    while True:
        while i < n and value[i] in WHITESPACE:
            i += 1
        if i >= n:
            return words
        if value[i] == ";" and (i + 1 == n or value[i + 1] in WHITESPACE):
            raise ValueError("an unquoted ';' word: systemd would start a second command there")
        word: list[str] = []
        quote = ""
        while i < n:
            c = value[i]
            if quote:
                if c == quote:
                    quote = ""
                    i += 1
                elif c == "\\":
                    ch, i = _unescape(value, i + 1)
                    word.append(ch)
                else:
                    word.append(c)
                    i += 1
            elif c in WHITESPACE:
                break
            elif c in "\"'":
                quote = c
                i += 1
            elif c == "\\":
                ch, i = _unescape(value, i + 1)
                word.append(ch)
            else:
                word.append(c)
                i += 1
        if quote:
            raise ValueError(f"unbalanced quoting in {value!r}")
        words.append("".join(word))


def resolve_specifiers(word: str) -> str:
    """ "%%" is "%"; any other specifier would be expanded by systemd: the renderer must never leave one."""
    out, i = [], 0
    while i < len(word):
        if word[i] == "%":
            if word[i + 1 : i + 2] != "%":
                raise ValueError(f"a specifier systemd would expand: {word[i : i + 2]!r} in {word!r}")
            out.append("%")
            i += 2
        else:
            out.append(word[i])
            i += 1
    return "".join(out)


def expand_variables(word: str, env: dict[str, str] | None = None) -> str:
    """What systemd does with "$" when it executes the command (replace_env): "$$" is "$", ${VAR} the variable's
    value. A word that is "$VAR" alone would be split on whitespace: a ValueError, as is any ${VAR} not in env."""
    if word.startswith("$") and word[1:2] not in ("{", "$", ""):
        raise ValueError(f"{word!r}: a whole-word variable, split by systemd at exec time")
    out, i = [], 0
    while i < len(word):
        if word.startswith("$$", i):
            out.append("$")
            i += 2
        elif word.startswith("${", i):
            end = word.find("}", i)
            name = word[i + 2 : end]
            if end < 0 or env is None or name not in env:
                raise ValueError(f"{word!r}: systemd would expand ${{{name}}} at exec time")
            out.append(env[name])
            i = end + 1
        else:
            out.append(word[i])
            i += 1
    return "".join(out)


def exec_argv(value: str, env: dict[str, str] | None = None) -> list[str]:
    """The argv systemd executes for an ExecStart= value (no prefix such as "-" or "@" allowed)."""
    words = [resolve_specifiers(w) for w in split_command_line(value)]
    if not words or not words[0].startswith("/"):
        raise ValueError(f"{value!r}: the command is not an absolute path (or carries a prefix)")
    # The executable's path is not subject to "$" expansion; argv[0] and the arguments are.
    return [expand_variables(w, env) for w in words]


def directive(unit_text: str, key: str) -> list[str]:
    """The values of every `key=` line of a unit file (no continuation lines: the renderer writes none)."""
    return [line.split("=", 1)[1] for line in unit_text.splitlines() if line.startswith(key + "=")]


# ------------------------------------------------------------------------------------------ environment files


def environment_file(text: str) -> dict[str, str]:
    """An EnvironmentFile= as systemd reads it (parse_env_file_internal, systemd.exec(5)): NAME=value lines, '#'
    and ';' comments, values unquoted, 'single-quoted' (verbatim) or "double-quoted" (a backslash before one of
    ` $ " \\ is dropped, before a newline both go, before anything else it stays); quoted values span lines."""
    out: dict[str, str] = {}
    state, key, value = "pre_key", [], []
    trailing_ws: int | None = None  # where the unquoted value's trailing whitespace starts

    def push() -> None:
        v = "".join(value[:trailing_ws] if trailing_ws is not None else value)
        out["".join(key).rstrip(WHITESPACE)] = v

    for c in text:
        if state == "pre_key":
            if c in "#;":
                state = "comment"
            elif c not in WHITESPACE:
                state, key, value = "key", [c], []
        elif state == "key":
            if c in "\n\r":
                state = "pre_key"  # a line without "=": ignored
            elif c == "=":
                state, trailing_ws = "pre_value", None
            else:
                key.append(c)
        elif state == "pre_value":
            if c in "\n\r":
                push()
                state = "pre_key"
            elif c == "'":
                state = "single"
            elif c == '"':
                state = "double"
            elif c == "\\":
                state = "value_escape"
            elif c not in WHITESPACE:
                state = "value"
                value.append(c)
        elif state == "value":
            if c in "\n\r":
                push()
                state = "pre_key"
            elif c == "\\":
                state, trailing_ws = "value_escape", None
            else:
                if c not in WHITESPACE:
                    trailing_ws = None
                elif trailing_ws is None:
                    trailing_ws = len(value)
                value.append(c)
        elif state == "value_escape":
            state = "value"
            if c not in "\n\r":
                value.append(c)
        elif state == "single":
            if c == "'":
                state = "pre_value"
            else:
                value.append(c)
        elif state == "double":
            if c == '"':
                state = "pre_value"
            elif c == "\\":
                state = "double_escape"
            else:
                value.append(c)
        elif state == "double_escape":
            state = "double"
            if c in SHELL_NEED_ESCAPE:
                value.append(c)
            elif c != "\n":
                value += ["\\", c]
        elif state == "comment" and c in "\n\r":
            state = "pre_key"
    if state in ("pre_value", "value", "value_escape", "single", "double", "double_escape"):
        push()
    return out


# ------------------------------------------------------------------------------------------ systemd itself


def _dump_words(text: str) -> list[str]:
    """Words as systemd prints them (quote_command_line/shell_maybe_quote): bare, or "..." with C escapes (\\n,
    \\r, \\t) and a backslash before ` $ " \\."""
    words, i, n = [], 0, len(text)
    while i < n:
        if text[i] == " ":
            i += 1
            continue
        if text[i] != '"':
            end = text.find(" ", i)
            end = n if end < 0 else end
            words.append(text[i:end])
            i = end
            continue
        i += 1
        word = []
        while text[i] != '"':
            if text[i] == "\\" and text[i + 1] in "$`":
                word.append(text[i + 1])
                i += 2
            elif text[i] == "\\":
                ch, i = _unescape(text, i + 1)
                word.append(ch)
            else:
                word.append(text[i])
                i += 1
        words.append("".join(word))
        i += 1
    return words


def _unprivileged() -> list[str] | None:
    """`systemd --test` refuses to run as root: the command prefix that drops to nobody, or None if it can't."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    return [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"] if setpriv else None


def systemd_can_load_units() -> bool:
    return Path(SYSTEMD).exists() and Path("/lib/systemd/system").is_dir() and _unprivileged() is not None


def systemd_loaded_argv(unit_text: str, name: str, command: str = "ExecStart") -> list[str]:
    """The argv of the unit's `command` as systemd's unit loader parses it (`systemd --test` dumps it), before
    the exec-time "$" expansion (expand_variables does that)."""
    prefix = _unprivileged()
    assert prefix is not None
    with tempfile.TemporaryDirectory() as d:
        os.chmod(d, 0o755)
        path = Path(d) / name
        path.write_text(unit_text)
        path.chmod(0o644)
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": d,
            "SYSTEMD_UNIT_PATH": f"{d}:/lib/systemd/system",
        }
        proc = subprocess.run(
            [
                *prefix,
                "env",
                *[f"{k}={v}" for k, v in env.items()],
                SYSTEMD,
                "--test",
                "--system",
                f"--unit={name}",
                "--no-pager",
            ],
            capture_output=True,
            text=True,
            check=False,
            timeout=60,
            env=env,
        )
    lines = proc.stdout.splitlines()
    try:
        start = lines.index(f"\t-> Unit {name}:")
    except ValueError as exc:
        raise AssertionError(
            f"systemd --test did not load {name} (exit {proc.returncode}): {proc.stderr[-2000:]}"
        ) from exc
    block = []
    for line in lines[start + 1 :]:
        if line.startswith("\t-> Unit "):
            break
        block.append(line)
    at = block.index(f"\t\t-> {command}:")
    cmd = block[at + 1].strip()
    assert cmd.startswith("Command Line: "), block[at : at + 3]
    return _dump_words(cmd[len("Command Line: ") :])


def systemd_analyze_complaints(unit_text: str, name: str) -> list[str]:
    """`systemd-analyze verify` (as staging runs it) on the unit; its stderr lines and a non-zero exit."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / name
        path.write_text(unit_text)
        proc = subprocess.run(
            ["systemd-analyze", "verify", "--man=no", f"{path}:{name}"], capture_output=True, text=True, check=False
        )
    return [line for line in proc.stderr.splitlines() if line.strip()] + (
        [f"exit {proc.returncode}"] if proc.returncode else []
    )


def systemd_reads_environment_file(text: str) -> dict[str, str]:
    """The file as systemd's environment-file parser reads it, through the user environment generator (which
    reads environment.d with the same parser). It then expands "$": compare only "$"-free values."""
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "environment.d").mkdir()
        (Path(d) / "environment.d" / "50-test.conf").write_text(text)
        proc = subprocess.run(
            [ENVIRONMENT_D_GENERATOR],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
            env={"XDG_CONFIG_HOME": d, "HOME": d},
        )
    out = {}
    for line in proc.stdout.splitlines():
        name, _, quoted = line.partition("=")
        words = _dump_words(quoted) if quoted else [""]
        out[name] = words[0] if words else ""
    return out
