"""Decoupled training (the paper's Fig. 3): the file store, and the two roles as two processes."""
import json
import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from store import FileStore

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = ["--steps", "10", "--cold-start", "0", "--questions-per-step", "4", "--group-size", "4",
       "--eval-questions", "16", "--eval-every", "5", ]

pytestmark = pytest.mark.slow  # every test here trains models or runs processes


def test_store_roundtrip_keys_and_prune(tmp_path):
    st = FileStore(str(tmp_path), "r1", "main")
    try:
        st.put("p000001-t0-tasks", {"tasks": ["city of ada"]})
        assert st.read("p000001-t0-tasks") == {"tasks": ["city of ada"]}
        assert st.read("p000001-t1-tasks") is None
        assert st.wait("nope", "p000001-t0-tasks")[0] == "p000001-t0-tasks"
        for bad in ["../x", "/etc/passwd", "a/b", ".hidden", "", "a..b", "x" * 200, None]:
            with pytest.raises(ValueError):
                st.put(bad, {})
        with pytest.raises(ValueError):
            FileStore(str(tmp_path), "../escape", "main")
        st.put("p000003-done", {})
        st.put("run", {"seed": 1})
        stale = os.path.join(st.dir, "p000009-done.json.123.456.tmp")  # left by a killed writer
        open(stale, "w").close()
        os.utime(stale, (time.time() - 3600, time.time() - 3600))
        st.prune(2)
        names = sorted(os.listdir(st.dir))
        assert "p000001-t0-tasks.json" not in names and "p000003-done.json" in names and "run.json" in names
        assert not os.path.exists(stale)  # (the heartbeat thread's own write may be in flight: spared)
        assert not [n for n in names if n.endswith(".tmp") and not n.startswith("heartbeat-main.json")]
    finally:
        st.close()


def _writer(root, w, n):
    st = FileStore(root, "stress", "writer")
    for i in range(n):
        st.put(f"w{w}-r{i}", {"w": w, "i": i, "payload": "x" * (i % 97) * 20, "check": w * 100003 + i})


def _reader(root, writers, n, q):
    st = FileStore(root, "stress", "reader")
    seen = 0
    for i in range(n):
        for w in range(writers):
            while (rec := st.read(f"w{w}-r{i}")) is None:
                time.sleep(0.0005)
            assert rec["check"] == w * 100003 + i and len(rec["payload"]) == (i % 97) * 20
            seen += 1
    q.put(seen)


