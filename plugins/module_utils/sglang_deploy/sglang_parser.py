"""SGLang's own parser, run under the instance's virtualenv, and its verdicts kept on the host.

One run of the installed SGLang's parser (and its environment registry) for every argv of a host: an import of
SGLang, seconds, the slow part of validation. A successful verdict is kept under <state_dir>/validated/
(VerdictCache), keyed by everything it depends on (cache_key: the installation's identity, argv, environment,
GPUs, port, user), and reused while nothing of that changed.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import stat
import subprocess
import time

from .durable import write_atomic
from .patch import PatchError, dist_info, installed_version
from .problems import ValidateError
from .secret_rule import clip

# Runs under the virtualenv's Python: SGLang's own parser and environment registry, once for
# every argv given (one import of SGLang for all the host's instances).
PARSE = r"""
import argparse, json, sys
real_stdout, sys.stdout = sys.stdout, sys.stderr  # whatever SGLang prints must not spoil the answer
from sglang.srt.server_args import ServerArgs

class Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ValueError(message)

req = json.load(sys.stdin)
parser = Parser(prog="sglang.launch_server", allow_abbrev=False)
ServerArgs.add_cli_args(parser)
options = sorted(s for a in parser._actions for s in a.option_strings if s.startswith("--"))
try:
    from sglang.srt.environ import envs
    env_names = sorted(n for n in dir(envs) if n.isupper())
except Exception:  # an SGLang without the registry
    env_names = None
results = []
for argv in req["argvs"]:
    out = {"error": None, "args": None}
    try:
        ns = parser.parse_args(argv)
        out["args"] = {k: v for k, v in vars(ns).items() if isinstance(v, (str, int, float, bool, type(None), list))}
    except ValueError as exc:
        out["error"] = str(exc)
    if out["error"] is None and out["args"].get("speculative_algorithm"):
        try:
            from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
            SpeculativeAlgorithm.from_string(out["args"]["speculative_algorithm"])
        except ValueError as exc:
            out["error"] = "argument --speculative-algorithm: " + str(exc)
        except Exception:  # registry not importable here: the parser's verdict stands
            pass
    results.append(out)
json.dump({"options": options, "env_names": env_names, "results": results}, real_stdout)
"""
PARSE_TIMEOUT_S = 600

# The parser verdicts kept on the host.
CACHE_DIR = "validated"
CACHE_KEEP = 64
# Part of every cache key: a change to the parser script, or to what the key covers, starts afresh.
CACHE_SCHEMA = hashlib.sha256(("1\0" + PARSE).encode("utf-8")).hexdigest()[:16]


def run_parser(python, argvs, timeout=PARSE_TIMEOUT_S):
    """One run of SGLang's parser for every argv: a list of {error, args, options, env_names}."""
    try:
        proc = subprocess.run(
            [python, "-c", PARSE],
            input=json.dumps({"argvs": argvs}),
            text=True,
            capture_output=True,
            check=False,
            timeout=timeout,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ValidateError(f"could not run SGLang's parser with {python}: {exc}") from exc
    if proc.returncode != 0:
        raise ValidateError(
            f"could not run SGLang's parser with {python}: {clip(proc.stderr.strip(), 2000, last=True)}"
        )
    try:
        out = json.loads(proc.stdout)
    except ValueError as exc:
        raise ValidateError(
            f"SGLang's parser under {python} answered no JSON: {clip(proc.stdout.strip(), 500, last=True)}"
        ) from exc
    return [{**r, "options": out["options"], "env_names": out["env_names"]} for r in out["results"]]


def sha256_of(path):
    try:
        with open(path, "rb") as fh:
            return hashlib.sha256(fh.read()).hexdigest()
    except OSError:
        return None


def installation_identity(python, patch_manifest=None, package="sglang"):
    """What identifies the SGLang installation `python` runs: the virtualenv (links resolved), the
    version, the hash of its dist-info RECORD and of the patch manifest; None when not found."""
    venv = os.path.dirname(os.path.dirname(python))
    for site in sorted(glob.glob(os.path.join(venv, "lib", "python*", "site-packages"))):
        try:
            info = dist_info(site, package)
            version = installed_version(info)
        except (PatchError, OSError):
            continue
        record = sha256_of(os.path.join(info, "RECORD"))
        if record is None:
            return None
        return {
            "venv": os.path.realpath(venv),
            "version": version,
            "record_sha256": record,
            "patch_manifest_sha256": sha256_of(patch_manifest) if patch_manifest else None,
        }
    return None


def cache_key(identity, python, argv, env, gpus, port, service_user):
    """sha256 of everything SGLang's parser verdict depends on."""
    blob = {
        "schema": CACHE_SCHEMA,
        "software": identity,
        "python": python,
        "argv": [str(a) for a in argv],
        "env": {str(k): str(v) for k, v in env.items()},
        "gpus": [int(g) for g in gpus],
        "port": int(port) if port is not None else None,
        "user": service_user,
    }
    return hashlib.sha256(json.dumps(blob, sort_keys=True, separators=(",", ":")).encode("utf-8")).hexdigest()


class VerdictCache:
    """Successful parser verdicts, one file per key: the directory 0700 and the files 0600, owned
    by the user the module runs as (root); the newest `keep` kept. A directory someone else owns or
    can write is not trusted: nothing is read from it or written to it."""

    def __init__(self, directory, keep=CACHE_KEEP):
        self.directory = directory
        self.keep = keep

    def _path(self, key):
        return os.path.join(self.directory, f"{key}.json")

    def _trusted(self):
        try:
            st = os.lstat(self.directory)
        except OSError:
            return False
        return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077

    def load(self, key, touch=True):
        """The parser's output kept for `key`, or None; `touch` marks it recently used (kept by prune)."""
        if not self._trusted():
            return None
        try:
            with open(self._path(key), encoding="utf-8") as fh:
                data = json.load(fh)
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict) or data.get("key") != key or not isinstance(data.get("parse"), dict):
            return None
        if touch:
            try:
                os.utime(self._path(key))
            except OSError:
                pass
        return data["parse"]

    def store(self, key, parse, name=""):
        """Keep a successful verdict; False when it could not be kept (the cache is only a shortcut)."""
        try:
            if not os.path.isdir(os.path.dirname(self.directory)):
                return False  # no state directory yet (the gpu_node role makes it): nothing to keep it in
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
            st = os.lstat(self.directory)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                return False
            if stat.S_IMODE(st.st_mode) != 0o700:
                os.chmod(self.directory, 0o700)
            doc = {"key": key, "instance": name, "stored": time.time(), "parse": parse}
            write_atomic(self._path(key), json.dumps(doc), 0o600)
            self.prune()
        except OSError:
            return False
        return True

    def prune(self):
        entries = []
        for entry in os.listdir(self.directory):
            if entry.endswith(".json"):
                try:
                    entries.append((os.stat(os.path.join(self.directory, entry)).st_mtime, entry))
                except OSError:
                    continue
        for _, entry in sorted(entries, reverse=True)[self.keep :]:
            try:
                os.unlink(os.path.join(self.directory, entry))
            except OSError:
                pass
