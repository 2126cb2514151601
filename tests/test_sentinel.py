"""The hung-worker sentinel (plugins/module_utils/sglang_deploy/sentinel.py, docs/router.md "Hung workers"): its rule
against a fake gateway and fake probes, its probe against a lab stand-in, and the whole against the real smg 1.13.0
on loopback, in front of a stand-in whose generations hang after two (LAB_STANDIN_HANG_AFTER, sglang#22779)."""

from __future__ import annotations

import json
import threading

import pytest

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import http
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import router as rt
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import sentinel as sn
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import worker_load as wl
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import worker_urls as wu
from support import wait_for
from support.smg import KEY, Gateway, all_ready, free_port, smg_venv


class FakeGateway:
    """What the sentinel uses of router.Router: the listing, remove, add, the gateway's in-flight count."""

    url = "http://gw:30000"

    def __init__(self, *urls: str, fail: str = ""):
        self.listed = {u: True for u in urls}  # url: healthy
        self.calls: list[tuple[str, str]] = []
        self.fail = fail

    def workers(self) -> list[dict]:
        if self.fail == "list":
            raise rt.RouterError("GET http://gw:30000/workers: connection refused")
        return [{"url": u, "healthy": h, "id": u} for u, h in self.listed.items()]

    def remove(self, url: str, missing_ok: bool = False) -> list[str]:
        self.calls.append(("remove", url))
        if self.fail == "remove":
            raise rt.RouterError("DELETE: HTTP 500")
        self.listed.pop(url, None)
        return [url]

    def add(self, url: str, timeout: float = 60.0) -> tuple[str, bool]:
        self.calls.append(("add", url))
        self.listed[url] = False  # listed, not healthy yet: the gateway's health check admits it
        return url, True

    def in_flight(self, url: str) -> float | None:
        return 3.0

    def resolver(self) -> wu.Resolver:
        """localhost is 127.0.0.1 (one worker, two spellings); other names resolve to nothing."""

        def getaddrinfo(host, *a, **kw):
            if host in ("localhost", "127.0.0.1"):
                return [(2, 1, 6, "", ("127.0.0.1", 0))]
            raise OSError(f"{host}: no such name")

        return wu.Resolver(getaddrinfo)


class Probes:
    """A probe per worker from a script: each round takes the next state (the last one repeats)."""

    def __init__(self, **script: str):
        self.script = {f"http://{k}:1": list(v) for k, v in script.items()}
        self.asked: list[str] = []

    def __call__(self, url: str) -> dict:
        self.asked.append(url)
        states = self.script.get(url, ["p"])
        s = states.pop(0) if len(states) > 1 else states[0]
        state = {"p": sn.PROGRESS, "s": sn.STALLED, "e": sn.ERROR}[s]
        return {"state": state, "seconds": 0.1 if s == "p" else None, "why": f"{state} (scripted)"}


A, B, C = "http://a:1", "http://b:1", "http://c:1"
RULE = sn.Settings(interval_s=1, stall_s=2, failures=3, successes=2)


def sentinel(gw, probes, tmp_path=None, held=None, **kw) -> tuple[sn.Sentinel, list[str]]:
    logs: list[str] = []
    s = sn.Sentinel(gw, kw.pop("settings", RULE), probe=probes, log=logs.append, **kw)
    s.held = held or (
        lambda url: {
            "requests": 5,
            "running": 4.0,
            "queued": 1.0,
            "gateway_in_flight": 3.0,
            "why": "4 running, 1 queued",
        }
    )
    if tmp_path is not None:
        s.state_path = str(tmp_path / "state.json")
    return s, logs


def test_a_worker_is_taken_out_on_the_failures_th_stall_in_a_row_and_what_it_held_is_reported():
    gw = FakeGateway(A, B)
    ticks = iter([100.0, 103.0, 106.0])  # the clock at each stall: a round every 3 s
    s, logs = sentinel(gw, Probes(a="sss", b="p"), clock=lambda: next(ticks))
    assert s.round() == [] and s.round() == []
    assert gw.calls == []  # two stalls of three: still in
    [e] = s.round()
    assert (e["event"], e["worker"], e["stalls"], e["held"]["requests"]) == ("taken_out", A, 3, 5)
    assert gw.calls == [("remove", A)] and A not in gw.listed
    assert logs == [
        "sentinel: http://a:1 taken out of http://gw:30000: no token in 2 s on 3 probes in a row (stalled about 8 s); "
        "it held 5 requests (4 running, 1 queued; the gateway counted 3.0 in flight): they fail or wait until it is "
        "restarted"
    ]


