"""No run lost: a resume never destroys what it cannot read, a checkpoint save survives a kill at any
step, the loss stays finite, the store's temporary files and locks behave under faults, and the toy
search server cannot be held open. Each test injects the fault it names."""
import errno
import fcntl
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

import checkpoints
import helpers
import mgrpo
import store as store_module
import tools
import toy_server
from checkpoints import load_checkpoint, save_checkpoint
from store import FileStore, StoreError
from test_hostile_store import SHORT, fake_peer, load_short, snapshot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------------------------------
# Resume and start afresh
# ---------------------------------------------------------------------------------------
def test_a_fresh_start_over_a_run_needs_overwrite(tmp_path):
    out = tmp_path / "run"
    mgrpo.main(SHORT + ["--out", str(out)])
    before = snapshot(out)
    with pytest.raises(SystemExit, match="holds a run: continue it with --resume, or start afresh over it"):
        mgrpo.main(SHORT + ["--out", str(out), "--steps", "1"])
    assert snapshot(out) == before
    assert mgrpo.main(SHORT + ["--out", str(out), "--steps", "1", "--overwrite"])["steps"] == 1
    with pytest.raises(SystemExit):
        mgrpo.parse_args(SHORT + ["--out", str(out), "--resume", "--overwrite"])


@pytest.mark.parametrize("ratio,saved", [(1e9, [1, 7]), (0.0, [1, 2, 3, 4, 5, 6, 7])])
def test_checkpoints_cost_a_share_of_the_run_and_a_resume_goes_on_from_the_last(tmp_path, monkeypatch, ratio, saved):
    """A run saves after the first phase, then once the phases since the last checkpoint took
    report.SAVE_RATIO times as long as saving it (here: never again, or always), and after the last
    phase. A run cut off resumes from its last checkpoint."""
    import report
    monkeypatch.setattr(report, "SAVE_RATIO", ratio)
    positions, real = [], report.save_checkpoint
    monkeypatch.setattr(report, "save_checkpoint", lambda out, a, index, *r, **kw: positions.append(index) or real(out, a, index, *r, **kw))
    out = tmp_path / "run"
    opts = SHORT + ["--steps", "3", "--eval-every", "0", "--out", str(out)]
    mgrpo.main(opts)  # phases: 2 evaluations, 3 steps, 2 evaluations; a checkpoint counts the phases behind it
    assert positions == saved and len(checkpoints.checkpoints(str(out))) == 1  # a run that ended keeps its last
    real_step = mgrpo.train_step
    monkeypatch.setattr(mgrpo, "train_step", helpers.crashing(real_step, 3))
    with pytest.raises(KeyboardInterrupt):
        mgrpo.main(opts + ["--overwrite"])
    monkeypatch.setattr(mgrpo, "train_step", real_step)
    assert mgrpo.main(opts + ["--resume"])["steps"] == 3  # from the last checkpoint, however far back
    with open(out / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == [0, 0, 1, 2, 3, 3, 3]


def test_a_run_of_the_older_level_options_reads_as_todays():
    """args.json of a run from before --level took the training levels: --level L --train-levels T is --level T
    where T starts with L (its evaluations' level), --level L alone is --level L; else it differs."""
    same = lambda old, new: checkpoints.identity(old) == checkpoints.identity({"level": new})  # noqa: E731
    assert same({"level": 1, "train_levels": []}, [1]) and same({"level": 1, "train_levels": [1, 2, 2]}, [1, 2, 2])
    assert not same({"level": 2, "train_levels": [1, 2]}, [1, 2]) and not same({"level": 2, "train_levels": [1, 2]}, [2])


def test_a_resume_with_other_settings_or_agents_touches_nothing(tmp_path):
    out = tmp_path / "run"
    mgrpo.main(SHORT + ["--out", str(out)])
    before = snapshot(out)
    for other in (["--mode", "single-agent"], ["--mode", "main-only"], ["--seed", "2"], ["--chat"]):
        with pytest.raises(SystemExit, match="other settings than the run") as e:
            mgrpo.main(SHORT + other + ["--out", str(out), "--resume"])
        assert other[0].lstrip("-").replace("-", "_") in str(e.value)
        assert snapshot(out) == before
    # garbage in args.json: a clear error, nothing touched
    (out / "args.json").write_text("[1, 2")
    before = snapshot(out)
    with pytest.raises(SystemExit, match="args.json cannot be read"):
        mgrpo.main(SHORT + ["--out", str(out), "--resume"])
    assert snapshot(out) == before


def test_a_resume_of_checkpoints_without_the_agents_asked_for_names_them(tmp_path):
    """A single agent's run resumed as co-train, with no args.json left to compare: its checkpoints
    hold no sub-agent, and the error says so for each; nothing is touched."""
    out = tmp_path / "single"
    mgrpo.main(SHORT + ["--mode", "single-agent", "--out", str(out)])
    os.remove(out / "args.json")
    before = snapshot(out)
    with pytest.raises(SystemExit, match="holds no 'sub' agent") as e:
        mgrpo.main(SHORT + ["--out", str(out), "--resume"])
    assert str(e.value).count("holds no 'sub' agent") == len(checkpoints.checkpoints(str(out))) == 1
    assert snapshot(out) == before


# ---------------------------------------------------------------------------------------
# Checkpoint saves under a kill at any step
# ---------------------------------------------------------------------------------------
class Killed(BaseException):
    pass


def kill_at(monkeypatch, k):
    """Make the k-th of the save's steps (every torch.save, fsync, rename and rmtree) raise, as a
    kill there would stop it; returns the list of steps taken."""
    steps = []

    def wrap(module, name):
        real = getattr(module, name)

        def step(*a, **kw):
            steps.append(name)
            if len(steps) == k:
                raise Killed
            return real(*a, **kw)
        monkeypatch.setattr(module, name, step)
    for module, name in ((torch, "save"), (os, "fsync"), (os, "rename"), (checkpoints.shutil, "rmtree")):
        wrap(module, name)
    return steps


@pytest.mark.parametrize("again", [False, True], ids=["new index", "same index again"])
def test_a_checkpoint_save_killed_at_any_step_leaves_a_whole_copy(tmp_path, monkeypatch, capsys, again):
    """Every save is atomic: killed before each of its steps in turn, a resume finds a whole copy,
    the new one or the one before, and the next save works. `again`: the index is saved a second
    time, as each cold-start round saves position 0."""
    args = mgrpo.parse_args(SHORT)
    agents = {n: helpers.load_agent("", args, seed=i) for i, n in enumerate(("main", "sub"))}
    out = str(tmp_path)
    save_checkpoint(out, agents, 0, 0, sft_rounds=1)
    save_checkpoint(out, agents, 1, 5)
    k, index = 1, 1 if again else 2
    while True:
        with monkeypatch.context() as m:
            steps = kill_at(m, k)
            try:
                save_checkpoint(out, agents, index, 7)
                done = True
            except Killed:
                done = False
        _, found, lines, _ = load_checkpoint(out, ["main", "sub"], load_short)
        assert "cannot be loaded" not in capsys.readouterr().out  # whole, not one that fails
        assert (found, lines) in {(1, 5), (index, 7)}
        if done:
            break
        k += 1
    assert k > 10 and {"save", "fsync", "rename", "rmtree"} <= set(steps)  # every kind of step was hit
    assert (found, lines) == (index, 7) and len(checkpoints.checkpoints(out)) == checkpoints.KEEP
    assert not any(n.startswith("ckpt-tmp-") for n in os.listdir(out))


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"),
                                   Exception("Error while serializing: I/O error: No space left on device (os error 28)")])
