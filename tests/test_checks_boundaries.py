"""Verify's measured checks at, below and above each boundary, and the drift it reports flag by flag (issue #31: the
behaviours behind the mutants the unit suite let survive in sglang_deploy/checks.py).

The server's answers are replaced at the http layer (checks.http); everything above it is the real code. Each
detail is read by an operator deciding whether to roll back, so it is checked as written.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import checks, http
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.checks import Checks, Thresholds
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.instance import Instance
from support.modules import instance_record

KEY = "k-lab-77"


@pytest.fixture
def inst(tmp_path) -> Instance:
    return Instance.from_params(instance_record(tmp_path, port=30123, state_dir=str(tmp_path / "state")))


class Server:
    """/generate answering each request with the next of `runs` (seconds, tokens, accept length); what was asked."""

    def __init__(self, monkeypatch, runs, server_accept=None, fail: Exception | None = None):
        self.runs, self.asked, self.server_asked = list(runs), [], []
        self.server_accept, self.fail = server_accept, fail
        monkeypatch.setattr(checks.http, "generate", self.generate)
        monkeypatch.setattr(checks.http, "server_accept_length", self.accept)

    def generate(self, base, prompt, max_new_tokens, timeout=120.0, api_key=None):
        self.asked.append((base, prompt, max_new_tokens, api_key))
        if self.fail:
            raise self.fail
        seconds, tokens, accept = self.runs.pop(0)
        return {"text": "x", "completion_tokens": tokens, "seconds": seconds, "accept_length": accept}

    def accept(self, base, info, api_key=None):
        self.server_asked.append((base, info, api_key))
        return self.server_accept


def load(inst, t: Thresholds, algo="EAGLE3", info=None):
    c, extra = Checks(), {}
    checks.load_checks(inst, t, c, extra, info if info is not None else {"k": 1}, algo, KEY)
    return {x["name"]: x for x in c.items}, extra


def test_the_load_asks_the_configured_prompt_and_length_with_the_key_and_measures_tokens_per_second(inst, monkeypatch):
    s = Server(monkeypatch, [(1.0, 40, 2.0), (2.0, 60, 3.0)])
    t = Thresholds(prompt="Say hi", load_requests=2, load_max_new_tokens=48)
    got, extra = load(inst, t)
    assert s.asked == [("http://127.0.0.1:30123", "Say hi", 48, KEY)] * 2
    assert extra == {"tokens_per_s": 33.3, "accept_length": 2.5}  # 100 tokens / 3 s; (2 + 3) / 2
    assert got["accept_length"]["ok"] and got["accept_length"]["detail"].startswith(
        "average accept length 2.5 over 2 requests (threshold 1.5; "
    )


def test_a_load_answered_in_no_time_is_not_a_division_by_zero(inst, monkeypatch):
    Server(monkeypatch, [(0.0, 64, 2.0)])
    _, extra = load(inst, Thresholds(load_requests=1))
    assert extra["tokens_per_s"] > 1e9  # 64 tokens in (almost) no time


def test_numbers_are_rounded_as_reported(inst, monkeypatch):
    Server(monkeypatch, [(3.0, 100, 1.23456)])
    got, extra = load(inst, Thresholds(load_requests=1, accept_length_min=1.0))
    assert extra == {"tokens_per_s": 33.3, "accept_length": 1.235}
    assert got["accept_length"]["detail"].startswith("average accept length 1.23 over 1 requests")


def test_requests_without_an_accept_length_are_left_out_of_the_average(inst, monkeypatch):
    s = Server(monkeypatch, [(1.0, 10, None), (1.0, 10, 4), (1.0, 10, "n/a")], server_accept=9.0)
    _, extra = load(inst, Thresholds(load_requests=3))
    assert extra["accept_length"] == 4.0 and s.server_asked == []


def test_with_no_request_reporting_one_the_servers_own_average_is_asked_with_the_key(inst, monkeypatch):
    s = Server(monkeypatch, [(1.0, 10, None)], server_accept=2.25)
    got, extra = load(inst, Thresholds(load_requests=1), info={"internal_states": []})
    assert s.server_asked == [("http://127.0.0.1:30123", {"internal_states": []}, KEY)]
    assert extra["accept_length"] == 2.25 and got["accept_length"]["ok"]


def test_no_accept_length_anywhere_fails_the_check_saying_so(inst, monkeypatch):
    Server(monkeypatch, [(1.0, 10, None)], server_accept=None)
    got, extra = load(inst, Thresholds(load_requests=1))
    assert extra["accept_length"] is None
    assert not got["accept_length"]["ok"] and got["accept_length"]["severity"] == "fail"
    assert got["accept_length"]["detail"].startswith("average accept length None over 1 requests")


def test_without_speculation_there_is_no_accept_length_check(inst, monkeypatch):
    s = Server(monkeypatch, [(1.0, 10, 1.0)], server_accept=1.0)
    got, extra = load(inst, Thresholds(load_requests=1, no_spec_tokens_per_s=50.0), algo=None)
    assert got == {} and extra == {"tokens_per_s": 10.0} and s.server_asked == []


@pytest.mark.parametrize(("accept", "ok"), [(1.49, False), (1.5, False), (1.51, True)])
def test_accept_length_must_be_above_its_threshold(inst, monkeypatch, accept, ok):
    """At the threshold is a failure: 1.5 (the default) is what a draft accepted half the time gives."""
    Server(monkeypatch, [(1.0, 10, accept)])
    got, _ = load(inst, Thresholds(load_requests=1))
    assert got["accept_length"]["ok"] is ok and got["accept_length"]["severity"] == ("ok" if ok else "fail")


@pytest.mark.parametrize(
    ("tokens", "ok", "detail"),
    [
        (89.9, False, "89.9 tok/s against the profile's baseline 100 (-10.1 %)"),
        (90.0, True, "90.0 tok/s against the profile's baseline 100 (-10.0 %)"),
        (112.5, True, "112.5 tok/s against the profile's baseline 100 (+12.5 %)"),
    ],
)
def test_throughput_against_the_profiles_baseline_at_its_regression_threshold(inst, monkeypatch, tokens, ok, detail):
    Server(monkeypatch, [(1.0, tokens, 2.0)])
    t = Thresholds(load_requests=1, baseline_tokens_per_s=100.0, regression_threshold=0.1, regression_action="warn")
    got, _ = load(inst, t)
    check = got["throughput_vs_profile_baseline"]
    assert (check["ok"], check["severity"], check["detail"]) == (ok, "ok" if ok else "warn", detail)


def test_a_regression_the_profile_says_fails_is_a_failure(inst, monkeypatch):
    Server(monkeypatch, [(1.0, 50.0, 2.0)])
    t = Thresholds(load_requests=1, baseline_tokens_per_s=100.0, regression_action="fail")
    c, extra = Checks(), {}
    checks.load_checks(inst, t, c, extra, {}, "EAGLE3", KEY)
    assert c.result()["failed_checks"] == [
        "throughput_vs_profile_baseline: 50.0 tok/s against the profile's baseline 100 (-50.0 %)"
    ]


@pytest.mark.parametrize(
    ("tokens", "ok", "detail"),
    [
        (79.0, False, "79.0 tok/s with speculation against 80 without (-1.2 %)"),
        (80.0, True, "80.0 tok/s with speculation against 80 without (+0.0 %)"),
        (120.0, True, "120.0 tok/s with speculation against 80 without (+50.0 %)"),
    ],
)
def test_speculation_must_be_no_slower_than_without(inst, monkeypatch, tokens, ok, detail):
    Server(monkeypatch, [(1.0, tokens, 2.0)])
    got, _ = load(inst, Thresholds(load_requests=1, no_spec_tokens_per_s=80.0, regression_action="warn"))
    check = got["throughput_vs_no_speculation"]
    assert (check["ok"], check["severity"], check["detail"]) == (ok, "ok" if ok else "warn", detail)


def test_a_failed_load_is_a_failed_check_with_the_cause(inst, monkeypatch):
    Server(monkeypatch, [], fail=http.HttpError("/generate: HTTP 503"))
    got, extra = load(inst, Thresholds(load_requests=2, baseline_tokens_per_s=100.0))
    assert list(got) == ["load"] and extra == {}
    assert got["load"] == {
        "name": "load",
        "ok": False,
        "severity": "fail",
        "detail": "the measuring load failed: /generate: HTTP 503",
    }


def test_health_generate_gets_a_minute_and_its_failure_is_named(inst, monkeypatch):
    """/health_generate runs a generation, which may queue behind the load: it gets 60 s, twice http's default."""
    asked = []

    def request(url, body=None, timeout=30.0, api_key=None):
        asked.append((url, timeout, api_key))
        raise http.HttpError(f"{url}: timed out")

    monkeypatch.setattr(checks.http, "request", request)
    Server(monkeypatch, [], fail=http.HttpError("/generate: refused"))
    monkeypatch.setattr(Instance, "api_key", lambda self: KEY)
    c = Checks()
    checks.http_checks(inst, Thresholds(), c, {})
    assert asked == [("http://127.0.0.1:30123/health_generate", 60, KEY)]
    assert c.items[0] == {
        "name": "health_generate",
        "ok": False,
        "severity": "fail",
        "detail": "http://127.0.0.1:30123/health_generate: timed out",
    }
    assert c.items[1]["name"] == "generate" and c.items[1]["detail"] == "/generate: refused"


