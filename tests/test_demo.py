"""The default demo, `python mgrpo.py --seed S`, learns: sampled success at least 0.9 at the end.
Two seeds here, for CI's time; docs/demo.md has three."""
import pytest

import mgrpo


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
def test_the_default_demo_learns(seed, tmp_path):
    s = mgrpo.main(["--seed", str(seed), "--out", str(tmp_path)])
    assert s["eval_success_end"] >= 0.9 and s["eval_greedy_success_end"] >= 0.95, s
    assert s["eval_success_end"] >= s["eval_success_start"] + 0.25, s  # learned by RL, not by the cold start
