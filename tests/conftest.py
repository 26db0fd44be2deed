import os

import pytest

import mgrpo


@pytest.fixture(scope="session")
def cold_start_dir(tmp_path_factory):
    """The default cold start (the stage-1 stand-in), saved once for the tests that need
    agents which already follow the format: about 100 s on 2 CPU cores."""
    out = str(tmp_path_factory.mktemp("cold"))
    mgrpo.main(["--steps", "0", "--eval-questions", "32", "--out", out])
    return {name: os.path.join(out, name) for name in ("main", "sub")}
