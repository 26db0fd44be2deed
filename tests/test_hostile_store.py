"""A hostile world for the store and the checkpoints: failing disks, skewed clocks, planted
files, stuck peers, killed saves. Each case once crashed, hung or ran planted code."""
import builtins
import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

import helpers
import cold_start
import mgrpo
import records
import toy_tools
from checkpoints import checkpoints, load_checkpoint, save_checkpoint
from sampling import token_logprobs
from store import FileStore, StoreError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHORT = ["--steps", "3", "--cold-start", "5", "--questions-per-step", "2", "--group-size", "2",
         "--eval-questions", "4", "--eval-every", "0"]


def fake_peer(store_dir, role, stop, beat=lambda n: {"count": n}, every=0.2):
    """A thread that writes the heartbeat of `role` into the store directory, as a peer would."""
    def run():
        n = 0
        while not stop.is_set():
            n += 1
            rec = beat(n)
            path = os.path.join(store_dir, f"heartbeat-{role}.json")
            tmp = f"{path}.{threading.get_ident()}"
            with open(tmp, "w") as f:
                f.write(rec if isinstance(rec, str) else json.dumps(rec))
            os.replace(tmp, path)
            stop.wait(every)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.slow
def test_heartbeat_survives_write_errors_and_stops_the_role_when_they_persist(tmp_path, monkeypatch, capsys):
    st = FileStore(str(tmp_path), "r", "main", timeout=4.0)  # it gives up after 2 s of failures
    real, failures = st.write, {"n": 0, "until": 2}

    def flaky(key, obj):
        if key.startswith("heartbeat") and failures["n"] < failures["until"]:
            failures["n"] += 1
            raise OSError(28, "No space left on device")
        return real(key, obj)
    monkeypatch.setattr(st, "write", flaky)
    try:
        deadline = time.time() + 10
        while (st.read("heartbeat-main") or {}).get("count", 0) < 4:  # two failures, then it writes again
            assert time.time() < deadline
            time.sleep(0.05)
        assert st.beat_error is None and failures["n"] == 2
        assert "heartbeat write" in capsys.readouterr().out
        failures["until"] = 10 ** 9  # the disk stays full: the role stops, clearly
        while st.beat_error is None:
            assert time.time() < deadline + 10
            time.sleep(0.05)
        with pytest.raises(StoreError, match="kept failing"):
            st.put("p000001-done", {})
    finally:
        st.close()


@pytest.mark.slow
def test_staleness_is_judged_on_the_readers_clock(tmp_path):
    """A live peer whose wall clock is two minutes behind (or ahead) is alive: its counter moves."""
    st = FileStore(str(tmp_path), "r", "main", timeout=1.0)
    stop = threading.Event()
    for skew in (-120, 120):
        fake_peer(st.dir, "sub", stop, beat=lambda n: {"count": n, "time": time.time() + skew})
    try:
        t0 = time.time()
        while time.time() - t0 < 3.0:
            st.check_peer()  # never declared gone
            time.sleep(0.1)
        st.wait_peer()
    finally:
        stop.set()
        st.close()


@pytest.mark.parametrize("beat", [None] + [pytest.param(b, marks=pytest.mark.slow) for b in [
    '[1, 2]', '{"count": NaN}', '{"count": "7"}', '{"count": true}', '{"count": 1e999}', '{"time": NaN}', 'garbage',
    '{"count": ' + '[' * 100000 + ']' * 100000 + '}']])
def test_a_silent_or_malformed_heartbeat_is_stale_not_a_crash_or_a_hang(tmp_path, beat):
    """None: no peer at all. The peer is named in the error, not waited for."""
    st = FileStore(str(tmp_path), "r", "main", timeout=1.0)
    stop = threading.Event()
    if beat is not None:
        fake_peer(st.dir, "sub", stop, beat=lambda n: beat)
    try:
        t0 = time.time()
        with pytest.raises(StoreError, match="the sub role has sent no heartbeat"):
            st.wait("p000000-t0-results")
        assert time.time() - t0 < 5
    finally:
        stop.set()
        st.close()


@pytest.mark.slow
def test_a_live_peer_that_never_progresses_is_named(tmp_path):
    st = FileStore(str(tmp_path), "r", "main", timeout=5.0, progress_timeout=1.5)
    stop = threading.Event()
    fake_peer(st.dir, "sub", stop, beat=lambda n: {"count": n, "phase": 7})
    try:
        t0 = time.time()
        with pytest.raises(StoreError, match=r"p000007-t0-results.*stays in phase 7.*the limit was 2 s: progress_timeout"):
            st.wait("p000007-t0-results")
        assert 1.5 <= time.time() - t0 < 6
    finally:
        stop.set()
        st.close()