def test_a_full_disk_while_saving_is_one_line_and_loses_nothing(tmp_path, monkeypatch, error):
    """A disk that fills up mid-save (safetensors and torch.save each say so in their own error) stops the run
    with one line that says to free space and --resume; the half-written folder goes and the last checkpoint
    still loads. Any other error is raised as it is."""
    args = mgrpo.parse_args(SHORT)
    agents = {n: helpers.load_agent("", args, seed=i) for i, n in enumerate(("main", "sub"))}
    out = str(tmp_path)
    save_checkpoint(out, agents, 1, 5)
    real = checkpoints.write_state

    def filling(folder, *a):
        real(folder, *a)
        raise error
    monkeypatch.setattr(checkpoints, "write_state", filling)
    with pytest.raises(SystemExit) as e:
        save_checkpoint(out, agents, 2, 7)
    assert "disk" in str(e.value) and "--resume" in str(e.value) and "\n" not in str(e.value)
    assert sorted(os.listdir(out)) == ["ckpt-00000001"]
    assert load_checkpoint(out, ["main", "sub"], load_short)[1:3] == (1, 5)
    monkeypatch.setattr(checkpoints, "write_state", lambda *a: (_ for _ in ()).throw(ValueError("other")))
    with pytest.raises(ValueError, match="other"):
        save_checkpoint(out, agents, 2, 7)


