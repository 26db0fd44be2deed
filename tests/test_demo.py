"""The default demo, `python mgrpo.py --seed S`, learns: sampled success at least 0.9 at the end.
One seed here, for CI's time (it takes about three minutes); docs/demo.md has three."""
import pytest

import mgrpo


@pytest.mark.slow
def test_the_default_demo_learns(tmp_path):
    s = mgrpo.main(["--seed", "1", "--out", str(tmp_path)])
    assert s["eval_success_end"] >= 0.9 and s["eval_greedy_success_end"] >= 0.95, s
    assert s["eval_success_end"] >= s["eval_success_start"] + 0.25, s  # learned by RL, not by the cold start
