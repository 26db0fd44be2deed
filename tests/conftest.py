import os
import threading

import pytest

import mgrpo
import toy_tools


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: trains or runs whole processes (the fast tier: -m 'not slow')")


def pytest_collection_modifyitems(items):
    for item in items:  # a test that needs the trained cold start is slow
        if "cold_start_dir" in item.fixturenames:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def cold_start_dir(tmp_path_factory):
    """The default cold start (the stage-1 stand-in), saved once for the tests that need
    agents which already follow the format: about 100 s on 2 CPU cores."""
    out = str(tmp_path_factory.mktemp("cold"))
    mgrpo.main(["--steps", "0", "--eval-questions", "32", "--out", out])
    return {name: os.path.join(out, name) for name in ("main", "sub")}


@pytest.fixture(scope="module")
def server_url():
    """The toy search tool as an HTTP server on a free local port."""
    srv = toy_tools.make_server(0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