def test_files_and_folders_are_fsynced_before_the_rename_that_publishes_them(tmp_path, monkeypatch):
    args = mgrpo.parse_args(SHORT)
    agents = {"main": helpers.load_agent("", args, seed=0)}
    events, real_fsync, real_rename = [], os.fsync, os.rename
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
                        or real_fsync(fd))
    monkeypatch.setattr(os, "rename", lambda a, b: events.append(("rename", a, b)) or real_rename(a, b))
    save_checkpoint(str(tmp_path), agents, 3, 0)
    publish = next(i for i, e in enumerate(events) if e[0] == "rename" and e[2].endswith("ckpt-00000003"))
    tmp = events[publish][1]
    synced = {e[1] for e in events[:publish] if e[0] == "fsync"}
    written = {os.path.join(d, n).replace(str(tmp_path / "ckpt-00000003"), tmp)
               for d, _, names in os.walk(tmp_path / "ckpt-00000003") for n in names}
    folders = {d.replace(str(tmp_path / "ckpt-00000003"), tmp) for d, _, _ in os.walk(tmp_path / "ckpt-00000003")}
    assert written and written | folders <= synced  # every file and folder, before the rename
    assert ("fsync", str(tmp_path)) in events[publish:]  # and the folder that holds it, after


# ---------------------------------------------------------------------------------------
# The loss stays finite
# ---------------------------------------------------------------------------------------
def test_a_huge_log_ratio_gives_a_finite_loss_and_gradient():
    logp = torch.tensor([[0.0, -1.0, -2.0]], requires_grad=True)
    loss, stats = mgrpo.policy_loss(logp, torch.tensor([[0.0, -101.0, -2.0]]), torch.tensor([0.0]),
                                    torch.tensor([[0, 1, 1]]))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all() and all(map(torch.isfinite, map(
        torch.tensor, stats.values())))
    loss, _ = mgrpo.policy_loss(logp, torch.tensor([[0.0, -101.0, -2.0]]), torch.tensor([-1.0]),
                                torch.tensor([[0, 1, 1]]))
    assert torch.isfinite(loss) and loss.item() == pytest.approx((torch.exp(torch.tensor(20.0)) + 1).item() / 2)