def test_planted_records_give_errors_that_name_the_record_and_the_store(tmp_path):
    st = FileStore(str(tmp_path), "r", "sub")
    try:
        plant = {"p000001-t0-tasks": "[1, 2, 3]", "p000001-t1-tasks": "{" * 50000,
                 "p000001-t2-tasks": '{"tasks": ' + "[" * 100000 + "]" * 100000 + "}", "p000001-t3-tasks": "\xff\xfe"}
        for key, text in plant.items():
            with open(os.path.join(st.dir, key + ".json"), "w", errors="surrogateescape") as f:
                f.write(text)
        os.mkdir(os.path.join(st.dir, "p000001-t4-tasks.json"))
        victim = tmp_path / "outside.json"
        victim.write_text('{"secret": 1}')
        os.symlink(victim, os.path.join(st.dir, "p000001-t5-tasks.json"))
        for key in list(plant) + ["p000001-t4-tasks", "p000001-t5-tasks"]:
            with pytest.raises(StoreError) as e:
                st.read(key)
            assert key in str(e.value) and st.dir in str(e.value)
        # a record that is JSON but not what the peer writes
        for rec in [{"tasks": "city of ada"}, {"tasks": [1], "questions": [[1, 1]], "seed": 0, "greedy": False},
                    {"tasks": ["x"], "questions": [[1, True]], "seed": 0, "greedy": False},
                    {"tasks": ["x", "y"], "questions": [[1, 1]], "seed": 0, "greedy": False}]:
            with pytest.raises(StoreError, match="p000001-t0-tasks"):
                records.store_record(st, "p000001-t0-tasks", rec, records.tasks_ok)
        with pytest.raises(StoreError, match="p000001-t0-tasks"):  # a level the task has not
            records.store_record(st, "p000001-t0-tasks", {"tasks": ["x"], "questions": [[1, 9]], "seed": 0,
                                                         "greedy": False}, records.tasks_ok, toy_tools)
        # writing over a planted symlink replaces the link, never the file it points to
        st.put("p000001-t5-tasks", {"tasks": []})
        assert victim.read_text() == '{"secret": 1}' and st.read("p000001-t5-tasks") == {"tasks": []}
    finally:
        st.close()


@pytest.mark.slow
def test_a_second_process_of_the_same_role_is_refused(tmp_path):
    st = FileStore(str(tmp_path), "r", "main")
    try:
        code = ("import sys\nfrom store import FileStore, StoreError\ntry:\n    FileStore(sys.argv[1], 'r', 'main')\n"
                "except StoreError as e:\n"
                "    print(e); sys.exit(3)\n")
        r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 3 and "another main role is running" in r.stdout
        r = subprocess.run([sys.executable, "-c", code.replace("'main'", "'sub'"), str(tmp_path)], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0  # the other role is welcome
    finally:
        st.close()


# --------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------
class Payload:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['PWNED']}",))


