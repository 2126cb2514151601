"""The cause of a failure in real SGLang crash logs (tests/vectors/sglang-crashes, cited there) and in the lab
stand-in's fake tracebacks: the root exception a human acts on, not the launcher's "Received sigquit", not a
traceback printed after it by another rank or the launcher, not the second exception of a chain."""

from __future__ import annotations

import json
import traceback
from pathlib import Path

import pytest

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import unit
from support import lab_standin

ROOT = Path(__file__).resolve().parent.parent
VECTORS = ROOT / "tests" / "vectors" / "sglang-crashes"
NAMES = sorted(p.stem for p in VECTORS.glob("*.log"))


def vector(name: str) -> tuple[list[str], dict]:
    return (VECTORS / f"{name}.log").read_text().splitlines(), json.loads((VECTORS / f"{name}.json").read_text())


def test_the_vectors_are_there_and_cited():
    assert len(NAMES) >= 8
    for name in NAMES:
        lines, meta = vector(name)
        assert meta["source"].startswith("https://github.com/sgl-project/sglang/"), name
        assert meta["sglang_version"] and meta["trimmed"] and meta["expected_cause"], name
        assert lines and all(line == line.rstrip("\n") for line in lines), name


@pytest.mark.parametrize("name", NAMES)
def test_cause_of_a_real_crash_is_its_root_exception(name):
    lines, meta = vector(name)
    assert unit.cause_of(lines) == meta["expected_cause"]


@pytest.mark.parametrize("name", NAMES)
def test_traceback_of_a_real_crash_shows_the_cause(name):
    lines, meta = vector(name)
    tb = unit.traceback_of(lines)
    assert tb, name
    assert (tb[0], tb[-1]) == (meta["traceback_first"], meta["traceback_last"])
    if meta["expected_cause"].split(" (exit code")[0] not in "\n".join(lines[: lines.index(tb[0])]):
        assert any(meta["expected_cause"] in line for line in tb), "the lines shown hold the cause"
    assert tb == lines[lines.index(tb[0]) : lines.index(tb[0]) + len(tb)], "a contiguous piece of the log"


def test_what_follows_the_root_does_not_become_the_cause():
    """The launcher and the other ranks print after the rank that failed first; cleanup raises more."""
    lines, meta = vector("spec-nameerror-sigquit")
    assert any("Received sigquit" in line for line in lines)
    assert unit.cause_of(lines) == meta["expected_cause"]
    lines, meta = vector("cuda-graph-capture-chained")
    assert any("During handling of the above exception" in line for line in lines)
    assert unit.cause_of(lines).startswith("RuntimeError: CUDA error: operation not permitted")
    # SGLang's launcher after a scheduler died (entrypoints/engine.py): "Rank 0 scheduler is dead ...", the
    # re-raised EOFError or "Initialization failed"; and "Exception ignored in" tracebacks of interpreter cleanup.
    after = [
        "[2026-11-30 10:12:41] Rank 0 scheduler is dead. Please check if there are relevant logs.",
        "[2026-11-30 10:12:41] Exit code: 1",
        "Traceback (most recent call last):",
        '  File "/opt/ml-env/lib/python3.11/site-packages/sglang/srt/entrypoints/engine.py", line 840, in _launch',
        "    data = scheduler_pipe_readers[i].recv()",
        "EOFError",
        "Exception ignored in: <function Engine.__del__ at 0x7f>",
        "Traceback (most recent call last):",
        '  File "/opt/ml-env/lib/python3.11/site-packages/sglang/srt/entrypoints/engine.py", line 90, in __del__',
        "AttributeError: 'NoneType' object has no attribute 'shutdown'",
    ]
    assert unit.cause_of(lines + after) == meta["expected_cause"]
    assert unit.cause_of(after[:6]) == (
        "Rank 0 scheduler is dead. Please check if there are relevant logs. (exit code 1)"
    ), "with no root traceback in view, the launcher's word for it"