def test_a_skipped_step_is_counted_in_the_metrics(tmp_path, monkeypatch):
    """A step whose loss (step 2) or gradient norm (step 3) is not finite shows in metrics.jsonl as
    skipped, with no gradient norm: the file stays strict JSON, no NaN in it."""
    real_loss, real_clip, real_step, now = mgrpo.policy_loss, torch.nn.utils.clip_grad_norm_, mgrpo.train_step, [0]

    def step(main, sub, s, *a, **k):
        now[0] = s
        return real_step(main, sub, s, *a, **k)

    def loss(*a, **k):
        value, stats = real_loss(*a, **k)
        return (value * float("nan") if now[0] == 2 else value), stats
    monkeypatch.setattr(mgrpo, "train_step", step)
    monkeypatch.setattr(mgrpo, "policy_loss", loss)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_",
                        lambda *a, **k: torch.tensor(float("inf")) if now[0] == 3 else real_clip(*a, **k))
    mgrpo.main(SHORT + ["--out", str(tmp_path)])

    def strict(constant):
        raise AssertionError(f"{constant} in metrics.jsonl")
    rows = [json.loads(line, parse_constant=strict) for line in open(tmp_path / "metrics.jsonl")]
    steps = {r["step"]: r for r in rows if "eval" not in r}
    assert [steps[s]["skipped_main"] for s in (1, 2, 3)] == [0, 1, 1]
    assert type(steps[1]["grad_norm_main"]) is float and steps[2]["grad_norm_main"] is None is steps[3]["grad_norm_main"]


def test_a_refused_start_touches_neither_the_folder_nor_the_store(tmp_path):
    out = tmp_path / "run"
    mgrpo.main(SHORT + ["--out", str(out)])
    before = snapshot(out)
    with pytest.raises(SystemExit, match="holds a run"):
        mgrpo.main(SHORT + ["--role", "main", "--store", str(tmp_path / "store"), "--out", str(out)])
    assert snapshot(out) == before and not os.path.exists(tmp_path / "store")


