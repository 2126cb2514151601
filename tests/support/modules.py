"""plugins/modules/NAME.py run as Ansible runs it, and the small loopback fakes its tests need.

`run_module` starts the module file itself (runpy, under its own path, so coverage counts it) with its arguments
as Ansible passes them ({"ANSIBLE_MODULE_ARGS": ...} in a file) and collections/ on its PYTHONPATH, so that its
imports of ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy are this repository's files (as
Ansible ships them); its JSON result is returned with its exit status (0: exit_json, 1: fail_json).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from support import COLLECTIONS, REPO, env_with_pythonpath

LIBRARY = REPO / "plugins" / "modules"

# The prelude (argv[1]), then the module (argv[2]) with its argument file; the package comes from PYTHONPATH.
RUNNER = (
    "import sys, runpy; exec(sys.argv[1]); sys.argv = sys.argv[2:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)


def run_module(
    name: str,
    args: dict,
    workdir: Path,
    env: dict | None = None,
    check_mode: bool = False,
    prelude: str = "",
    timeout: float = 120,
) -> tuple[int, dict]:
    """(exit status, result) of plugins/modules/<name>.py; `prelude` is Python run first in the module's process."""
    payload = {**args, **({"_ansible_check_mode": True} if check_mode else {})}
    argfile = workdir / f"args-{name}-{os.urandom(4).hex()}.json"
    argfile.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": payload}))
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER, prelude, str(LIBRARY / f"{name}.py"), str(argfile)],
        env=env_with_pythonpath(dict(os.environ if env is None else env), COLLECTIONS),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=workdir,
    )
    assert proc.stdout.strip(), f"{name} printed no result (exit {proc.returncode}): {proc.stderr}"
    return proc.returncode, json.loads(proc.stdout)


def shim(bin_dir: Path, name: str, script: str) -> Path:
    """An executable `name` in bin_dir running the shell `script` (a stand-in for systemctl, nvidia-smi, ...)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    path = bin_dir / name
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(0o755)
    return path


def systemctl_shim(bin_dir: Path, props: dict, log: Path, rc: int = 0) -> Path:
    """A systemctl whose `show` prints props (NAME=value lines); every call is appended to log; exits rc."""
    lines = "".join(f"{k}={v}\\n" for k, v in props.items())
    script = [
        f'echo "$*" >> {shlex.quote(str(log))}',
        f'if [ "$1" = show ]; then printf {shlex.quote(lines)}; fi',
        f"exit {rc}",
    ]
    return shim(bin_dir, "systemctl", "\n".join(script) + "\n")


Handler = Callable[[str, str, dict, dict], tuple[int, object]]


@contextmanager
def http_server(handle: Handler) -> Iterator[tuple[str, list]]:
    """An HTTP server on 127.0.0.1 answering handle(method, path, JSON body, headers) -> (status, JSON or str);
    yields (its base URL, every (method, path) it was asked)."""
    seen: list[tuple[str, str]] = []

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def answer(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            seen.append((self.command, self.path))
            code, body = handle(self.command, self.path, json.loads(raw) if raw else {}, dict(self.headers))
            data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "text/plain" if isinstance(body, str) else "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_DELETE = answer

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", seen
    finally:
        srv.shutdown()
        srv.server_close()


def instance_record(root: Path, name: str = "m", port: int = 30000, argv: list[str] | None = None, **extra) -> dict:
    """A rendered instance record (filter sglang_instance's fields) whose files all lie under root."""
    unit = f"sglang-{name}.service"
    argv = argv or ["/opt/ml-env/bin/python", "-m", "sglang.launch_server", "--port", str(port)]
    return {
        "name": name,
        "unit": unit,
        "unit_path": str(root / "systemd" / unit),
        "env_path": str(root / "etc" / f"{name}.env"),
        "secrets_path": str(root / "etc" / "secrets" / f"{name}.env"),
        "pending_dir": str(root / "etc" / "pending"),
        "port": port,
        "gpus": [0, 1],
        "argv": argv,
        "profile": "default",
        "profiles_argv": {"default": argv},
        "nnodes": 1,
        "node_rank": 0,
        **extra,
    }


def lock_dir_prelude(lock_dir: Path) -> str:
    """run_module's prelude: the instance locks under lock_dir instead of the host's /run/sglang-deploy/locks."""
    return (
        "import ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.lock as lock; "
        "lock.InstanceLock.__init__.__defaults__ = (*lock.InstanceLock.__init__.__defaults__[:-1], "
        f"{str(lock_dir)!r})"
    )