def test_of_two_crashes_in_one_journal_the_first_is_the_root():
    """Two real crashes one after the other (whole tracebacks, each the root of its own log): whichever comes
    first is the root, the other is printed after it."""
    for one, other in (
        ("cuda-oom-forward-thread", "cuda-graph-capture-oom"),
        ("warmup-assertion", "cuda-graph-capture-chained"),
    ):
        (a, meta_a), (b, meta_b) = vector(one), vector(other)
        assert meta_a["expected_cause"] != meta_b["expected_cause"]
        assert unit.cause_of(a + b) == meta_a["expected_cause"], (one, other)
        assert unit.cause_of(b + a) == meta_b["expected_cause"], (other, one)


def test_an_earlier_nccl_timeout_is_the_root_of_the_tracebacks_after_it():
    nccl, meta = vector("nccl-watchdog-timeout")
    oom, _ = vector("cuda-oom-forward-thread")
    assert unit.cause_of(nccl + oom) == meta["expected_cause"]
    assert unit.cause_of(oom + nccl) == "RuntimeError: CUDA error: out of memory"


def test_a_port_in_use_is_the_root_of_the_ranks_cascade_after_it():
    """sgl-project/sglang#29547: one scheduler's ZMQ bind finds its port taken, then every rank's gloo all_reduce
    fails. Each exception line comes before its frames there: the frames must not make the cascade the cause."""
    lines, meta = vector("zmq-port-in-use")
    cascade = "RuntimeError: [gloo/transport/tcp/pair.cc] Connection reset by peer"
    assert cascade in lines and lines.index(cascade) > 0
    assert unit.cause_of(lines) == meta["expected_cause"] == lines[0]
    assert unit.traceback_of(lines) == [lines[0]], "the line that names the port, not the cascade's frames"


def test_a_port_in_use():
    # uvicorn's bind failure as SGLang's HTTP server would print it (the line as in dphnAI/sonar#621, an
    # aphrodite server on uvicorn; SGLang's own port in use, a ZMQ bind, is the vector zmq-port-in-use).
    line = "ERROR:    [Errno 98] error while attempting to bind on address ('::', 2242, 0, 0): address already in use"
    assert unit.cause_of([line]) == (
        "[Errno 98] error while attempting to bind on address ('::', 2242, 0, 0): address already in use"
    )


def standin():
    return lab_standin()


def test_the_lab_standins_faults_keep_their_causes(monkeypatch, capsys):
    """tests/e2e/test_restart.py expects these causes from the stand-in's journal."""
    lab = standin()

    class Exited(Exception):
        pass

    def exit_(code):
        raise Exited(code)

    monkeypatch.setattr(lab, "kill_children", lambda *a, **k: set())
    monkeypatch.setattr(lab.os, "_exit", exit_)
    with pytest.raises(Exited):
        lab.crash_on_decode()
    decode = capsys.readouterr().err.splitlines()
    # crash-startup's lines, as main() prints them
    lab.log("Load weight begin.")
    try:
        raise RuntimeError("CUDA error: out of memory while loading draft model weights (lab fault crash-startup)")
    except RuntimeError:
        lab.log("Scheduler hit an exception: " + traceback.format_exc())
    startup = capsys.readouterr().err.splitlines()
    tail = ["sglang-a.service: Main process exited, code=exited, status=1/FAILURE"]
    assert (
        unit.cause_of(decode + tail) == "AttributeError: 'EAGLEWorkerV2' object has no attribute 'adaptive_controller'"
    )
    assert unit.cause_of(startup + tail).startswith(
        "RuntimeError: CUDA error: out of memory while loading draft model weights"
    )
    for lines in (decode, startup):
        tb = unit.traceback_of(lines + tail)
        assert tb[0].endswith("Traceback (most recent call last):") and unit.EXCEPTION_LINE.match(tb[-1])