def test_a_second_run_on_the_same_out_is_refused(tmp_path):
    out = tmp_path / "run"
    os.makedirs(out)
    code = ("import fcntl, os, sys, time\nfd = os.open(os.path.join(sys.argv[1], '.lock'), os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('locked', flush=True)\ntime.sleep(60)\n")
    other = subprocess.Popen([sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "locked"
        with pytest.raises(SystemExit, match="another run is using"):
            mgrpo.main(SHORT + ["--out", str(out)])
        assert os.listdir(out) == [".lock"]
    finally:
        other.kill()
        other.wait()


def test_a_planted_lock_file_is_a_clear_error(tmp_path):
    out = tmp_path / "run"
    os.makedirs(out)
    os.symlink(tmp_path / "elsewhere", out / ".lock")
    with pytest.raises(SystemExit, match="cannot lock"):
        mgrpo.main(SHORT + ["--out", str(out)])
    assert not os.path.exists(tmp_path / "elsewhere")


def test_an_overwrite_cut_off_leaves_the_old_run_resumable(tmp_path, monkeypatch):
    """--overwrite clears the old run before it writes the new settings: cut off in between, the
    folder still holds the old run under its own settings, and a --resume continues it."""
    out = tmp_path / "run"
    mgrpo.main(SHORT + ["--out", str(out)])
    old_args = (out / "args.json").read_text()

    def cut(folder):
        raise Killed
    monkeypatch.setattr(checkpoints, "clear_run", cut)
    with pytest.raises(Killed):
        mgrpo.main(SHORT + ["--seed", "2", "--overwrite", "--out", str(out)])
    assert (out / "args.json").read_text() == old_args
    monkeypatch.undo()
    assert mgrpo.main(SHORT + ["--out", str(out), "--resume"])["steps"] == 3


# ---------------------------------------------------------------------------------------
# The store
# ---------------------------------------------------------------------------------------
def test_close_releases_the_roles_lock(tmp_path):
    """While a role's store is open another process of that role is refused; once it is closed, even
    with this process going on, that process is welcome."""
    code = ("import sys\nfrom store import FileStore, StoreError\ntry:\n    FileStore(sys.argv[1], 'r', 'main').close()\n"
            "except StoreError:\n    sys.exit(3)\n")
    other = [sys.executable, "-c", code, str(tmp_path)]
    st = FileStore(str(tmp_path), "r", "main")
    assert subprocess.run(other, cwd=ROOT, timeout=120).returncode == 3
    st.close()
    st.close()  # twice is harmless
    assert subprocess.run(other, cwd=ROOT, timeout=120).returncode == 0


def test_prune_spares_a_live_writers_temp_file_and_removes_stale_ones_whatever_their_time(tmp_path):
    st = FileStore(str(tmp_path), "r", "main")
    try:
        live = os.path.join(st.dir, "p000009-t0-tasks.json.4242.abc.tmp")
        code = ("import fcntl, os, sys, time\nfd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT)\n"
                "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('locked', flush=True)\ntime.sleep(60)\n")
        writer = subprocess.Popen([sys.executable, "-c", code, live], stdout=subprocess.PIPE, text=True)
        assert writer.stdout.readline().strip() == "locked"
        os.utime(live, (0, 0))  # as old as can be: a live writer's file all the same
        dead_future = os.path.join(st.dir, "p000009-t1-tasks.json.4343.abd.tmp")
        dead_old = os.path.join(st.dir, "p000009-t2-tasks.json.4444.abe.tmp")
        for path, t in ((dead_future, time.time() + 10 ** 6), (dead_old, 0)):
            open(path, "w").close()
            os.utime(path, (t, t))
        st.prune(0)
        assert os.path.exists(live) and not os.path.exists(dead_future) and not os.path.exists(dead_old)
        writer.kill()
        writer.wait()
        st.prune(0)  # its writer is gone: now it is stale
        assert not os.path.exists(live)
    finally:
        st.close()


def test_a_put_whose_temp_file_was_pruned_writes_it_again(tmp_path, monkeypatch):
    st = FileStore(str(tmp_path), "r", "both")  # no heartbeat thread: the first lock is the put's
    real, calls = fcntl.flock, []

    def pruned_first(fd, op):  # a prune on another machine took the file between create and lock
        calls.append(op)
        if len(calls) == 1:
            for n in os.listdir(st.dir):
                if n.startswith("p000001-t0-tasks") and n.endswith(".tmp"):
                    os.remove(os.path.join(st.dir, n))
        return real(fd, op)
    try:
        monkeypatch.setattr(store_module.fcntl, "flock", pruned_first)
        st.put("p000001-t0-tasks", {"tasks": ["a"]})
        assert st.read("p000001-t0-tasks") == {"tasks": ["a"]} and len(calls) == 2
    finally:
        monkeypatch.setattr(store_module.fcntl, "flock", real)
        st.close()


def test_a_failed_write_leaves_no_temp_file(tmp_path, monkeypatch):
    st = FileStore(str(tmp_path), "r", "both")
    try:
        def full(*a, **k):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(store_module.json, "dumps", full)
        with pytest.raises(OSError, match="No space"):
            st.put("p000001-t0-results", {"results": []})
        assert not [n for n in os.listdir(st.dir) if n.endswith(".tmp") and n.startswith("p000001")]
    finally:
        monkeypatch.undo()
        st.close()


@pytest.mark.slow
def test_the_progress_timeout_is_finite_by_default_and_says_how_to_raise_it(tmp_path, monkeypatch):
    st = FileStore(str(tmp_path / "as-a-run-opens-it"), "r", "both")
    assert st.progress_timeout == -1 and st.progress_limit() == FileStore.AUTO_FLOOR  # auto: finite
    st.close()
    monkeypatch.setattr(FileStore, "AUTO_FLOOR", 1.5)
    st = FileStore(str(tmp_path), "r", "main", timeout=30.0)
    stop, phase = threading.Event(), [-1]
    fake_peer(st.dir, "sub", stop, beat=lambda n: {"count": n, "phase": phase[0]})
    try:
        # a peer still starting (its cold start) is not held to it, and the limit counts from its
        # entering the schedule: 3 s starting, then the record 1 s into phase 0, no error
        threading.Timer(3.0, lambda: phase.__setitem__(0, 0)).start()
        threading.Timer(4.0, lambda: st.write("p000000-t0-results", {"ok": 1})).start()
        assert st.wait("p000000-t0-results") == ("p000000-t0-results", {"ok": 1})
        phase[0] = 7  # now in the schedule, and stuck
        t0 = time.time()
        with pytest.raises(StoreError, match=r"p000007-t0-results.*stays in phase 7.*raise FileStore.AUTO_FLOOR"):
            st.wait("p000007-t0-results")
        assert 1.5 <= time.time() - t0 < 10
        st.enter_phase(0)
        st.phase_start -= 2.0  # a phase of 2 s seen: the limit follows it, 10 x
        st.enter_phase(1)
        assert st.progress_limit() == pytest.approx(20.0, abs=0.5)
    finally:
        stop.set()
        st.close()


# ---------------------------------------------------------------------------------------
# The toy search server
# ---------------------------------------------------------------------------------------
@pytest.fixture
def server(monkeypatch):
    assert 0 < toy_server._Handler.timeout <= 30  # by default a silent connection is cut, soon
    monkeypatch.setattr(toy_server._Handler, "timeout", 1.0)
    srv = toy_server.make_server(0, max_connections=2)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


def closed_within(sock, seconds):
    """Does the server close this connection within `seconds`?"""
    sock.settimeout(seconds)
    try:
        return sock.recv(1024) == b""
    except socket.timeout:
        return False


def test_the_toy_server_closes_idle_and_half_sent_connections(server):
    port = server.server_address[1]
    idle, half = socket.create_connection(("127.0.0.1", port)), socket.create_connection(("127.0.0.1", port))
    half.sendall(b"GET /search?q=ada&kb=1 HT")
    t0 = time.time()
    assert closed_within(idle, 5) and closed_within(half, 5) and time.time() - t0 < 5


def test_the_toy_server_cuts_a_connection_that_trickles(server, monkeypatch):
    monkeypatch.setattr(toy_server._Handler, "total_timeout", 2.0)
    assert toy_server._Handler.total_timeout < 60  # by default too: 30 s
    with socket.create_connection(("127.0.0.1", server.server_address[1])) as s:
        t0, cut = time.time(), False
        for byte in b"GET /search?q=ada&kb=1&level=1 HTTP/1.0\r\n":  # a byte every 0.3 s: never silent 1 s
            try:
                s.sendall(bytes([byte]))
            except OSError:
                cut = True
                break
            if closed_within(s, 0.3):
                cut = True
                break
        assert cut and time.time() - t0 < 6


def test_the_toy_server_bounds_its_connections(server, monkeypatch):
    """At its bound (2 here) a new connection closes the oldest one that has sent no request: idle
    connections push out only each other, the bound holds, and a client is answered at once."""
    monkeypatch.setattr(toy_server._Handler, "timeout", 5.0)  # the held ones wait long
    port = server.server_address[1]
    held = []
    for _ in range(4):
        held.append(socket.create_connection(("127.0.0.1", port)))
        time.sleep(0.1)  # accepted in this order
    assert closed_within(held[0], 0.8) and closed_within(held[1], 0.8)  # long before their timeout
    assert not closed_within(held[2], 0.3) and not closed_within(held[3], 0.3)
    t0 = time.time()
    assert tools.HttpSearch(f"http://127.0.0.1:{port}", retries=0, timeout=5).search("ada", 1, 1)
    assert time.time() - t0 < 2
    for s in held:
        s.close()


def test_the_toy_server_builds_result_urls_from_its_own_address(server):
    port = server.server_address[1]
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"GET /search?q=ada&format=json&kb=3&level=1 HTTP/1.0\r\nHost: evil.example:80\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    results = json.loads(data.split(b"\r\n\r\n", 1)[1])["results"]
    assert results and all(r["url"].startswith(f"http://127.0.0.1:{port}/page/") for r in results)