def test_a_token_ends_the_streak_and_an_error_neither_grows_nor_ends_it():
    gw = FakeGateway(A, B)
    s, _ = sentinel(gw, Probes(a="sspsseees", b="p"))
    for _ in range(8):
        assert s.round() == []  # s s p (ends) s s e e e (two stalls, errors do not count)
    [e] = s.round()  # the third stall since the token
    assert e["event"] == "taken_out" and gw.calls == [("remove", A)]


def test_the_last_worker_in_rotation_is_never_taken_out():
    gw = FakeGateway(A, B)
    s, logs = sentinel(gw, Probes(a="s", b="s"))
    s.round(), s.round()
    events = s.round()
    assert [e["event"] for e in events] == ["taken_out", "kept"]  # one of two; the other is the last
    assert gw.calls == [("remove", A)] and list(gw.listed) == [B]
    assert logs[-1] == (
        "sentinel: http://b:1 stalls (3 probes in a row, no token in 2 s) but is the last worker in rotation at "
        "http://gw:30000: left in (taking it out would leave nothing to serve)"
    )


def test_a_worker_taken_out_is_put_back_after_successes_tokens_in_a_row(tmp_path):
    gw = FakeGateway(A, B)
    probes = Probes(a="sssspspp", b="p")
    s, logs = sentinel(gw, probes, tmp_path)
    for _ in range(3):
        s.round()
    assert A not in gw.listed and s.watches[A].taken_out
    assert json.loads((tmp_path / "state.json").read_text())["taken_out"][A]["held"]["requests"] == 5
    for _ in range(3):  # s p s: never two tokens in a row
        assert s.round() == []
    assert A in probes.asked[-2:]  # probed while out
    assert s.round() == []  # p (one)
    [e] = s.round()  # p (two)
    assert (e["event"], e["worker"]) == ("put_back", A) and gw.calls[-1] == ("add", A)
    assert json.loads((tmp_path / "state.json").read_text())["taken_out"] == {}
    assert logs[-1].startswith("sentinel: http://a:1 put back into http://gw:30000 after 2 good probes in a row")


def test_what_it_took_out_survives_a_restart_of_the_sentinel(tmp_path):
    gw = FakeGateway(A, B)
    s, _ = sentinel(gw, Probes(a="s", b="p"), tmp_path)
    for _ in range(3):
        s.round()
    again, _ = sentinel(gw, Probes(a="p", b="p"), state_path=str(tmp_path / "state.json"))
    assert again.watches[A].taken_out["held"]["requests"] == 5
    again.round()
    [e] = again.round()
    assert (e["event"], gw.calls[-1]) == ("put_back", ("add", A))


def test_a_worker_out_of_rotation_by_other_hands_is_not_probed_and_its_streak_starts_again():
    gw = FakeGateway(A, B, C)
    probes = Probes(a="s", b="p", c="p")
    s, _ = sentinel(gw, probes)
    s.round(), s.round()
    gw.listed[A] = False  # the gateway's health check, or a rollout, has it out
    probes.asked.clear()
    assert s.round() == [] and A not in probes.asked and A not in s.watches
    gw.listed[A] = True
    assert s.round() == [] and s.watches[A].stalls == 1


def test_a_worker_back_in_rotation_by_other_hands_is_watched_afresh_and_taken_out_again_if_it_still_hangs(tmp_path):
    """The gateway restarted (smg lists the workers of its command line), or the role declared it again: the
    sentinel's taking-out is over; a worker that still hangs is taken out again, and the state says so at once."""
    gw = FakeGateway(A, B)
    s, logs = sentinel(gw, Probes(a="s", b="p"), tmp_path, settings=sn.Settings(failures=1))
    [e] = s.round()
    assert e["event"] == "taken_out"
    assert s.round() == [] and s.watches[A].taken_out["seen_out"]  # the gateway lists it out of rotation
    gw.listed[A] = True  # back, not by the sentinel
    events = s.round()
    assert [x["event"] for x in events] == ["relisted", "taken_out"]
    assert logs[1].startswith("sentinel: http://a:1 is in rotation at http://gw:30000 again, not by the sentinel")
    assert json.loads((tmp_path / "state.json").read_text())["taken_out"][A]["stalls"] == 1
    assert gw.calls == [("remove", A), ("remove", A)]
    assert json.loads((tmp_path / "state.json").read_text())["taken_out"][A]["stalls"] == 1


