"""The paper's comparisons (experiments/compare.py): the paired-difference statistics by hand, the
reports' figures recomputed, and a very short version end to end."""
import csv
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import mgrpo
from experiments import compare

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def weights(path):
    return AutoModelForCausalLM.from_pretrained(path).state_dict()


def same(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


def test_paired_interval_by_hand():
    # stage-1 means 0.2, 0.1, 0.6: mean 0.3, sample std sqrt(0.07), t(2) = 4.303
    mean, lo, hi = compare.paired_interval({1: [0.1, 0.3], 2: [0.0, 0.2], 3: [0.5, 0.7]})
    half = 4.303 * np.sqrt(0.07) / np.sqrt(3)
    assert (mean, lo, hi) == pytest.approx((0.3, 0.3 - half, 0.3 + half))
    assert compare.verdict(lo, hi) == "inconclusive"  # the interval [-0.36, +0.96] holds 0
    # the stage 1s are the units: seeds that agree within each stage 1 do not narrow the interval
    # (three seeds each or one, the same), though a pooled-pairs interval would shrink with them
    assert compare.paired_interval({1: [0.0] * 3, 2: [0.3] * 3, 3: [0.6] * 3}) == pytest.approx(
        compare.paired_interval({1: [0.0], 2: [0.3], 3: [0.6]}))
    assert compare.paired_interval({1: [0.0] * 3, 2: [0.3] * 3, 3: [0.6] * 3})[1] < 0.0  # wider than the range
    # differences of one sign everywhere, little spread: the ordering holds (or is reversed)
    assert compare.verdict(*compare.paired_interval({1: [0.1], 2: [0.12], 3: [0.09]})[1:]) == "holds"
    assert compare.verdict(*compare.paired_interval({1: [-0.1], 2: [-0.12], 3: [-0.09]})[1:]) == "reversed"
    # one stage 1: no interval, and no ordering claimed
    mean, lo, hi = compare.paired_interval({1: [0.2, 0.2, 0.2]})
    assert mean == pytest.approx(0.2) and np.isnan(lo) and compare.verdict(lo, hi) == "inconclusive"
    assert compare.t975(2) == 4.303 and compare.t975(11) == 2.228 and compare.t975(100) == 1.96


def test_falls_name_the_runs_that_dropped_below_their_start():
    plan = {"paper/co-train-stage1seed1-seed1": ("co-train", 1, 1, ""),
            "paper/co-train-stage1seed2-seed2": ("co-train", 2, 2, ""),
            "paper/main-only-stage1seed1-seed1": ("main-only", 1, 1, "")}
    curves = {"paper/co-train-stage1seed1-seed1": [(0, 0.8), (25, 0.61), (50, 0.9)],  # 0.19 below: no fall
              "paper/co-train-stage1seed2-seed2": [(0, 0.85), (25, 0.9), (50, 0.2), (75, 0.95)],  # recovered
              "paper/main-only-stage1seed1-seed1": [(0, 0.8), (25, 0.5), (50, 0.0)]}
    text = compare.falls(curves, plan)
    assert "co-train 1 of 2 (co-train-stage1seed2-seed2: 0.850 -> 0.200 at step 50)" in text
    assert "main-only 1 of 1 (main-only-stage1seed1-seed1: 0.800 -> 0.000 at step 50)" in text
    assert "stage1seed1-seed1: 0.800 -> 0.610" not in text


@pytest.mark.parametrize("report, row", [
    ("paper.md", "| co-train > main-only | level 2, 5 stage 1s x 3 seeds | 0.903 vs 0.595 | +0.308 [+0.239, +0.378] | "
                 "holds |"),
    ("unsync.md", "| sync > unsync | level 2, 5 stage 1s x 3 seeds | 0.864 vs 0.853 | +0.011 [-0.063, +0.085] | "
                  "inconclusive |"),
    ("single.md", "| co-train > single agent | level 3, 5 stage 1s x 2 seeds | 0.880 vs 0.966 | "
                  "-0.086 [-0.142, -0.031] | reversed |"),
    ("single-budget.md", "| co-train > single agent, every context 160 tokens | level 3, 5 stage 1s x 2 seeds, "
                         "`--max-context 160` | 0.880 vs 0.119 | +0.761 [+0.625, +0.898] | holds |"),
    ("geo-ordering.md", "| co-train > main-only, SmolLM2 as both agents | two-hop GeoNames questions, 32 held out, "
                        "3 stage 1s x 1 seed | 0.354 vs 0.385 | -0.031 [-0.503, +0.441] | inconclusive |")])
def test_the_results_tables_rows_are_recomputed_from_their_reports(capsys, report, row):
    """--recompute on each report of experiments/ gives the paired difference, interval and verdict that
    the README's table and the experiments' index state, and the arms' means."""
    path = os.path.join(ROOT, "experiments", report)
    arms, finals = compare.read_report(path)
    stage1s, seeds = map(int, re.search(r"(\d) stage 1s x (\d) seeds?", row).groups())  # as the row says
    assert sorted(finals) == list(range(1, stage1s + 1)) and all(len(f[arm]["sampled"]) == seeds for f in finals.values()
                                                     for arm in arms)
    compare.recompute([path])
    cells = [c.strip() for c in row.strip("|").split("|")]
    stated = [float(x) for x in re.findall(r"[-+][0-9.]+", cells[3])]  # mean, interval
    line = capsys.readouterr().out.splitlines()[1]
    got = [float(x) for x in re.search(r"\*\*([-+][0-9.]+)\*\*.*\[([-+][0-9.]+), ([-+][0-9.]+)\]", line).groups()]
    # the report's per-seed figures are rounded to three decimals, the README's from the runs' own
    assert got == pytest.approx(stated, abs=0.0015) and f"**{cells[4]}**" in line, line
    means = [np.mean([x for f in finals.values() for x in f[arm]["sampled"]]) for arm in arms]
    assert means == pytest.approx([float(x) for x in cells[2].split(" vs ")], abs=0.0015)
    for index in ("README.md", os.path.join("experiments", "README.md")):
        with open(os.path.join(ROOT, index)) as f:
            assert row in f.read(), index


def test_recompute_pools_the_stage1s_of_several_reports(tmp_path, capsys):
    def finals(x):
        return {"sampled": [x, x], "greedy": [1.0, 1.0], "start": [0.5] * 2, "greedy_start": [1.0] * 2}
    arms = ["co-train", "main-only"]
    for name, seeds in (("a", [1, 2]), ("b", [3])):
        table = compare.tables({(arm, s): finals(0.9 + 0.01 * s if arm == "co-train" else 0.8) for arm in arms
                                for s in seeds}, arms, seeds)
        (tmp_path / f"{name}.md").write_text(table + "\n")
    compare.recompute([str(tmp_path / "a.md"), str(tmp_path / "b.md")])
    out = capsys.readouterr().out
    assert "stage 1s [1, 2, 3]" in out and "**+0.120**" in out and out.count("holds") == 1  # greedy: all equal


def test_a_report_gives_each_arms_start_where_the_arms_start_from_different_stage1s(tmp_path):
    def finals(start):
        return {"sampled": [0.9, 0.8], "greedy": [1.0, 1.0], "start": [start] * 2, "greedy_start": [1.0] * 2}
    arms = ["co-train", "single-agent"]
    text = compare.tables({("co-train", 1): finals(0.465), ("single-agent", 1): finals(0.68)}, arms, [1])
    assert "| 1 | 0.465 / 1.000 | 0.680 / 1.000 |" in text  # the single agent's own start, not the system's
    (tmp_path / "results.md").write_text(text + "\n")
    assert compare.read_report(str(tmp_path / "results.md")) == (
        arms, {1: {arm: {"sampled": [0.9, 0.8], "greedy": 1.0} for arm in arms}})
    both = ["co-train", "main-only"]
    same_start = compare.tables({(arm, 1): finals(0.8) for arm in both}, both, [1])
    assert "stage-1 seed" not in same_start  # one stage 1 for both arms: one start


def test_bad_options_fail_clearly(capsys):
    for argv, msg in [(["--resume"], "--resume needs the --out"),
                      (["--seeds", "1", "1"], "must not repeat"),
                      (["--stage2-steps", "0"], "--stage2-steps"),
                      (["--stage1-levels", "0"], "--stage1-levels >= 1"),
                      (["--cold-start", '{"batch": 0}'], "--cold-start: steps must be >= -1, batch >= 1"),
                      (["--cold-start", '{"lr": 0}'], "lr > 0"),
                      (["--cold-start", '{"warmup": 1.5}'], "are shares"),
                      (["--cold-start", '{"draws": 2}'], "unknown fields ['draws']"),
                      (["--cold-start", '[1]'], "--cold-start: not a JSON object"),
                      (["--cold-start", '{"steps": '], "--cold-start: Expecting value"),
                      (["--experiment", "other"], "invalid choice")]:
        with pytest.raises(SystemExit):
            compare.parse(argv)
        assert msg in capsys.readouterr().err


def test_each_experiment_has_its_own_stage1_and_options_override_it():
    paper, single = compare.parse([]), compare.parse(["--experiment", "single"])
    # stage 1 is the cold start alone unless asked (the paper's RL steps broke M's plan in some stage 1s)
    assert (paper.stage1_steps, paper.stage1_levels, single.stage1_steps, single.stage1_levels) == (0, [1, 2], 0, [1, 2, 3])
    # the cold start per kind of stage 1, whatever the experiment; the experiment's demo levels
    for a, levels in ((paper, [1, 2, 2]), (single, [1, 2, 3])):
        assert a.cold["system"] == {"levels": levels, "steps": 1200, "batch": 64, "lr": 1.5e-3, "warmup": 0.05,
                                    "decay": 1.0, "until": 0.95, "uniform_first_layer": True}
        assert a.cold["single"] == {**a.cold["system"], "steps": 2400, "batch": 32}
    assert paper.model_size == single.model_size == "0.4M"  # stage 1 builds 4-layer models
    mine = compare.parse(["--experiment", "single", "--stage1-steps", "5", "--stage1-levels", "3",
                          "--cold-start", '{"steps": 10, "levels": [3], "until": 0}'])
    assert (mine.stage1_steps, mine.stage1_levels) == (5, [3])
    for kind in ("system", "single"):
        assert mine.cold[kind] == {**single.cold[kind], "steps": 10, "levels": [3], "until": 0}
    assert compare.parse(["--quick"]).cold["single"] == {**paper.cold["single"], "steps": 80, "until": 0.05}
    # five stage 1s by default; unsync's stage 2 is shorter unless asked
    assert paper.stage1_seeds == [1, 2, 3, 4, 5] and (paper.stage2_steps, single.stage2_steps) == (90, 90)
    # three stage-2 seeds per stage 1, one where the single agent's stage 1s take the time (level 3)
    assert (paper.seeds, single.seeds, compare.parse(["--experiment", "single", "--seeds", "4"]).seeds) == (
        [1, 2, 3], [1], [4])
    assert compare.parse(["--experiment", "unsync"]).stage2_steps == 80
    assert compare.parse(["--experiment", "unsync", "--stage2-steps", "7"]).stage2_steps == 7
    # every toy experiment's stage 2 clips gradients at 0.1, keeps both arms near stage 1 (KL 0.04) and bounds
    # each update's move of a policy (0.05 per token); geo's runs SmolLM2's RL as experiments/geo.md does
    for name, (_, stage2, _) in compare.EXPERIMENTS.items():
        if name == "geo":
            assert not {"--grad-clip", "--kl-coef"} & set(stage2) and stage2[stage2.index("--max-kl") + 1] == "0.05"
            continue
        assert stage2[stage2.index("--grad-clip") + 1] == "0.1", name
        assert stage2[stage2.index("--kl-coef") + 1] == "0.04", name
        assert stage2[stage2.index("--max-kl") + 1] == "0.05", name


def test_the_context_budget_setting_is_single_with_one_option_more_and_its_stage1s():
    """'single-budget' reuses the single experiment's stage 1s (the same options, so the same folders)
    and differs from it in stage 2 by the context budget alone, the same for both arms."""
    plans = {e: compare.plan_runs(compare.parse(["--experiment", e]), "/out") for e in ("single", "single-budget")}
    assert plans["single"][0] == plans["single-budget"][0] and len(plans["single"][0]) == 10
    for name, argv in plans["single"][1].items():
        budget = plans["single-budget"][1][name.replace("single/", "single-budget/")]
        assert budget[:budget.index("--max-context")] + budget[budget.index("--max-context") + 2:] == argv
        assert budget[budget.index("--max-context") + 1] == "160"


def test_the_real_model_experiment_starts_stage_2_from_smollm2s_own_stage_1s(tmp_path, monkeypatch):
    """'geo': three stage 1s, each SmolLM2 as both agents given the smollm2 cold start on the question file,
    under names of their own (not the toy's stage 1s of level 1); stage 2 starts each arm from them, 20 steps
    evaluated at both ends on 32 questions, and every command is one mgrpo.py takes (here over the tests'
    small world in the place of data/geo/)."""
    from test_qa import write_qa
    monkeypatch.chdir(tmp_path)
    os.makedirs("data/geo")
    write_qa(tmp_path / "data" / "geo")
    a = compare.parse(["--experiment", "geo"])
    assert (a.arms, a.stage1_seeds, a.seeds, a.stage2_steps, a.eval_every, a.eval_questions, a.jobs) == (
        ["co-train", "main-only"], [1, 2, 3], [1], 20, 20, 32, 1)  # one SmolLM2 run at a time: 14 GiB each
    stage1, stage2, plan = compare.plan_runs(a, "out")
    assert list(stage1) == [f"stage1-geo-levels1-seed{s}-system" for s in (1, 2, 3)]
    for name in stage1:  # the folders stage 1 will write, as mgrpo.py checks a given model's
        for agent in ("main", "sub"):
            os.makedirs(f"out/{name}/{agent}")
            open(f"out/{name}/{agent}/config.json", "w").close()
    for name, argv in stage1.items():
        args = mgrpo.parse_args(argv)
        assert (args.main_model, args.sub_model, args.task, args.steps) == ("smollm2", "smollm2",
                                                                            "qa:data/geo/questions.jsonl", 0)
        assert args.cold_start.steps == 20 and args.cold_start.lr == 1e-4  # the smollm2 preset
    assert len(stage2) == 6
    for name, argv in stage2.items():
        args, (arm, s1, _, s1_name) = mgrpo.parse_args(argv), plan[name]
        assert args.main_model == f"out/{s1_name}/main" and args.sub_model == f"out/{s1_name}/sub"
        assert (args.mode, args.cold_start.steps, args.lr, args.search) == (
            arm, 0, (3e-5,), "bm25:data/geo/corpus.jsonl")
    assert compare.parse(["--experiment", "geo", "--eval-every", "5", "--stage1-seeds", "4"]).eval_every == 5
    assert compare.parse(["--experiment", "geo", "--quick"]).cold["system"]["steps"] == 2


@pytest.mark.slow
def test_quick_comparison_end_to_end(tmp_path, capsys):
    out = tmp_path / "cmp"
    argv = ["--quick", "--seeds", "1", "--out", str(out)]  # one stage-2 seed per stage 1: the pipeline, sooner
    # --stage1-only: the stage 1s alone, their checks reported; the full comparison then reuses them
    assert compare.main(argv + ["--stage1-only"]) == 2
    md = (out / "paper" / "stage1.md").read_text()
    assert md.startswith("# Stage 1s: 2 of 2 passed") and md.count("cold-start check passed after 1 round(s)") == 2
    assert not (out / "paper" / "results.md").exists() and '"until": 0.05' in md
    capsys.readouterr()
    first = compare.main(argv + ["--resume"])
    assert capsys.readouterr().out.count("  reused ") == 2  # the stage 1s
    # --resume reuses every finished run and reports the same figures
    capsys.readouterr()
    again = compare.main(argv + ["--resume"])
    assert again["finals"] == first["finals"] and again["pair"] == first["pair"]
    printed = capsys.readouterr().out
    assert printed.count("  reused ") == 2 + 2 * 2 * 1 and "  start " not in printed  # nothing ran again
    md = (out / "paper" / "results.md").read_text()
    for arm in ("co-train", "main-only"):
        assert f"| {arm} |" in md
    assert "Paired difference co-train - main-only" in md and "95% t-interval over the 2 stage 1s" in md
    assert "--mode main-only" in md and '"levels": [1, 2, 2]' in md  # every command is written down
    assert md.count('"uniform_first_layer": true') == 2  # the stage 1s build their models with it
    # stage 1's RL is guarded as stage 2's is (at clip 1.0 and no KL it broke M's level-2 plan), and its
    # KL reference is the cold start that the run made
    assert md.count("--steps 2 --eval-every 0 --seed 1 --grad-clip 0.1 --kl-coef 0.04") == 1
    assert (out / "stage1-levels122-seed1-system" / "ref" / "main").is_dir()
    assert md.count("cold-start check passed after 1 round(s)") == 2  # each stage 1 says how its check went
    # a stage 1 that other runs start from is never replaced by one with other options, resumed or not
    for resume in ([], ["--resume"]):
        with pytest.raises(RuntimeError, match="holds a run with other options"):
            compare.main(["--quick", "--out", str(out), "--stage1-levels", "1"] + resume)
    with open(out / "paper" / "curves.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 * 2 * 1 * 3  # arms x stage 1s x seeds x evaluations (steps 0, 2, 4)
    assert {r["step"] for r in rows} == {"0", "2", "4"} and {r["stage1_seed"] for r in rows} == {"1", "2"}
    # The arms start from their stage 1: before any stage-2 step they evaluate alike, run by run,
    # and the two stage 1s differ
    start = {(r["arm"], r["stage1_seed"], r["seed"]): r["sampled_success"] for r in rows if r["step"] == "0"}
    for s1 in ("1", "2"):
        assert start[("co-train", s1, "1")] == start[("main-only", s1, "1")]
    assert not same(weights(out / "stage1-levels122-seed1-system" / "sub"), weights(out / "stage1-levels122-seed2-system" / "sub"))
    # main-only leaves S as stage 1 made it; co-training moves it
    s1 = weights(out / "stage1-levels122-seed2-system" / "sub")
    assert same(s1, weights(out / "paper" / "main-only-stage1seed2-seed1" / "sub"))
    assert not same(s1, weights(out / "paper" / "co-train-stage1seed2-seed1" / "sub"))
    # ... and stage 2 keeps the first layer uniform: its query and key weights still 0
    q = weights(out / "paper" / "co-train-stage1seed2-seed1" / "sub")["model.layers.0.self_attn.q_proj.weight"]
    assert not q.any() and s1["model.layers.1.self_attn.q_proj.weight"].any()
    # the paired difference is the mean of the per-run differences
    fin = first["finals"]
    diffs = [a - b for s in (1, 2) for a, b in zip(fin[("co-train", s)]["sampled"], fin[("main-only", s)]["sampled"])]
    assert first["pair"][0] == pytest.approx(np.mean(diffs))
    try:
        import matplotlib  # noqa: F401  (optional: the plot is drawn only when it is installed)
        assert (out / "paper" / "curves.png").stat().st_size > 1000 and "![curves](curves.png)" in md
    except ImportError:
        assert "no plot" in md


def proc_stat(pid):
    """(state, parent pid) of a process from /proc, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state, ppid = f.read().rsplit(")", 1)[1].split()[:2]  # the fields after the name
        return state, int(ppid)
    except (OSError, ValueError):
        return None


def alive(pid):
    stat = proc_stat(pid)
    return stat is not None and stat[0] != "Z"


def live_children(pid):
    stats = {int(d): proc_stat(d) for d in os.listdir("/proc") if d.isdigit()}
    return [k for k, s in stats.items() if s is not None and s[0] != "Z" and s[1] == pid]


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads the process table from /proc (Linux)")
def test_runs_end_when_the_comparison_is_killed(tmp_path):
    """A killed compare.py (SIGKILL: no handler can run) leaves no run training on by itself."""
    p = subprocess.Popen([sys.executable, "-m", "experiments.compare", "--quick", "--out", str(tmp_path / "cmp")],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    log = tmp_path / "cmp" / "stage1-levels122-seed1-system" / "log.txt"
    try:
        deadline = time.time() + 120
        while not (log.exists() and "M-GRPO |" in log.read_text()) and time.time() < deadline:
            time.sleep(0.2)  # until a run is past its imports, into its cold start
        kids = live_children(p.pid)
        assert kids, "compare.py started no run"
    finally:
        p.kill()
        p.wait()
    deadline = time.time() + 10  # a run looks for its parent twice a second
    while any(map(alive, kids)) and time.time() < deadline:
        time.sleep(0.2)
    left = [k for k in kids if alive(k)]
    for k in left:  # a failure leaves nothing running behind it
        os.kill(k, signal.SIGTERM)
    assert not left, "a run outlived compare.py"


def test_the_stage1_report_says_which_passed_and_whether_there_was_a_check(tmp_path, capsys):
    check = {"passed": True, "rounds": 2, "greedy": {"1": 1.0, "3": 0.961}}
    done = {"a": {"sft_check": check, "wall_time_s": 600.0},
            "b": {"sft_check": {**check, "passed": False, "rounds": 4}, "wall_time_s": 1200.0}}
    assert compare.stage1_report(done, {"a": ["--seed", "1"], "b": ["--seed", "2"]}, str(tmp_path), " ".join) == 1
    md = (tmp_path / "stage1.md").read_text()
    assert md.startswith("# Stage 1s: 1 of 2 passed") and "passed after 2 round(s), greedy level 1 1.000, level 3 0.961" in md
    assert "**not passed** after 4 round(s)" in md and "| 20.0 |" in md and "`--seed 2 --out <out>/b`" in md
    unchecked = {"a": {"wall_time_s": 60.0}}
    assert compare.stage1_report(unchecked, {"a": []}, str(tmp_path), " ".join) == 0
    assert (tmp_path / "stage1.md").read_text().startswith("# Stage 1s: 1, without a cold-start check")
