"""smg's discovery file as the workers' one declaration (plugins/module_utils/sglang_deploy/discovery.py; router.Router with
discovery_file; docs/router.md "Declarative workers"): the manifest's rules, the lock, and against the real smg
1.13.0 on loopback: a worker DELETEd through the API comes back while the file names it, so taking one out and
putting it back go through the file; the rollout's client and the sentinel do so."""

from __future__ import annotations

import json
import threading
import time

import pytest

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import discovery, http
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import router as rt
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import sentinel as sn
from support import wait_for
from support.smg import KEY, Gateway, all_ready, free_port, smg_venv


def test_a_good_manifest_has_no_problem():
    assert (
        discovery.problems({"version": 1, "workers": [{"url": "http://a:1"}, {"url": "http://b:1", "id": "b"}]}) == []
    )


@pytest.mark.parametrize(
    "doc,said",
    [
        ([], "a JSON object is wanted, not list"),
        ({"version": 2, "workers": []}, "version 2: smg 1.13.0 reads version 1"),
        ({"version": 1}, "workers: a list is wanted"),
        ({"version": 1, "workers": [{"host": "a"}]}, "workers[0]: an object with a url (scheme://host:port) is wanted"),
        (
            {"version": 1, "workers": [{"url": "http://a:1", "weight": 1}]},
            "workers[0] (http://a:1): unknown field(s) weight",
        ),
        ({"version": 1, "workers": [{"url": "http://a:1"}, {"url": "http://a:1"}]}, "listed twice: http://a:1"),
        ({"version": 1, "workers": [], "extra": 1}, "unknown key(s) extra"),
    ],
)
def test_what_smg_would_refuse_is_said(doc, said):
    assert any(said in p for p in discovery.problems(doc)), discovery.problems(doc)


def test_a_bad_manifest_is_never_written_and_a_bad_file_never_edited(tmp_path):
    path = str(tmp_path / "workers.json")
    with pytest.raises(discovery.DiscoveryError, match="no such discovery file"):
        discovery.read(path)
    discovery.write(path, [{"url": "http://a:1"}])
    with pytest.raises(discovery.DiscoveryError, match="listed twice"):
        discovery.write(path, [{"url": "http://b:1"}, {"url": "http://b:1"}])
    assert discovery.read(path) == [{"url": "http://a:1"}]  # the last good one stands
    (tmp_path / "workers.json").write_text('{"version": 1, "workers": [{"url": "http://a:1", "weight": 2}]}')
    with pytest.raises(discovery.DiscoveryError, match="unknown field"):
        discovery.take_out(path, lambda u: True)
    assert "weight" in (tmp_path / "workers.json").read_text()  # untouched
    with pytest.raises(SystemExit, match=r"discovery file refused: .*unknown field"):
        discovery.check_file([path])


