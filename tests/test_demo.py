"""The default demo, `python mgrpo.py --seed S`, learns: sampled success at least 0.9 at the end.
One seed here, for CI's time (a process of its own, started when collection ends: tests/conftest.py);
experiments/demo.md has three."""


def test_the_default_demo_learns(demo_run):
    s, _ = demo_run
    assert s["eval_success_end"] >= 0.9 and s["eval_greedy_success_end"] >= 0.95, s
    assert s["eval_success_end"] >= s["eval_success_start"] + 0.25, s  # learned by RL, not by the cold start