def test_stress_many_writers_and_readers_lose_nothing(tmp_path):
    """4 writer and 3 reader processes, 2,400 records: every reader reads every record
    whole (a partial JSON file would fail to parse or to check)."""
    writers, readers, n = 4, 3, 600
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_reader, args=(str(tmp_path), writers, n, q)) for _ in range(readers)]
    procs += [ctx.Process(target=_writer, args=(str(tmp_path), w, n)) for w in range(writers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(240)
        assert p.exitcode == 0
    assert sorted(q.get(timeout=5) for _ in range(readers)) == [writers * n] * readers


@pytest.fixture(scope="module")
def models(cold_start_dir):
    return ["--main-model", cold_start_dir["main"], "--sub-model", cold_start_dir["sub"]]


def _cmd(*extra):
    return [sys.executable, os.path.join(ROOT, "mgrpo.py"), *RUN, *extra]


def _rows(out, evals=False):
    keep = ("step", "eval", "eval_success", "main_reward", "sub_reward", "success", "n_dup", "n_drop", "d_k")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [{k: r[k] for k in keep if k in r} for r in rows if ("eval" in r) == evals]


def _two_processes(tmp_path, name, *extra, kills=0, seed=0):
    """Both roles as processes; with kills > 0, SIGKILL a random role at random moments and
    restart it with --resume. Returns the two output folders."""
    store, outs = str(tmp_path / f"{name}-store"), {r: str(tmp_path / f"{name}-{r}") for r in ("main", "sub")}

    def start(role, resume):
        cmd = _cmd("--role", role, "--store", store, "--out", outs[role], *extra) + (["--resume"] if resume else [])
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    procs = {"main": start("main", False), "sub": start("sub", False)}
    rng = random.Random(seed)
    killed = []
    for i in range(kills):
        role = rng.choice(["main", "sub"])
        if i == 0:
            time.sleep(rng.uniform(0.5, 3.0))  # during start-up
        else:  # a random moment a few steps further on
            target = _progress(outs[role]) + rng.randint(1, 3)
            while _progress(outs[role]) < target and procs[role].poll() is None:
                time.sleep(0.02)
            time.sleep(rng.uniform(0.0, 0.3))
        if procs[role].poll() is not None:
            continue
        procs[role].send_signal(signal.SIGKILL)
        procs[role].wait()
        killed.append((role, _progress(outs[role])))
        procs[role] = start(role, True)
    for role, p in procs.items():
        _, err = p.communicate(timeout=400)
        assert p.returncode == 0, f"{role} failed:\n{err[-3000:]}"
    return outs, killed


def _progress(out):
    """How many metrics lines a role had written when it was killed."""
    try:
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return len(f.readlines())
    except FileNotFoundError:
        return 0


@pytest.fixture(scope="module")
def reference(tmp_path_factory, models):
    """The same run in one process (--role both), from the shared cold start."""
    out = str(tmp_path_factory.mktemp("both"))
    subprocess.run(_cmd("--out", out, *models), check=True, stdout=subprocess.DEVNULL, timeout=400)
    return out


def _main_and_sub_rows(outs):
    main, sub = _rows(outs["main"]), _rows(outs["sub"])
    assert [r["step"] for r in main] == list(range(1, 11)) and [r["step"] for r in sub] == list(range(1, 11))
    return [{**m, **s} for m, s in zip(main, sub)]


def test_two_processes_equal_one_process(reference, models, tmp_path):
    outs, _ = _two_processes(tmp_path, "sync", *models)
    assert _main_and_sub_rows(outs) == _rows(reference)
    assert _rows(outs["main"], evals=True) == _rows(reference, evals=True)
    with open(os.path.join(outs["main"], "summary.json")) as f:
        assert 0 < json.load(f)["store_share_of_step_time"] < 0.5


def test_lora_in_two_processes_equals_one_process(models, tmp_path):
    """--lora-rank with --role main / sub gives the one-process LoRA run step for step, each role
    training its own adapter (S's included: its adapter's gradient is logged)."""
    lora = ("--lora-rank", "4", "--lr", "3e-3")
    both = str(tmp_path / "lora-both")
    subprocess.run(_cmd("--out", both, *lora, *models), check=True, stdout=subprocess.DEVNULL, timeout=400)
    outs, _ = _two_processes(tmp_path, "lora", *lora, *models)
    assert _main_and_sub_rows(outs) == _rows(both)
    with open(os.path.join(outs["sub"], "metrics.jsonl")) as f:
        assert sum(json.loads(line).get("grad_norm_sub") or 0 for line in f) > 0
    assert os.path.exists(os.path.join(outs["sub"], "sub", "adapter_config.json"))


def test_unsync_is_equal_across_processes(reference, models, tmp_path):
    """--mode unsync in one process and in two gives the same run (that S trains on exactly the step
    before's batch is checked in test_glue.py)."""
    both = str(tmp_path / "unsync-both")
    subprocess.run(_cmd("--out", both, "--mode", "unsync", *models), check=True, stdout=subprocess.DEVNULL, timeout=400)
    ref, un = _rows(reference), _rows(both)
    assert ref[0] == un[0]           # step 1: the same rollouts; S's first update is deferred
    outs, _ = _two_processes(tmp_path, "unsync", "--mode", "unsync", *models)
    assert _main_and_sub_rows(outs) == un


def test_killed_roles_resume_without_losing_or_repeating_a_step(reference, models, tmp_path):
    outs, killed = _two_processes(tmp_path, "fault", *models, kills=5, seed=3)
    print("killed (role, metrics lines written):", killed)
    assert len(killed) >= 3 and any(n > 0 for _, n in killed)  # some kills landed mid-training
    assert _main_and_sub_rows(outs) == _rows(reference)
    assert _rows(outs["main"], evals=True) == _rows(reference, evals=True)


def test_a_run_refuses_an_old_store_and_mismatched_roles(tmp_path):
    store = str(tmp_path / "store")
    st = FileStore(store, "run", "sub")
    st.put("run", {"seed": 99})
    st.close()
    r = subprocess.run(_cmd("--role", "main", "--store", store, "--out", str(tmp_path / "m")),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "holds an earlier run" in r.stderr