def test_a_worker_it_cannot_probe_is_said_once_and_left_to_the_health_check():
    gw = FakeGateway(A, B)
    s, logs = sentinel(gw, Probes(a="eeeep", b="p"))
    for _ in range(5):
        assert s.round() == []
    assert logs == [
        "sentinel: cannot probe http://a:1 (its health check's to judge): error (scripted)",
        "sentinel: http://a:1 answers its probes again (progress (scripted))",
    ]
    assert gw.calls == []


def test_one_worker_under_two_spellings_is_one_worker_the_last_one_kept():
    """The gateway lists one worker twice (an address and a name): still the last worker, never taken out."""
    one, same_one = "http://localhost:1", "http://127.0.0.1:1"
    gw = FakeGateway(one, same_one)
    probes = Probes()
    probes.script = {one: ["s"], same_one: ["s"]}
    s, logs = sentinel(gw, probes, settings=sn.Settings(failures=1))
    [e] = s.round()
    assert e["event"] == "kept" and gw.calls == [] and "is the last worker in rotation" in logs[-1]
    assert probes.asked == [one]  # probed once, under its first spelling


def test_never_more_than_half_the_workers_are_taken_out():
    """A fleet-wide slowdown (a stall time too strict for the load) must not funnel everything onto one worker."""
    gw = FakeGateway(A, B, C, "http://d:1")
    s, logs = sentinel(gw, Probes(a="s", b="s", c="s", d="p"), settings=sn.Settings(failures=1))
    events = s.round()
    assert [e["event"] for e in events] == ["taken_out", "taken_out", "kept"]
    assert gw.calls == [("remove", A), ("remove", B)]
    assert logs[-1].endswith(
        "2 of the workers at http://gw:30000 are out already: left in (never more than half of them out)"
    )


def test_the_state_is_saved_before_the_gateway_hears_and_a_failed_save_touches_nothing(tmp_path):
    gw = FakeGateway(A, B)
    s, _ = sentinel(gw, Probes(a="s", b="p"), tmp_path, settings=sn.Settings(failures=1))
    seen = []
    remove = gw.remove
    gw.remove = lambda url, missing_ok=False: (
        seen.append(json.loads((tmp_path / "state.json").read_text())),
        remove(url),
    )
    [e] = s.round()
    assert e["event"] == "taken_out" and A in seen[0]["taken_out"]  # on disk before the DELETE
    gw2 = FakeGateway(A, B)
    s2, _ = sentinel(gw2, Probes(a="s", b="p"), settings=sn.Settings(failures=1))
    s2.state_path = str(tmp_path / "no-such-dir" / "state.json")
    [e] = s2.round()
    assert e["event"] == "failed" and "taking it out" in e["why"] and gw2.calls == []  # not removed unrecorded
    assert s2.watches[A].taken_out is None


def test_an_unreadable_state_file_is_moved_aside_and_said(tmp_path):
    (tmp_path / "state.json").write_text('{"taken_out": ')
    logs: list[str] = []
    s = sn.Sentinel(FakeGateway(A), RULE, state_path=str(tmp_path / "state.json"), probe=Probes(), log=logs.append)
    assert s.watches == {} and (tmp_path / "state.json.bad").exists() and not (tmp_path / "state.json").exists()
    assert "unreadable (JSONDecodeError" in logs[0]


def test_a_probe_that_raises_anything_is_no_stall_and_a_round_that_fails_is_said_not_fatal():
    gw = FakeGateway(A, B)

    def boom(url):
        raise RecursionError("maximum recursion depth exceeded")

    s, logs = sentinel(gw, boom)
    assert s.round() == [] and "cannot probe http://a:1" in logs[0] and "RecursionError" in logs[0]
    s.round = lambda: 1 / 0
    s.run(rounds=2, sleep=lambda _: None)
    assert sum("round failed: ZeroDivisionError" in m for m in logs) == 2