def test_two_editors_at_once_lose_neither_change(tmp_path):
    path = str(tmp_path / "workers.json")
    discovery.write(path, [])
    urls = [f"http://w{i}:1" for i in range(20)]

    def add(url):
        def match(u):
            time.sleep(0.001)  # a slow read-modify-write: without the lock, editors overwrite one another
            return u == url

        discovery.put_back(path, url, match)

    threads = [threading.Thread(target=add, args=(u,)) for u in urls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(w["url"] for w in discovery.read(path)) == sorted(urls)


def test_a_worker_taken_out_comes_back_whole(tmp_path):
    """Its fields wait in PATH.out: a prefill worker comes back a prefill worker, on its bootstrap port."""
    path = str(tmp_path / "workers.json")
    prefill = {"url": "http://p:1", "worker_type": "prefill", "bootstrap_port": 8998}
    discovery.write(path, [{"url": "http://d:1"}, prefill])
    discovery.take_out(path, lambda u: u == "http://p:1")
    assert discovery.read(path) == [{"url": "http://d:1"}]
    discovery.put_back(path, "http://p:1", lambda u: u == "http://p:1")
    assert discovery.read(path) == [{"url": "http://d:1"}, prefill]
    assert json.loads((tmp_path / "workers.json.out").read_text()) == {}
    discovery.put_back(path, "http://n:1", lambda u: u == "http://n:1")  # never taken out: its URL alone
    assert discovery.read(path)[-1] == {"url": "http://n:1"}


def test_sglang_router_reads_no_discovery_file():
    with pytest.raises(rt.RouterError, match=r"sglang-router 0\.3\.2 reads no discovery file"):
        rt.Router("http://127.0.0.1:1", impl="sglang-router", discovery_file="/x.json")


# --------------------------------------------------------------------------- the real smg


@pytest.fixture
def filed(standins, tmp_path):
    """smg reading its two workers from a discovery file (checked every 2 s, and at once on a change)."""
    w0, w1, _ = standins.urls
    path = tmp_path / "workers.json"
    discovery.write(str(path), [{"url": w0}, {"url": w1}])
    flags = ["--discovery-provider", "file", "--discovery-file", str(path), "--discovery-check-interval-secs", "2"]
    gw = Gateway(smg_venv(), tmp_path / "smg.log", *flags)
    try:
        wait_for(f"smg lists both from the file ({gw.log})", lambda: all_ready(gw, w0, w1), timeout=30, interval=0.1)
        yield gw, str(path), w0, w1
    finally:
        gw.stop()


def test_smg_adds_back_a_worker_deleted_through_the_api_while_the_file_names_it(filed):
    gw, _, _, w1 = filed
    api = rt.Router(gw.url, api_key=KEY, impl="smg")  # no discovery_file: DELETE /workers/{id}
    [old] = api.remove(w1)
    wait_for(
        "back under a new id", lambda: gw.by_url().get(w1, {}).get("id") not in (None, old), timeout=20, interval=0.1
    )
    assert gw.by_url()[w1]["status"] == "ready"


def test_the_client_takes_a_worker_out_and_puts_it_back_through_the_file(filed):
    gw, path, w0, w1 = filed
    r = rt.Router(gw.url, api_key=KEY, impl="smg", discovery_file=path, poll=0.1)
    ids = r.remove(w1)
    assert ids == [gw.by_url()[w1]["id"]] and discovery.read(path) == [{"url": w0}]
    r.wait_gone(w1, timeout=15, draining_ok=False)
    time.sleep(3)  # past a periodic reread (2 s): it stays out
    assert w1 not in gw.by_url() and r.remove(w1, missing_ok=True) == []
    with pytest.raises(
        rt.RouterError, match=f"does not name {w1} under any spelling, nor does .* the file names: {w0}"
    ):
        r.remove(w1)
    wid, added = r.add(w1, timeout=15)
    assert (wid, added) == ("", True) and discovery.read(path) == [{"url": w0}, {"url": w1}]
    r.wait_healthy(w1, timeout=30)
    assert r.add(w1) == (gw.by_url()[w1]["id"], False)  # named already: the file unchanged
    assert len(discovery.read(path)) == 2


def test_the_sentinel_takes_a_hung_worker_out_of_the_file_and_puts_it_back(standins, tmp_path):
    w0 = standins.urls[0]
    hung = f"http://127.0.0.1:{free_port()}"
    proc = standins.start(hung, hang_after="0")
    path = tmp_path / "workers.json"
    discovery.write(str(path), [{"url": w0}, {"url": hung}])
    flags = ["--discovery-provider", "file", "--discovery-file", str(path), "--discovery-check-interval-secs", "2"]
    gw = None
    try:
        wait_for(f"{hung} healthy", lambda: http.healthy(hung), timeout=20)
        gw = Gateway(smg_venv(), tmp_path / "smg.log", *flags)
        wait_for("both listed", lambda: all_ready(gw, w0, hung), timeout=30, interval=0.1)
        router = rt.Router(gw.url, api_key=KEY, impl="smg", discovery_file=str(path))
        s = sn.Sentinel(router, sn.Settings(stall_s=1.0, failures=1, successes=1), api_key=KEY, log=lambda m: None)
        [e] = s.round()
        assert e["event"] == "taken_out" and discovery.read(str(path)) == [{"url": w0}]
        wait_for("smg drops it", lambda: hung not in gw.by_url(), timeout=15, interval=0.1)
        time.sleep(3)  # past a periodic reread: it stays out
        assert hung not in gw.by_url()
        proc.kill()
        proc.wait()
        proc = standins.start(hung)  # restarted, no fault
        wait_for(f"{hung} back", lambda: http.healthy(hung), timeout=20)
        [back] = s.round()
        assert back["event"] == "put_back" and discovery.read(str(path)) == [{"url": w0}, {"url": hung}]
        wait_for("smg routes to it again", lambda: all_ready(gw, w0, hung), timeout=30, interval=0.1)
    finally:
        if gw:
            gw.stop()
        proc.kill()
        proc.wait()