@pytest.mark.parametrize(
    ("expected", "running", "said"),
    [
        (["/a/python", "--x", "1"], [], "no main process"),
        (["/a/python", "--x", "1"], ["/b/python", "--x", "1"], "program: configured '/a/python', running '/b/python'"),
        (["--x", "1"], ["/b/python", "--x", "1"], "program: configured '', running '/b/python'"),
        (["p", "--x=1", "--y"], ["p", "--x", "1", "--y"], "same flags in another order"),
        (["p", "--x", "1", "2"], ["p", "--x", "1"], "--x: configured '1 2', running '1'"),
        (["p", "--flag"], ["p", "--flag", "v"], "--flag: configured '', running 'v'"),
        (["p", "--x", "1"], ["p"], "--x: configured '1', not running"),
        (["p"], ["p", "--z"], "--z: not configured, running ''"),
        (
            ["p", "--x", "1", "--y"],
            ["q", "--x", "2"],
            "program: configured 'p', running 'q'; --x: configured '1', running '2'; --y: configured '', not running",
        ),
    ],
)
def test_drift_says_what_differs_flag_by_flag(expected, running, said):
    assert checks.drift_summary(expected, running) == said


def test_flags_of_groups_each_flags_words_and_the_program_before_them():
    assert checks.flags_of(["p", "-m", "mod", "--a=1", "--b", "x", "y", "--c"]) == {
        "": "p -m mod",
        "--a": "1",
        "--b": "x y",
        "--c": "",
    }
    assert checks.flags_of(["--a", "v=w"]) == {"": "", "--a": "v=w"}