def test_what_a_worker_held_ignores_a_gauge_that_is_not_a_number(monkeypatch):
    gw = FakeGateway(A)
    gw.in_flight = lambda url: float("inf")
    monkeypatch.setattr(
        sn, "read_load", lambda url, timeout: {"state": "load", "running": float("nan"), "queued": 0.0, "why": "?"}
    )
    s = sn.Sentinel(gw, RULE, probe=Probes(), log=lambda m: None)
    assert sn.Sentinel.held(s, A)["requests"] is None


def test_a_failed_removal_is_reported_and_the_worker_stays_watched():
    gw = FakeGateway(A, B, fail="remove")
    s, logs = sentinel(gw, Probes(a="s", b="p"))
    s.round(), s.round()
    [e] = s.round()
    assert e["event"] == "failed" and "taking it out: DELETE: HTTP 500" in logs[-1]
    assert s.watches[A].taken_out is None


def test_a_round_the_gateway_does_not_answer_is_skipped_not_fatal():
    gw = FakeGateway(A, fail="list")
    logs: list[str] = []
    s = sn.Sentinel(gw, RULE, probe=Probes(), log=logs.append)
    slept: list[float] = []
    s.run(rounds=2, sleep=slept.append)
    assert logs == ["sentinel: round skipped: GET http://gw:30000/workers: connection refused"]  # said once
    assert len(slept) == 1


@pytest.mark.parametrize(
    "field,value,why",
    [
        ("stall_s", 0, "stall_s=0: a number of seconds above 0"),
        ("interval_s", -1, "interval_s=-1"),
        ("failures", 0, "failures=0: a whole number of 1 or more"),
        ("successes", 1.5, "successes=1.5"),
        ("failures", True, "failures=True"),
    ],
)
def test_settings_are_checked(field, value, why):
    with pytest.raises(ValueError, match=why):
        sn.Settings(**{field: value})


def test_main_takes_its_key_from_the_environment_and_refuses_a_bad_setting_naming_it():
    env = {sn.KEY_VAR: "s3cret"}
    with pytest.raises(SystemExit, match="failures=0: a whole number of 1 or more"):
        sn.main(["--gateway-url", "http://127.0.0.1:1", "--impl", "smg", "--failures", "0"], env)
    assert env == {}  # taken out of the environment before anything runs
    with pytest.raises(SystemExit, match="unknown gateway 'nginx'"):
        sn.main(["--gateway-url", "http://127.0.0.1:1", "--impl", "nginx"], {})


# --------------------------------------------------------------------------- the probe, on a stand-in


def test_the_probe_tells_a_token_from_a_stall_from_a_dead_worker(standins):
    w0 = standins.urls[0]
    hung = f"http://127.0.0.1:{free_port()}"
    proc = standins.start(hung, hang_after="0")
    try:
        wait_for(f"{hung} healthy", lambda: http.healthy(hung), timeout=20)
        s = sn.Sentinel(FakeGateway(), sn.Settings(stall_s=1.0), api_key=KEY)
        good = s.probe_worker(w0)
        assert good["state"] == sn.PROGRESS and 0 < good["seconds"] < 1.0
        assert s.probe_worker(hung) == {
            "state": sn.STALLED,
            "seconds": None,
            "why": f"{hung}/generate: no token in 1 s",
        }
        assert http.healthy(hung)  # while /health answers: what the gateway's health check sees
        nobody = f"http://127.0.0.1:{free_port()}"
        dead = s.probe_worker(nobody)
        assert dead["state"] == sn.ERROR and "Connection refused" in dead["why"]
        wrong_key = sn.Sentinel(FakeGateway(), sn.Settings(stall_s=1.0), api_key="not-the-key").probe_worker(w0)
        assert wrong_key == {"state": sn.ERROR, "seconds": None, "why": f"{w0}/generate: HTTP 401"}
    finally:
        proc.kill()
        proc.wait()


# --------------------------------------------------------------------------- the real smg