def test_a_planted_checkpoint_runs_no_code(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    mgrpo.main(SHORT + ["--out", str(out)])
    marker = tmp_path / "pwned"
    monkeypatch.setenv("PWNED", str(marker))
    for ckpt in checkpoints(str(out)):
        torch.save({"index": Payload()}, os.path.join(ckpt, "state.pt"))
    before = snapshot(out)
    with pytest.raises(SystemExit, match="can be loaded, and nothing there was changed") as e:
        mgrpo.main(SHORT + ["--out", str(out), "--resume"])
    assert not marker.exists() and snapshot(out) == before  # no code ran, and nothing was deleted
    assert all(ckpt in str(e.value) for ckpt in checkpoints(str(out)))  # each checkpoint named, with why
    assert capsys.readouterr().out.count("cannot be loaded") == len(checkpoints(str(out))) == 1  # a run that ended


def snapshot(folder):
    """Every file under `folder`, with its bytes."""
    return {os.path.relpath(os.path.join(d, n), folder): open(os.path.join(d, n), "rb").read()
            for d, _, names in os.walk(folder) for n in names}


def load_short(path):  # an agent from a checkpoint folder, as a SHORT run loads it
    return helpers.load_agent(path, mgrpo.parse_args(SHORT), seed=0)


def keeping_two(monkeypatch):
    """A run that ends keeping its last two checkpoints (it keeps its last alone): one to fall back to."""
    import report
    real = report.save_checkpoint
    monkeypatch.setattr(report, "save_checkpoint", lambda out, a, index, *r, **kw: real(out, a, index, *r))


def test_a_corrupt_latest_checkpoint_falls_back_to_the_one_before(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    keeping_two(monkeypatch)
    mgrpo.main(SHORT + ["--out", str(out)])
    before, latest = checkpoints(str(out))
    with open(os.path.join(latest, "state.pt"), "wb") as f:
        f.write(b"\x00 not a checkpoint")
    agents, index, lines, _ = load_checkpoint(str(out), ["main", "sub"], load_short)
    assert "cannot be loaded" in capsys.readouterr().out
    assert index == int(os.path.basename(before)[5:]) and set(agents) == {"main", "sub"}


def test_a_killed_save_leaves_nothing_that_breaks_later_saves(tmp_path, monkeypatch):
    out = tmp_path / "run"
    mgrpo.main(SHORT + ["--out", str(out)])
    agents, index, lines, _ = load_checkpoint(str(out), ["main", "sub"], load_short)
    real = torch.save
    monkeypatch.setattr(torch, "save", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):  # killed midway: weights written, state not
        save_checkpoint(str(out), agents, index + 1, lines)
    assert any(n.startswith("ckpt-tmp-") for n in os.listdir(out))
    os.makedirs(os.path.join(out, "ckpt.old", "main"))  # what the old scheme left behind
    monkeypatch.setattr(torch, "save", real)
    for i in (1, 2, 3):
        save_checkpoint(str(out), agents, index + i, lines)
    assert [os.path.basename(p) for p in checkpoints(str(out))] == [f"ckpt-{index + 2:08d}", f"ckpt-{index + 3:08d}"]
    assert not any(n.startswith("ckpt-tmp-") for n in os.listdir(out))


def test_a_non_finite_cold_start_stops_before_any_checkpoint(tmp_path, monkeypatch):
    out = tmp_path / "run"
    real, calls = token_logprobs, []

    def diverging(*a, **k):  # the cold start's loss turns NaN at its third step
        calls.append(1)
        return real(*a, **k) * (float("nan") if len(calls) == 3 else 1.0)
    monkeypatch.setattr(cold_start, "token_logprobs", diverging)
    with pytest.raises(FloatingPointError, match="cold start"):
        mgrpo.main(SHORT + ["--cold-start", "20", "--out", str(out)])
    assert checkpoints(str(out)) == []


def test_metrics_are_rewritten_atomically_on_resume(tmp_path, monkeypatch):
    out = tmp_path / "run"
    keeping_two(monkeypatch)
    mgrpo.main(SHORT + ["--out", str(out)])
    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines()
    # the newest checkpoint is gone: a resume goes back one and drops the lines after it
    import shutil
    shutil.rmtree(checkpoints(str(out))[-1])
    real_open = builtins.open

    class Broken:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.f.close()

        def write(self, text):  # a crash in the middle of the rewrite
            self.f.write(text[:len(text) // 2])
            raise KeyboardInterrupt

    def opener(file, mode="r", *a, **k):
        f = real_open(file, mode, *a, **k)
        return Broken(f) if "metrics.jsonl" in str(file) and "w" in mode else f
    monkeypatch.setattr(builtins, "open", opener)
    with pytest.raises(KeyboardInterrupt):
        mgrpo.main(SHORT + ["--out", str(out), "--resume"])
    monkeypatch.setattr(builtins, "open", real_open)
    assert path.read_text().splitlines() == lines  # whole, as before the crash


@pytest.mark.parametrize("explicit", [True, False])
def test_a_live_peer_that_never_starts_its_schedule_is_named(tmp_path, monkeypatch, explicit):
    """A peer alive (its heartbeat ticks) but still at phase -1, hung while loading or in its cold start:
    the wait ends at progress_timeout when one is given, else at START_LIMIT, naming what it was doing."""
    if not explicit:
        monkeypatch.setattr(FileStore, "START_LIMIT", 2.0)
    st = FileStore(str(tmp_path), "r", "main", timeout=30.0, progress_timeout=2.0 if explicit else -1.0)
    assert st.progress_limit(starting=True) == 2.0
    assert st.progress_limit() == (2.0 if explicit else FileStore.AUTO_FLOOR)
    stop = threading.Event()
    fake_peer(st.dir, "sub", stop, beat=lambda n: {"count": n, "phase": -1, "doing": "its cold start"})
    how = "progress_timeout" if explicit else "START_LIMIT = 2 s"
    fix = "progress_timeout" if explicit else "FileStore.START_LIMIT"
    try:
        t0 = time.time()
        with pytest.raises(StoreError, match=rf"p000000-t0-results.*has not started its schedule \(it was its cold "
                                             rf"start\).*the limit was 2 s: {how}.*raise {fix}"):
            st.wait("p000000-t0-results")
        assert 2.0 <= time.time() - t0 < 6
    finally:
        stop.set()
        st.close()