class Endpoints:
    """/health_generate, /generate and /server_info as http_checks reads them; what each was asked."""

    def __init__(self, monkeypatch, text="Paris. " * 12, info=None, info_error=None, accept=None):
        self.asked: list[tuple] = []
        self.text, self.info, self.info_error, self.accept = text, info or {}, info_error, accept
        monkeypatch.setattr(checks.http, "request", lambda url, **kw: (200, b""))
        monkeypatch.setattr(checks.http, "generate", self.generate)
        monkeypatch.setattr(checks.http, "get_json", self.get_json)
        monkeypatch.setattr(checks.http, "server_accept_length", self.server_accept)

    def generate(self, base, prompt, max_new_tokens, timeout=120.0, api_key=None):
        self.asked.append(("generate", prompt, max_new_tokens))
        return {"text": self.text, "completion_tokens": max_new_tokens, "seconds": 1.0, "accept_length": None}

    def get_json(self, url, timeout=30.0, api_key=None):
        if self.info_error:
            raise self.info_error
        return self.info

    def server_accept(self, base, info, api_key=None):
        self.asked.append(("server_accept_length", info))
        return self.accept


def run_http(inst, t, monkeypatch, **kw):
    e = Endpoints(monkeypatch, **kw)
    c, extra = Checks(), {}
    checks.http_checks(inst, t, c, extra)
    return e, {x["name"]: x for x in c.items}, extra, c