def test_smg_a_worker_whose_generations_hang_is_taken_out_by_the_sentinel_and_put_back_after_a_restart(
    standins, tmp_path
):
    """The hang-after-N fault (issue #32's acceptance): smg keeps routing to it (tests/test_gateway_smg.py); the
    sentinel takes it out on its `failures`-th stalled probe, reports the requests it held, the gateway's clients
    are then served by the other; restarted without the fault, it is put back."""
    w0 = standins.urls[0]
    hung = f"http://127.0.0.1:{free_port()}"
    proc = standins.start(hung, hang_after="2")
    gw = None
    try:
        wait_for(f"{hung} healthy", lambda: http.healthy(hung), timeout=20)
        gw = Gateway(smg_venv(), tmp_path / "smg.log", "--worker-urls", w0, hung)  # round_robin
        wait_for(f"smg lists both ({gw.log})", lambda: all_ready(gw, w0, hung), timeout=30, interval=0.1)
        outcomes: list[bool] = []

        def one() -> None:
            try:
                http.generate(gw.url, "client", 4, timeout=60, api_key=KEY)
                outcomes.append(True)
            except http.HttpError:
                outcomes.append(False)

        clients = [threading.Thread(target=one, daemon=True) for _ in range(8)]  # 4 each: 2 served, 2 hang there
        for t in clients:
            t.start()
        wait_for("the hung worker holds 2", lambda: wl.read_load(hung)["running"] == 2, timeout=20)

        rule = sn.Settings(interval_s=0.5, stall_s=1.0, failures=2, successes=2)
        logs: list[str] = []
        s = sn.Sentinel(
            rt.Router(gw.url, api_key=KEY, impl="smg"), rule, str(tmp_path / "state.json"), KEY, logs.append
        )
        first = s.round()
        assert first == [] and s.watches[hung].stalls == 1 and s.watches[w0].stalls == 0
        [e] = s.round()
        assert (e["event"], e["worker"], e["stalls"]) == ("taken_out", hung, 2)
        # What it held: the 2 clients' requests and the sentinel's own 2 probes (hung there too), on its gauges.
        assert (e["held"]["running"], e["held"]["requests"]) == (4.0, 4), e
        # smg takes a DELETE in (202) and acts on it a moment later: out of rotation (draining), then gone
        wait_for(
            "out of rotation", lambda: hung not in [w["url"] for w in s.router.workers() if w["healthy"]], 10, 0.05
        )
        wait_for("smg drops it", lambda: hung not in gw.by_url(), timeout=15, interval=0.1)
        for _ in range(6):  # every client now served
            assert http.generate(gw.url, "after", 2, timeout=10, api_key=KEY)["completion_tokens"] == 2
        assert s.round() == [] and s.watches[hung].taken_out  # still hung: still out

        proc.kill()  # the operator restarts it (python -m driver restart): no fault now
        proc.wait()
        proc = standins.start(hung)
        wait_for(f"{hung} back", lambda: http.healthy(hung), timeout=20)
        assert s.round() == []
        [back] = s.round()
        assert (back["event"], back["worker"]) == ("put_back", hung)
        wait_for("smg routes to it again", lambda: all_ready(gw, w0, hung), timeout=30, interval=0.1)
        assert json.loads((tmp_path / "state.json").read_text())["taken_out"] == {}
        assert [m.split(":", 1)[0] for m in logs] == ["sentinel", "sentinel"]
        for t in clients:
            t.join(0)
        assert outcomes.count(True) >= 6  # those served before the hang and those served by w0
    finally:
        if gw:
            gw.stop()
        proc.kill()
        proc.wait()


# --------------------------------------------------------------------------- the probe's bound


def trickler(head: bytes, body: bytes, every: float):
    """A server that sends `head` then `body` one byte every `every` seconds; how many body bytes it got out before
    the client went (a list, appended to as it goes)."""
    import socket

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    sent: list[int] = []

    def serve():
        conn, _ = srv.accept()
        conn.recv(65536)
        try:
            for i, b in enumerate(head + body):
                conn.sendall(bytes([b]))
                if i >= len(head):
                    sent.append(1)
                threading.Event().wait(every)
        except OSError:
            pass
        finally:
            conn.close()
            srv.close()

    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{srv.getsockname()[1]}", sent


@pytest.mark.parametrize(
    "head,body",
    [
        (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n", b"x" * 100),  # bytes, never a line
        (b"", b"HTTP/1.1 200 OK\r\n" + b"X-Slow: " + b"y" * 100),  # headers that never end
    ],
)
def test_the_probe_is_cut_at_the_stall_time_however_the_server_dawdles(head, body):
    url, sent = trickler(head, body, every=0.1)
    with pytest.raises(http.Stalled, match="no token in 1 s"):
        http.first_token(url, "x", 4, stall_s=1.0)
    assert len(sent) < 60, "the probe waited on the trickle past its stall time"
