"""Bring your own task: a second, different tiny task (tests/sum_task.py) trains through the
task interface, with mgrpo.py as it is."""
import functools
import json
import os

import pytest

import helpers
import mgrpo
import run

TASK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sum_task.py")


@pytest.mark.slow
def test_a_second_task_trains_through_the_interface(tmp_path):
    summary = mgrpo.main(["--task", TASK, "--cold-start", '{"steps": 200, "lr": 3e-3}', "--steps", "5", "--eval-questions",
                    "32", "--eval-every", "0", "--questions-per-step", "4", "--out", str(tmp_path)])
    task = run.load_task(TASK)
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    steps = [r for r in rows if "eval" not in r]
    assert len(steps) == 5 == summary["steps"] and all("sub_reward" in r for r in steps)
    # after its cold start, M writes this task's format (R_M >= 0.1 where valid; on average over the steps, as
    # one invalid rollout of a group with no success pulls a step's mean under it) and delegates, S's answers score
    assert sum(r["main_reward"] for r in steps) / len(steps) >= 0.1, steps
    assert all(r["sub_calls"] > 0 and r["sub_reward"] > 0.1 for r in steps), steps
    # the agents speak this task's words: a greedy rollout asks S for values and answers with a sum
    args = mgrpo.parse_args(["--task", TASK])
    main, sub = (helpers.load_agent(str(tmp_path / n), args, 0) for n in ("main", "sub"))
    q = task.make_question(mgrpo.EVAL_SEED, 1)
    trajs, sub_trajs = mgrpo.rollout(main, [q], 1, args, 0, functools.partial(
        mgrpo.run_sub_agents, sub, args, task.search_tool()), task.search_tool(), greedy=True)
    assert [t.task.split()[:2] for t in sub_trajs] == [["value", "of"]] * len(sub_trajs) and sub_trajs
    assert trajs[0].result in task.NUMBERS