def test_the_generate_check_asks_the_configured_prompt_and_quotes_the_answers_start(inst, monkeypatch):
    e, got, _, _ = run_http(inst, Thresholds(prompt="Name a capital", max_new_tokens=12, load_requests=0), monkeypatch)
    assert e.asked == [("generate", "Name a capital", 12)]
    assert got["generate"]["ok"] and got["generate"]["detail"] == "12 tokens: " + repr(("Paris. " * 12)[:60])


def test_no_load_is_measured_when_none_is_asked_and_one_request_is_a_load(inst, monkeypatch):
    inst.argv = [*inst.argv, "--speculative-algorithm", "EAGLE3"]
    info = {"speculative_algorithm": "EAGLE3", "internal_states": [{"avg_spec_accept_length": 2.0}]}
    e, got, extra, _ = run_http(inst, Thresholds(load_requests=0), monkeypatch, info=info, accept=2.0)
    assert "accept_length" not in got and extra == {} and len(e.asked) == 1
    e, got, extra, _ = run_http(inst, Thresholds(load_requests=1), monkeypatch, info=info, accept=2.0)
    # the request reports no accept length: the server's own, from the /server_info this check read
    assert e.asked[-1] == ("server_accept_length", info) and extra["accept_length"] == 2.0


def test_an_unreadable_server_info_is_a_failed_check_of_its_own(inst, monkeypatch):
    inst.argv = [*inst.argv, "--speculative-algorithm", "EAGLE3"]
    _, got, _, c = run_http(
        inst, Thresholds(load_requests=0), monkeypatch, info_error=http.HttpError("/server_info: HTTP 500")
    )
    assert got["server_info"] == {
        "name": "server_info",
        "ok": False,
        "severity": "fail",
        "detail": "/server_info: HTTP 500",
    }
    assert not got["speculative_algorithm"]["ok"]  # nothing read: not the configured algorithm
    assert "server_info: /server_info: HTTP 500" in c.result()["failed_checks"]


def test_a_warning_leaves_the_verdict_ok_and_is_listed_apart_from_the_failures():
    c = Checks()
    c.add("unit", True, "active")
    c.add("throughput_vs_profile_baseline", False, "80.0 tok/s against 100", "warn")
    out = c.result(tokens_per_s=80.0)
    assert out["ok"] is True and out["warnings"] == ["80.0 tok/s against 100"] and out["failed_checks"] == []
    assert out["tokens_per_s"] == 80.0 and [x["severity"] for x in out["checks"]] == ["ok", "warn"]
    c.add("generate", False, "HTTP 500")
    out = c.result()
    assert out["ok"] is False and out["warnings"] == ["80.0 tok/s against 100"]
    assert out["failed_checks"] == ["generate: HTTP 500"]


