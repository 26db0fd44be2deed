import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading

import pytest

import mgrpo
import smollm2
import toy_server


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: trains or runs whole processes (the fast tier: -m 'not slow')")
    config.addinivalue_line("markers", "stage1: whole stage 1s, up to an hour; run only when -m names them "
                                       "(python -m pytest -q -m stage1 tests)")
    config.addinivalue_line("markers", "real: on SmolLM2-135M-Instruct, the real model (smollm2.py), in the full "
                                       "suite; -m real runs them alone")


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The two longest runs (several minutes each): started as processes of their own when collection
# ends, so that they train on the second core while the other tests run, and awaited by their
# tests, which go last. Fixture name -> mgrpo.py's options.
LONG_RUNS = {
    "demo_run": ["--seed", "1"],  # the default demo, `python mgrpo.py --seed 1`
    # docs/real-models.md's chat run, cut short: the same cold start, 50 RL steps of the 400
    "chat_run": ["--chat", "--cold-start", "chat", "--steps", "50",
                 "--lr", "1.5e-4", "--questions-per-step", "4", "--max-new-tokens", "40", "--eval-questions", "64",
                 "--eval-every", "50", "--seed", "1"],
}
_long = {"dir": None, "procs": {}}


def _uses(item, names):
    return any(n in item.fixturenames for n in names)


def pytest_collection_modifyitems(config, items):
    if "stage1" not in (config.getoption("markexpr") or ""):  # the stage-1 tier is asked for by name
        tier = [item for item in items if item.get_closest_marker("stage1")]
        if tier:
            config.hook.pytest_deselected(items=tier)
            items[:] = [item for item in items if not item.get_closest_marker("stage1")]
    for item in items:  # a test that needs the trained cold start, a long run or the real model is slow
        if _uses(item, ["cold_start_dir", "smollm2_dir", *LONG_RUNS]) or item.get_closest_marker("real"):
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: _uses(item, LONG_RUNS))  # stable: the long runs' tests last


def pytest_collection_finish(session):
    needed = {n for item in session.items for n in LONG_RUNS if n in item.fixturenames}
    if not needed or session.config.option.collectonly:
        return
    _long["dir"] = tempfile.mkdtemp(prefix="mgrpo-long-")
    env = dict(os.environ, OMP_NUM_THREADS="1")  # one core each: the tests keep the other
    for name in sorted(needed):
        out = os.path.join(_long["dir"], name)
        log = open(out + ".log", "w")
        cmd = [sys.executable, os.path.join(ROOT, "mgrpo.py"), *LONG_RUNS[name], "--out", out]
        _long["procs"][name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT), out)
        log.close()


def pytest_sessionfinish(session):
    for proc, _ in _long["procs"].values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if _long["dir"]:
        shutil.rmtree(_long["dir"], ignore_errors=True)


def _await(name):
    """(summary.json, output folder) of a long run, once it has ended well."""
    if name not in _long["procs"]:
        pytest.fail(f"{name} was not started at collection")
    proc, out = _long["procs"][name]
    try:
        rc = proc.wait(timeout=3600)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = "killed after 3600 s"
    with open(out + ".log", errors="replace") as f:
        tail = f.read()[-3000:]
    assert rc == 0, f"{name} ended with {rc}:\n{tail}"
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f), out


@pytest.fixture(scope="session")
def demo_run():
    return _await("demo_run")


@pytest.fixture(scope="session")
def chat_run():
    """Tiny chat models built by --chat, cold-started and trained by a short run: its summary and
    output folder (the agents saved as Hugging Face folders, for the tests that load them by path)."""
    return _await("chat_run")


@pytest.fixture(scope="session")
def cold_start_dir(tmp_path_factory):
    """The default cold start (the stage-1 stand-in), saved once for the tests that need
    agents which already follow the format: about 100 s on 2 CPU cores."""
    out = str(tmp_path_factory.mktemp("cold"))
    mgrpo.main(["--steps", "0", "--eval-questions", "32", "--out", out])
    return {name: os.path.join(out, name) for name in ("main", "sub")}


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """SmolLM2-135M-Instruct converted from its GGUF file, once a session, into a cache of the session's
    own (MGRPO_CACHE, which processes the tests start inherit): its folder."""
    os.environ["MGRPO_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    return smollm2.resolve("smollm2")


@pytest.fixture(scope="module")
def server_url():
    """The toy search tool as an HTTP server on a free local port."""
    srv = toy_server.make_server(0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