class Ports:
    """systemd, /proc and nvidia-smi as verify reads them, for a rank above 0 (no HTTP)."""

    def __init__(self, tmp_path, props=None, running=None, processes=()):
        self.lock_dir = str(tmp_path / "run" / "locks")
        self.props = {"ActiveState": "active", "SubState": "running", "NRestarts": 0, "MainPID": 4100, **(props or {})}
        self.running, self.processes = running, list(processes)

    def show(self, unit):
        return self.props

    def cmdline(self, pid):
        assert pid, "no main process: nothing to read"
        return self.running

    def snapshot(self):
        return {"gpus": [{"index": i, "memory_used_mib": 100 * i} for i in range(4)], "processes": self.processes}


@pytest.fixture
def rank1(tmp_path) -> Instance:
    return Instance.from_params(
        instance_record(tmp_path, port=30123, state_dir=str(tmp_path / "state"), nnodes=2, node_rank=1)
    )


def verified(inst, ports) -> dict:
    out = checks.verify(inst, Thresholds(), ports, patch_manifest=None)
    return {**out, "by_name": {c["name"]: c for c in out["checks"]}}


def put_back(ports: Ports, count: int) -> None:
    from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import boot

    path = boot.marker("m", boot.beside(ports.lock_dir, boot.PUT_BACK_DIR))
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as fh:
        json.dump({"count": count, "generation": "000004-x"}, fh)


@pytest.mark.parametrize(("restarts", "put_backs", "ok"), [(0, 0, True), (1, 0, False), (1, 1, True), (2, 1, False)])
def test_restarts_the_boot_guard_caused_are_no_crash_and_are_said(rank1, tmp_path, restarts, put_backs, ok):
    ports = Ports(tmp_path, {"NRestarts": restarts}, running=rank1.argv)
    if put_backs:
        put_back(ports, put_backs)
    unit = verified(rank1, ports)["by_name"]["unit"]
    said = f"sglang-m.service active/running, restarted {restarts} times since started"
    if put_backs:
        said += " (1 by the boot guard, which put back known-good generation 000004-x)"
    assert (unit["ok"], unit["detail"]) == (ok, said)


def test_drift_is_ok_for_the_rendered_command_line_and_names_what_differs_otherwise(rank1, tmp_path):
    same = verified(rank1, Ports(tmp_path, running=list(rank1.argv)))
    assert same["by_name"]["drift"] == {
        "name": "drift",
        "ok": True,
        "severity": "ok",
        "detail": "running profile default",
    }
    other = [*rank1.argv[:-1], "30999"]
    got = verified(rank1, Ports(tmp_path, running=other))["by_name"]["drift"]
    assert not got["ok"] and got["detail"] == (
        "running command line differs from the rendered configuration: --port: configured '30123', running '30999'; "
        "running profile: none of the known profiles (launched by hand?)"
    )
    gone = verified(rank1, Ports(tmp_path, {"MainPID": 0, "ActiveState": "inactive", "SubState": "dead"}))
    assert gone["by_name"]["drift"]["detail"].startswith(
        "running command line differs from the rendered configuration: no main process;"
    )
    assert gone["running_profile"] is None and gone["node_rank"] == 1 and not gone["ok"]
    assert (gone["tokens_per_s"], gone["accept_length"]) == (None, None)  # a rank above 0 measures nothing


def test_verify_reads_the_patch_manifest_it_is_given_when_the_unit_runs_no_generation_of_its_own(rank1, tmp_path):
    bad = tmp_path / "patches.json"
    bad.write_text("{not json")
    out = checks.verify(rank1, Thresholds(), Ports(tmp_path, running=rank1.argv), patch_manifest=str(bad))
    assert out["failed_checks"][0].startswith(f"patches: the patch manifest {bad} cannot be read")


def test_gpu_processes_are_judged_on_the_instances_gpus_only(rank1, tmp_path):
    ours = {"pid": 4100, "gpu": 0, "used_mib": 100, "unit": "sglang-m.service", "user": "sglang"}
    elsewhere = {"pid": 77, "gpu": 3, "used_mib": 900, "unit": "other.service", "user": "bob"}
    stranger = {"pid": 78, "gpu": 1, "used_mib": 500, "unit": None, "user": "bob", "cmdline": "python x.py"}
    clean = verified(rank1, Ports(tmp_path, running=rank1.argv, processes=[ours, elsewhere]))
    assert clean["by_name"]["gpu_processes"]["detail"] == "1 processes of sglang-m.service on GPUs [0, 1]"
    assert clean["gpu_memory_mib"] == {0: 0, 1: 100} and clean["ok"]
    other = {**stranger, "pid": 79, "gpu": 0, "unit": "x.service"}
    held = verified(rank1, Ports(tmp_path, running=rank1.argv, processes=[ours, elsewhere, stranger, other]))
    assert held["by_name"]["gpu_processes"]["detail"] == (
        "not the service's: GPU 1: pid 78 holds 500 MiB (user bob, unit ?, command python x.py); "
        "GPU 0: pid 79 holds 500 MiB (user bob, unit x.service, command python x.py)"
    )
    assert held["failed_checks"] == [f"gpu_processes: {held['by_name']['gpu_processes']['detail']}"]


def manifest(tmp_path, files: dict, patches=None, site=True) -> str:
    doc = {"files": files, "patches": patches if patches is not None else []}
    if site:
        doc["site_packages"] = str(tmp_path / "site")
    path = tmp_path / "patches.json"
    path.write_text(json.dumps(doc))
    return str(path)


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def test_the_patch_check_matches_each_file_and_a_file_the_series_deletes_by_its_absence(tmp_path):
    (tmp_path / "site" / "sglang").mkdir(parents=True)
    (tmp_path / "site" / "sglang" / "a.py").write_text("patched\n")
    files = {"sglang/a.py": {"after": sha("patched\n")}, "sglang/gone.py": {"after": None}}
    path = manifest(tmp_path, files, [{"name": "0001-fix.patch"}, {}])
    assert checks.patch_check(path) == ("patches", True, "2 patched files match the manifest (0001-fix.patch, ?)")
    (tmp_path / "site" / "sglang" / "gone.py").write_text("back\n")  # a file the series deletes, there again
    (tmp_path / "site" / "sglang" / "a.py").write_text("edited by hand\n")
    assert checks.patch_check(path) == (
        "patches",
        False,
        "installed files differ from the patch manifest: ['sglang/a.py', 'sglang/gone.py'] (reinstall: deploy.yml)",
    )


def test_a_patch_manifest_without_a_patch_list_or_site_packages(tmp_path):
    path = manifest(tmp_path, {}, None)
    doc = json.loads(Path(path).read_text())
    del doc["patches"]
    Path(path).write_text(json.dumps(doc))
    assert checks.patch_check(path) == ("patches", True, "0 patched files match the manifest ()")
    nosite = manifest(tmp_path, {"sglang/a.py": {"after": sha("x")}}, site=False)
    assert checks.patch_check(nosite)[1] is False


def test_an_unreadable_patch_manifest_fails_the_patches_check(tmp_path):
    bad = tmp_path / "patches.json"
    bad.write_bytes(b"{\xff")
    name, ok, detail = checks.patch_check(str(bad))
    assert (name, ok) == ("patches", False) and detail.startswith(f"the patch manifest {bad} cannot be read: ")
    assert checks.patch_check(str(tmp_path / "none.json")) == (
        "patches",
        True,
        f"no patch manifest at {tmp_path / 'none.json'} (no patch series applied)",
    )


def test_a_flags_value_may_hold_an_equals_sign():
    assert (
        checks.flag_value(["p", '--json-model-override-args={"a=b": 1}'], "--json-model-override-args") == '{"a=b": 1}'
    )
    assert checks.flag_value(["p", "--x", "1=2"], "--x") == "1=2" and checks.flag_value(["p", "--x"], "--x") is None
