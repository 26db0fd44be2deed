"""The paper's comparisons, rerun on the toy task over several stage 1s and seeds, with the
uncertainty that comes from both.

Every run follows the paper's two-stage curriculum. Stage 1, once per --stage1-seeds: a cold
start on noisy scripted demos of the task's levels (the stand-in for a pretrained model) that
goes on until the system passes a greedy check on each level (ColdStart.until). By default that is
all of stage 1, a departure from the paper, whose stage 1 also trains with RL on easy questions:
here those RL steps broke M's level-2 plan in 2 of 5 stage 1s, and in 1 of 5 with RL guarded
(experiments/README.md), so the comparison measured which stage 1 broke. --stage1-steps N adds
the paper's RL steps, on questions of level 1 and of the harder levels in turn (--stage1-levels;
a 0.2M main agent trained on two-hop questions alone forgets how to plan three hops). Stage 2:
every arm starts from that stage 1 and trains --stage2-steps on harder questions, once per
--seeds. The single agent gets a stage 1 of its own, built the same way. Arms (the paper's Sec. 4):
  co-train          M-GRPO: both agents train
  co-train unsync   the same, S trained one step behind (the paper's off-policy version)
  main-only         S frozen as stage 1 left it, M trains
  single-agent      one model that searches for itself, plain GRPO

--experiment picks a setting and the two arms to compare (any --arms may be added):
  paper    level 2 (3 hops, 8 noisy snippets per search): co-train against main-only
  unsync   level 2, as paper: co-train against unsync
  single   level 3 (4 hops, 11 or 12 noisy snippets), where a single agent's context grows to about
           230 tokens while M's stays near 50: co-train against single-agent
  single-budget  as single, every agent's context capped at 160 tokens (--max-context), which one
           sub-task fits and the single agent's whole search does not
  geo      a real model: SmolLM2-135M-Instruct as both agents on two-hop questions over GeoNames' facts
           (first: python scripts/qa_files.py geo data/geo/ --hops 2), co-train against main-only; stage 1
           is the smollm2 cold start, stage 2 the RL of experiments/geo.md's command
Every toy experiment's stage 2 clips gradients at 0.1, not mgrpo.py's 1.0, adds a KL penalty to the stage-1
agents (--kl-coef 0.04) and halves any update that moved a policy by more than 0.05 per token on its own
batch (--max-kl 0.05); the paper has neither (experiments/README.md says why). geo's has the last alone.

    python -m experiments.compare --out runs/compare    # 'paper': 5 stage 1s x 3 seeds x 2 arms
    python -m experiments.compare --experiment unsync --out runs/compare --resume
    python -m experiments.compare --experiment single --out runs/compare --resume
    python -m experiments.compare --experiment single-budget --out runs/compare --resume
    python -m experiments.compare --quick               # a very short version, to check the pipeline

Each report in experiments/ gives its own wall time. The cold start rules the cost: one round of a
0.4M single agent on levels 1 to 3 (2400 steps of 32 demos, on one core) takes about 13 minutes,
and each round that fails the check adds one (experiments/stage1.md). --resume continues a
comparison that was cut off, after its last finished run or cold-start round.

The report gives each arm's final success over all runs and per stage 1, and the paired
difference (first arm - second arm, same stage 1 and seed) with a 95% t-interval over the stage 1s,
the independent units (each stage 1's seeds averaged first); the paper's ordering is said to hold
only when that interval excludes 0, and to be inconclusive otherwise. `--recompute REPORT...` prints
them again from reports already written. Writes <out>/<experiment>/results.md and curves.csv,
curves.png if matplotlib is installed, and per run a folder with its log, metrics.jsonl,
args.json and summary.json.
"""
import argparse
import csv
import json
import os
import re
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from cold_start import PRESETS, checked_cold_start

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARMS = {"co-train": ["--mode", "co-train"],
        "co-train unsync": ["--mode", "unsync"],
        "main-only": ["--mode", "main-only"],
        "single-agent": ["--mode", "single-agent"]}
# Every RL phase (stage 1's, where it has steps, and stage 2) clips gradients at 0.1, about their median norm
# here, not 1.0: at level 3, two of three co-train runs fell to 0 at 1.0. At level 2 that was not enough (2 of
# 30 runs fell for good), so RL also keeps each agent near where it started (stage 2: its stage-1 self; stage
# 1: its cold start) with a k3 KL penalty, 0.04 as in DeepSeekMath's GRPO; the paper has none. Stage 1's RL
# had neither until it broke M's level-2 plan for 2 of 5 stage 1s (experiments/README.md). mgrpo.py's
# --grad-clip also clips the cold start, so a stage 1 with RL steps clips its cold start at 0.1 too. Neither bounds
# how far one update moves the policy, and on stage 1 5 single updates still flipped M's plan (a KL of 0.24 to 0.51
# per token on their own batch, against a median of 0.001): --max-kl 0.05 halves such a step until it moved less
# (experiments/stage2-probes.md); the paper has no such bound either
RL_GUARD = ["--grad-clip", "0.1", "--kl-coef", "0.04", "--max-kl", "0.05"]
GEO = ["--task", "qa:data/geo/questions.jsonl", "--search", "bm25:data/geo/corpus.jsonl", "--max-new-tokens", "64"]
SINGLE = ["--level", "3", "--max-sub", "4", "--max-turns", "5", "3", *RL_GUARD]  # 'single' and 'single-budget'
EXPERIMENTS = {  # arms (the paired difference is first - second), the stage-2 options, stage 1's defaults
    "paper": (["co-train", "main-only"], ["--level", "2", "--max-sub", "3", *RL_GUARD], {"levels": [1, 2, 2]}),
    # S at M's learning rate: at 1e-3 it drifted from stage 1 and sync co-training fell below its start;
    # 5e-4 did no better than M's rate (experiments/stage2-probes.md)
    "unsync": (["co-train", "co-train unsync"], ["--level", "2", "--max-sub", "3", *RL_GUARD],
               {"levels": [1, 2, 2], "stage2_steps": 80}),  # its stage 1s are the paper experiment's
    # one stage-2 seed per stage 1 by default: the single agent's stage 1s take 12 to 16 minutes each, and with
    # two seeds the experiment took 92.9 minutes from nothing (experiments/single.md), over its budget of 90. The
    # interval is over stage 1s either way; the reports ran --seeds 1 2, whose seed-1 runs are the default's
    "single": (["co-train", "single-agent"], SINGLE, {"levels": [1, 2, 3], "seeds": [1]}),
    # the paper's premise (Sec. 1): one context cannot hold a deep search. Every agent's context holds 160 tokens:
    # the single agent's four result lists took 234 to 245 in the single experiment, M's plan 50 to 58, S's
    # sub-tasks 67 to 111 (experiments/single-budget.md). Its stage 1s are the single experiment's
    "single-budget": (["co-train", "single-agent"], [*SINGLE, "--max-context", "160"],
                      {"levels": [1, 2, 3], "seeds": [1]}),
    # SmolLM2 on the real facts: stage 1 is experiments/geo.md's cold start, stage 2 its 20 RL steps with the
    # bound on one update's move (--max-kl 0.05: without it one update of seed 1 flipped M's plan from two
    # delegations to one, experiments/geo.md), but no clip at 0.1 (at lr 3e-5 M's gradient norms ran 0.3 to 0.8:
    # it would cut every step) and no KL penalty. On 2 cores a co-train step takes 50 s (bf16, AMX) to 90 s (fp32)
    # and an evaluation of 32 questions 70 to 90 s, so stage 2 is short, evaluated at its start and end
    "geo": (["co-train", "main-only"], [*GEO, "--questions-per-step", "2", "--group-size", "4", "--lr", "3e-5",
                                        "--max-kl", "0.05"],
            {"levels": [1], "stage1_seeds": [1, 2, 3], "seeds": [1], "stage2_steps": 20, "eval_every": 20,
             "eval_questions": 32, "jobs": 1,  # a SmolLM2 run holds about 14 GiB: two do not fit in 24
             "stage1": ["--main-model", "smollm2", "--sub-model", "smollm2", *GEO], "name": "stage1-geo",
             "cold": {kind: PRESETS["smollm2"] for kind in ("system", "single")}, "quick": {"steps": 2}}),
}
# Stage 1's cold start (mgrpo.py --cold-start), per kind of stage 1; the experiment adds its demos' levels. The
# system's: 1200 steps of 64 demos at lr 1.5e-3, whose rate warms up over 5% of the steps. The single agent's:
# 2400 steps of 32 (more updates, which its long level-3 demos needed). Both: another round from fresh weights
# until the system's greedy success reaches 0.95 on each demo level, and models whose first layer attends alike
# to every earlier token, so that no first-layer head copies a fact by its kind of word (experiments/stage1.md)
COLD_START = {"system": {"steps": 1200, "batch": 64, "lr": 1.5e-3, "warmup": 0.05, "decay": 1.0, "until": 0.95,
                         "uniform_first_layer": True},
              "single": {"steps": 2400, "batch": 32, "lr": 1.5e-3, "warmup": 0.05, "decay": 1.0, "until": 0.95,
                         "uniform_first_layer": True}}
# RL steps, where the experiment does not set its own. Stage 1 has none (see the docstring): at level 3, 60 steps
# on levels 1, 2, 3 in turn broke M's four-hop plan; at level 2, 60 steps broke it in 2 of 5 stage 1s
STAGE1_STEPS, STAGE2_STEPS = 0, 90
QUICK = {"steps": 80, "until": 0.05}  # --quick's cold start: the pipeline checked, nothing shown


def parse(argv=None):
    class Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
        pass  # the docstring as written (arms, experiments, examples), and every default
    p = argparse.ArgumentParser(prog="python -m experiments.compare", description=__doc__, formatter_class=Help)
    p.add_argument("--experiment", default="paper", choices=list(EXPERIMENTS), help="setting and arms, see above")
    p.add_argument("--arms", nargs="+", default=None, choices=list(ARMS), metavar="ARM",
                   help=f"arms to run, of {list(ARMS)}; default: the experiment's two")
    p.add_argument("--stage1-seeds", type=int, nargs="+", default=None,
                   help="one stage 1 per seed: the independent units of the intervals; default: 1 2 3 4 5 (geo: 1 2 3)")
    p.add_argument("--seeds", type=int, nargs="+", default=None,
                   help="stage-2 seeds, per stage 1 and arm; default: 1 2 3 (single, single-budget, geo: 1)")
    p.add_argument("--cold-start", default="{}", help="a JSON object of ColdStart fields (cold_start.py) over "
                   "each kind's stage-1 cold start (COLD_START, with the experiment's demo levels), e.g. "
                   "'{\"steps\": 600, \"until\": 0}'")
    p.add_argument("--model-size", default="0.4M",
                   help="size of the models that stage 1 builds (mgrpo.py --model-size); stage 2 starts from them. "
                        "0.4M, 4 layers of 4 heads: with 2 layers of 8 (0.2M) the copy of a word out of a long "
                        "result list was learned by some seeds and not others")
    p.add_argument("--stage1-steps", type=int, default=STAGE1_STEPS,
                   help="RL steps in stage 1, as the paper's stage 1 has; 0: the cold start alone")
    p.add_argument("--stage1-levels", type=int, nargs="+", default=None,
                   help="levels of stage 1's RL questions, in turn; default: each level of the demos once "
                        "(paper, unsync: 1 2; single: 1 2 3); 1: the paper's stage 1 of easy questions only")
    p.add_argument("--stage2-steps", type=int, default=None,
                   help="RL steps per stage-2 run; default: 90 (unsync: 80)")
    p.add_argument("--eval-every", type=int, default=None, help="evaluate every N stage-2 steps; default: 25 (geo: 20)")
    p.add_argument("--eval-questions", type=int, default=None,
                   help="held-out questions per evaluation; default: 256 (geo: 32)")
    p.add_argument("--jobs", type=int, default=None,
                   help="runs at once, the cores shared among them (tiny models do not gain from more than one); "
                        "default: 2 where there are 2 cores (geo: 1)")
    p.add_argument("--extra", default="", help="more mgrpo.py options for every run, e.g. '--model-size 1M'")
    p.add_argument("--out", default="", help="output folder; empty: runs/compare-<time>")
    p.add_argument("--resume", action="store_true",
                   help="continue in --out: finished runs with the same options are reused (stage 1s across "
                        "experiments too), cut-off ones continue from their last checkpoint")
    p.add_argument("--recompute", nargs="+", metavar="REPORT", default=None,
                   help="run nothing: print the paired differences and their intervals over stage 1s from the "
                        "per-seed figures of reports this script wrote (several: their stage 1s pooled)")
    p.add_argument("--stage1-only", action="store_true",
                   help="run the stage 1s alone (of the arms' kinds: system, single agent) and report their "
                        "cold-start checks in <out>/<experiment>/stage1.md; --resume reuses them later")
    p.add_argument("--quick", action="store_true",
                   help="a very short version (2 stage 1s x 2 seeds, tiny budgets): checks the pipeline, shows nothing")
    return settled(p.parse_args(argv), p)


def settled(a, p):
    """The options with each experiment's defaults filled in and every one checked (p.error if not)."""
    if a.resume and not a.out:
        p.error("--resume needs the --out of the comparison to continue")
    a.arms = a.arms or EXPERIMENTS[a.experiment][0]
    own = EXPERIMENTS[a.experiment][2]
    a.stage2_steps = own.get("stage2_steps", STAGE2_STEPS) if a.stage2_steps is None else a.stage2_steps
    a.seeds = a.seeds or own.get("seeds", [1, 2, 3])
    a.stage1_seeds = a.stage1_seeds or own.get("stage1_seeds", [1, 2, 3, 4, 5])
    a.jobs = a.jobs or own.get("jobs", max(1, min(2, os.cpu_count() or 1)))
    a.eval_every = own.get("eval_every", 25) if a.eval_every is None else a.eval_every
    a.eval_questions = own.get("eval_questions", 256) if a.eval_questions is None else a.eval_questions
    try:
        mine = json.loads(a.cold_start)
        if not isinstance(mine, dict):
            raise ValueError("not a JSON object")
        # each kind's cold start, as mgrpo.py will take it: the experiment's levels, COLD_START's settings, yours
        a.cold = {kind: {"levels": own["levels"], **c, **(own.get("quick", QUICK) if a.quick else {}), **mine}
                  for kind, c in own.get("cold", COLD_START).items()}
        for c in a.cold.values():
            checked_cold_start(c)
    except (ValueError, TypeError, RecursionError) as e:
        p.error(f"--cold-start: {e}")
    a.stage1_levels = a.stage1_levels or sorted(set(a.cold["system"]["levels"]))
    if a.quick:
        a.stage1_seeds, a.seeds = a.stage1_seeds[:2], a.seeds[:2]
        a.stage1_steps, a.stage2_steps = 2, 4
        a.eval_every, a.eval_questions = 2, 16
    if a.stage1_steps < 0 or min(a.stage2_steps, a.eval_every, a.eval_questions, a.jobs, *a.stage1_levels) < 1:
        p.error("--stage1-steps must be >= 0, --stage2-steps, --eval-every, --eval-questions, --jobs and "
                "--stage1-levels >= 1")
    if len(set(a.stage1_seeds)) != len(a.stage1_seeds) or len(set(a.seeds)) != len(a.seeds):
        p.error("--stage1-seeds and --seeds must not repeat a seed")
    return a


def run(name, argv, out, resume=False, threads=1):
    """One mgrpo.py run in <out>/<name>, in its own process with `threads` threads that ends if this script
    does (killed, say); returns its summary.

    resume: a run that finished with the same options is reused, one that was cut off
    continues from its last checkpoint (mgrpo.py --resume)."""
    folder = os.path.join(out, name)
    os.makedirs(folder, exist_ok=True)
    cmd_file, summary_file = os.path.join(folder, "options.json"), os.path.join(folder, "summary.json")
    old = None
    if os.path.exists(cmd_file):  # never overwrite a run (a stage 1 that other runs start from) with another
        with open(cmd_file) as f:
            old = json.load(f)
        if old != argv:
            raise RuntimeError(f"{folder} holds a run with other options ({' '.join(map(str, old))}); "
                               "use another --out")
    if not resume and os.path.exists(os.path.join(folder, "args.json")):
        raise RuntimeError(f"{folder} holds a run: continue the comparison with --resume, or use another --out")
    if resume and old is not None:
        if os.path.exists(summary_file):
            print(f"  reused {name} (finished before)", flush=True)
            with open(summary_file) as f:
                return json.load(f)
    else:
        with open(cmd_file, "w") as f:
            json.dump(argv, f)
    cmd = [sys.executable, os.path.join(ROOT, "mgrpo.py"), *argv, "--out", folder] + (["--resume"] if resume else [])
    t0 = time.time()
    print(f"  start {name}", flush=True)
    with open(os.path.join(folder, "log.txt"), "a" if resume else "w") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                             env={**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
                                  "MGRPO_PARENT_PID": str(os.getpid())})  # a run ends with this script
    if rc != 0:
        with open(os.path.join(folder, "log.txt")) as f:
            tail = "".join(f.readlines()[-15:])
        raise RuntimeError(f"run {name} failed (exit {rc}); last lines of {folder}/log.txt:\n{tail}")
    with open(summary_file) as f:
        s = json.load(f)
    print(f"  done {name:36s} success {s['eval_success_start']:.3f} -> {s['eval_success_end']:.3f} "
          f"({time.time() - t0:.0f}s)", flush=True)
    return s


def curve(folder):
    """[(step, sampled success)] of one run's evaluations."""
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [(r["step"], r["eval_success"]) for r in rows if r.get("eval") == "sampled"]


def sub_movement(folder):
    """S's mean approximate KL (sampling policy -> the policy it updates, per token) and clipped share
    of tokens over a run's steps: about 0 on-policy; one step behind (unsync), how far one update
    moved S, and how much of that the clip absorbs."""
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if "approx_kl_sub" in r]
    if not rows:  # S does not train (main-only) or does not exist (single-agent)
        return None, None
    return float(np.mean([r["approx_kl_sub"] for r in rows])), float(np.mean([r["clip_frac_sub"] for r in rows]))


FALL = 0.2  # a fall: an evaluation this far below the run's start


def falls(curves_by_name, plan):
    """Markdown: per arm, the runs whose sampled success fell at some evaluation more than FALL below
    their start (an unstable update the run may or may not recover from), with the lowest point."""
    out = []
    for arm in dict.fromkeys(arm for arm, *_ in plan.values()):
        names = [n for n, (a, *_) in plan.items() if a == arm]
        low = {n: min(curves_by_name[n], key=lambda sv: sv[1]) for n in names}
        fell = [f"{n.split('/')[-1]}: {curves_by_name[n][0][1]:.3f} -> {low[n][1]:.3f} at step {low[n][0]}"
                for n in names if low[n][1] < curves_by_name[n][0][1] - FALL]
        out.append(f"{arm} {len(fell)} of {len(names)}" + (f" ({'; '.join(fell)})" if fell else ""))
    return (f"Falls (an evaluation more than {FALL} below the run's start): " + ", ".join(out) + ".")


# 97.5% quantiles of Student's t, by degrees of freedom (a t-interval needs no scipy)
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}


def t975(df):
    """Student's t 97.5% quantile: the table's, or its next smaller df's (a wider interval); 1.96 past 30."""
    return T975[max(k for k in T975 if k <= df)] if df <= 30 else 1.96


def paired_interval(diffs):
    """Mean of the paired differences {stage-1 seed: [difference per stage-2 seed]} and its 95%
    t-interval over stage 1s. The stage 1s are the independent units: runs that share a stage 1 move
    together, so each stage 1's seeds are averaged first, and the interval is the t-interval of
    those means (n - 1 degrees of freedom). With one stage 1 there is no interval (NaN)."""
    means = np.array([np.mean(v) for v in diffs.values()], dtype=float)
    if len(means) < 2:
        return float(means.mean()), float("nan"), float("nan")
    half = t975(len(means) - 1) * means.std(ddof=1) / np.sqrt(len(means))
    return float(means.mean()), float(means.mean() - half), float(means.mean() + half)


def verdict(lo, hi):
    """The ordering first arm > second arm: holds when the interval excludes 0 above it, reversed when
    it excludes 0 below, and inconclusive otherwise."""
    return "holds" if lo > 0 else "reversed" if hi < 0 else "inconclusive"


def paired_line(arms, metric, diffs):
    mean, lo, hi = paired_interval(diffs)
    return (f"Paired difference {arms[0]} - {arms[1]}, {metric} success at the end: **{mean:+.3f}**, 95% "
            f"t-interval over the {len(diffs)} stage 1s [{lo:+.3f}, {hi:+.3f}]: **{verdict(lo, hi)}** (per stage "
            "1: " + ", ".join(f"seed {s1} {np.mean(d):+.3f}" for s1, d in diffs.items()) + ").")


def read_report(path):
    """The arms and, per stage 1, each arm's sampled success per seed and greedy mean, from the
    per-stage-1 table of a report this script wrote (results.md)."""
    with open(path) as f:
        lines = [line for line in f if line.startswith("| ")]
    header = next(line for line in lines if line.startswith("| stage 1 | start of stage 2"))
    arms = re.findall(r"\| ([^|]+?): sampled at the end", header)
    finals = {}
    for line in lines:
        if m := re.match(r"\| seed (\d+) \| [0-9.]+ / [0-9.]+ \|(.*)\|$", line):
            cells = [c.strip() for c in m.group(2).split("|")]
            finals[int(m.group(1))] = {arm: {"sampled": [float(x) for x in re.findall(r"[0-9.]+", cells[2 * i])[1:]],
                                             "greedy": float(cells[2 * i + 1])} for i, arm in enumerate(arms)}
    return arms, finals


def recompute(paths):
    """The paired differences and their intervals over stage 1s, from the per-seed figures of reports
    (several reports of one experiment, over different stage 1s, pool their stage 1s)."""
    arms, finals = None, {}
    for path in paths:
        a, f = read_report(path)
        if arms not in (None, a):
            raise SystemExit(f"{path} compares {a}, the reports before it {arms}")
        arms = a
        finals.update(f)
    print(f"{', '.join(paths)}: {arms[0]} - {arms[1]}, stage 1s {sorted(finals)}")
    for metric in ("sampled", "greedy"):
        diffs = {s1: np.subtract(v[arms[0]][metric], v[arms[1]][metric]) for s1, v in sorted(finals.items())}
        print(paired_line(arms, metric, diffs))


def tables(finals, arms, stage1_seeds):
    """Markdown: each arm over all runs, then per stage 1. finals[(arm, s1)] = {metric: [per seed]}."""
    lines = ["| arm | sampled success at the end, mean ± std | greedy, mean ± std | runs |", "|---|---|---|---|"]
    for arm in arms:
        v = {m: np.concatenate([finals[(arm, s1)][m] for s1 in stage1_seeds]) for m in ("sampled", "greedy")}
        lines.append(f"| {arm} | {v['sampled'].mean():.3f} ± {v['sampled'].std():.3f} | "
                     f"{v['greedy'].mean():.3f} ± {v['greedy'].std():.3f} | {len(v['sampled'])} |")
    lines += ["", f"| stage 1 | start of stage 2 ({arms[0]}), sampled / greedy | "
              + " | ".join(f"{arm}: sampled at the end (per seed) | greedy" for arm in arms) + " |",
              "|---|---|" + "---|---|" * len(arms)]
    for s1 in stage1_seeds:
        start = finals[(arms[0], s1)]
        row = [f"seed {s1}", f"{np.mean(start['start']):.3f} / {np.mean(start['greedy_start']):.3f}"]
        for arm in arms:
            f = finals[(arm, s1)]
            row += [f"{np.mean(f['sampled']):.3f} ({', '.join(f'{x:.3f}' for x in f['sampled'])})",
                    f"{np.mean(f['greedy']):.3f}"]
        lines.append("| " + " | ".join(row) + " |")
    if len({arm == "single-agent" for arm in arms}) > 1:  # the arms start from different stage 1s: each one's start
        lines += ["", "| stage-1 seed | " + " | ".join(f"{arm}: start of stage 2, sampled / greedy" for arm in arms)
                  + " |", "|---|" + "---|" * len(arms)]
        lines += ["| " + " | ".join([str(s1)] + [f"{np.mean(finals[(arm, s1)]['start']):.3f} / "
                                                 f"{np.mean(finals[(arm, s1)]['greedy_start']):.3f}" for arm in arms])
                  + " |" for s1 in stage1_seeds]
    return "\n".join(lines)


def plot(curves, arms, stage1_seeds, path, title):
    """One panel per stage 1: each arm's mean sampled success over seeds, with its min-max band."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(stage1_seeds), figsize=(max(5.0, 3.2 * len(stage1_seeds)), 3.4), dpi=120,
                             sharey=True, squeeze=False)
    for ax, s1 in zip(axes[0], stage1_seeds):
        for arm in arms:
            steps = [s for s, _ in curves[(arm, s1)][0]]
            v = np.array([[x for _, x in c] for c in curves[(arm, s1)]])
            ax.plot(steps, v.mean(0), marker="o", ms=3, label=arm)
            ax.fill_between(steps, v.min(0), v.max(0), alpha=0.2)
        ax.set(xlabel="stage-2 step", title=f"stage 1 seed {s1}", ylim=(0, 1))
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("sampled success (held-out)")
    axes[0][-1].legend(loc="lower right", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def check_text(summary):
    """A stage 1's cold-start check, as its summary holds it: passed or not, rounds, greedy per level."""
    c = summary["sft_check"]
    return (f"cold-start check {'passed' if c['passed'] else '**not passed**'} after {c['rounds']} round(s), "
            "greedy " + ", ".join(f"level {lv} {x:.3f}" for lv, x in c["greedy"].items()))


def stage1_report(s1_done, stage1, exp_out, show):
    """--stage1-only: each stage 1's check and wall time, to <exp_out>/stage1.md; the share that passed."""
    rows = [f"| `{k}` | {check_text(v) if v.get('sft_check') else 'no check'} | {v['wall_time_s'] / 60:.1f} |"
            for k, v in s1_done.items()]
    passed = sum(bool(v.get("sft_check", {}).get("passed")) for v in s1_done.values())
    checked = any(v.get("sft_check") for v in s1_done.values())
    title = (f"{passed} of {len(s1_done)} passed their cold-start check" if checked else
             f"{len(s1_done)}, without a cold-start check (until 0)")
    md = "\n".join([f"# Stage 1s: {title}", "",
                     "| stage 1 | check | minutes (cold start and stage 1's RL) |", "|---|---|---|", *rows, "",
                     "## Commands", "", *[f"- `{k}`: `{show(v)} --out <out>/{k}`" for k, v in stage1.items()], ""])
    with open(os.path.join(exp_out, "stage1.md"), "w") as f:
        f.write(md)
    print("\n".join(rows) + f"\n{passed} of {len(s1_done)} stage 1s passed | {exp_out}/stage1.md")
    return passed


def plan_runs(a, out):
    """Every run's mgrpo.py options: ({stage-1 name: argv}, {stage-2 name: argv}, {stage-2 name: (arm,
    stage-1 seed, seed, its stage 1's name)}); a run's folder is <out>/<name>."""
    common = ["--eval-questions", str(a.eval_questions), *a.extra.split()]
    stage1, stage2_plan, plan = {}, {}, {}
    stage2, own = EXPERIMENTS[a.experiment][1:]
    # shared across experiments with the same stage 1s
    s1_prefix = own.get("name", "stage1") + "-levels" + "".join(map(str, a.cold["system"]["levels"]))
    # D and M's turns as in stage 2: stage 1 meets its hardest questions
    shape = [x for key, n in (("--max-sub", 1), ("--max-turns", 2)) if key in stage2
             for x in stage2[stage2.index(key):stage2.index(key) + 1 + n]]
    for s1 in a.stage1_seeds:
        base = ["--level", *map(str, a.stage1_levels), *shape, *own.get("stage1", ["--model-size", a.model_size]),
                "--steps", str(a.stage1_steps),
                "--eval-every", "0", "--seed", str(s1), *(RL_GUARD if a.stage1_steps else []), *common]
        if any(arm != "single-agent" for arm in a.arms):
            stage1[f"{s1_prefix}-seed{s1}-system"] = base + ["--cold-start", json.dumps(a.cold["system"])]
        if "single-agent" in a.arms:
            stage1[f"{s1_prefix}-seed{s1}-single"] = base + ["--cold-start", json.dumps(a.cold["single"]),
                                                             "--mode", "single-agent"]
    for arm in sorted(a.arms, key=lambda arm: arm == "single-agent"):
        for s1 in a.stage1_seeds:
            s1_name = f"{s1_prefix}-seed{s1}-" + ("single" if arm == "single-agent" else "system")
            init = ["--main-model", os.path.join(out, s1_name, "main")] + (
                [] if arm == "single-agent" else ["--sub-model", os.path.join(out, s1_name, "sub")])
            for seed in a.seeds:
                name = f"{a.experiment}/{arm.replace(' ', '-')}-stage1seed{s1}-seed{seed}"
                plan[name] = (arm, s1, seed, s1_name)
                stage2_plan[name] = [*stage2, "--cold-start", "none", "--steps", str(a.stage2_steps), "--eval-every",
                                     str(a.eval_every), *common, *ARMS[arm], *init, "--seed", str(seed)]
    return stage1, stage2_plan, plan


def collect(out, exp_out, plan, summaries):
    """Each stage-2 run's curve ({name: [(step, sampled success)]}, and by (arm, stage-1 seed)), and its
    final figures by (arm, stage-1 seed); the curves also to <exp_out>/curves.csv."""
    curves, finals, by_name = {}, {}, {}
    with open(os.path.join(exp_out, "curves.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["arm", "stage1_seed", "seed", "step", "sampled_success"])
        for name, (arm, s1, seed, _) in plan.items():
            c = by_name[name] = curve(os.path.join(out, name))
            curves.setdefault((arm, s1), []).append(c)
            w.writerows([arm, s1, seed, step, v] for step, v in c)
            s = summaries[name]
            fin = finals.setdefault((arm, s1), {"sampled": [], "greedy": [], "start": [], "greedy_start": [],
                                                "kl_sub": [], "clip_sub": []})
            kl, clip = sub_movement(os.path.join(out, name))
            fin["kl_sub"].append(kl)
            fin["clip_sub"].append(clip)
            for key, src in [("sampled", "eval_success_end"), ("greedy", "eval_greedy_success_end"),
                             ("start", "eval_success_start"), ("greedy_start", "eval_greedy_success_start")]:
                fin[key].append(s[src])
    return curves, finals, by_name


def findings(a, finals, by_name, plan):
    """The report's text: the tables, the paired differences with their intervals, the falls, S's
    movement; and the intervals ({metric: (mean, low, high)})."""
    text = [tables(finals, a.arms, a.stage1_seeds)]
    # the experiment's two arms when both ran, else the first two asked for
    paired = EXPERIMENTS[a.experiment][0] if set(EXPERIMENTS[a.experiment][0]) <= set(a.arms) else a.arms[:2]
    pairs = {}
    for m in ("sampled", "greedy") if len(paired) == 2 else ():
        diffs = {s1: np.subtract(finals[(paired[0], s1)][m], finals[(paired[1], s1)][m]) for s1 in a.stage1_seeds}
        pairs[m] = paired_interval(diffs)
        text.append(paired_line(paired, m, diffs))
    text.append(falls(by_name, plan))

    def run_mean(arm, key):  # over every stage 1 and seed
        return np.mean([x for s1 in a.stage1_seeds for x in finals[(arm, s1)][key]])
    moved = [arm for arm in a.arms if arm in ("co-train", "co-train unsync")]  # the arms in which S trains
    if moved:
        text.append("S's sampling policy against the one it updates, mean over steps and runs (about 0 "
                    "on-policy; one step behind, one update's movement): " + "; ".join(
            f"{arm}: approximate KL {run_mean(arm, 'kl_sub'):.1e} per token, clipped "
            f"{100 * run_mean(arm, 'clip_sub'):.2f}% of tokens" for arm in moved) + ".")
    return text, pairs


def results_md(a, text, s1_done, minutes, has_png, commands):
    """<exp_out>/results.md: the figures, the stage 1s, the plot and every run's command."""
    s1_lines = [f"- `{k}`: level-1 sampled success {v['eval_success_start']:.3f} -> {v['eval_success_end']:.3f}, "
                f"greedy {v['eval_greedy_success_end']:.3f}" + ("; " + check_text(v) if v.get("sft_check") else "")
                for k, v in s1_done.items()]
    return "\n".join([
        f"# Comparison '{a.experiment}': {', '.join(a.arms)}", "",
        f"{len(a.stage1_seeds)} stage 1s (seeds {', '.join(map(str, a.stage1_seeds))}) x {len(a.seeds)} stage-2 "
        f"seeds ({', '.join(map(str, a.seeds))}), {a.stage2_steps} stage-2 steps per run, {a.eval_questions} "
        f"held-out questions per evaluation; 'sampled' at temperature 1. This invocation took {minutes:.1f} min, "
        f"{a.jobs} runs at a time (runs reused by --resume take none).", "", *[t + "\n" for t in text],
        "Stage 1s:", *s1_lines, "",
        "![curves](curves.png)" if has_png else "(no plot: matplotlib is not installed)", "",
        "## Commands", "", "Each run is `python mgrpo.py <options>`, `<out>` the folder of this comparison; all "
        "other settings are mgrpo.py's defaults, and every run's full settings are in its `args.json`.", "",
        *commands, ""])


def main(argv=None):
    a = parse(argv)
    if a.recompute:
        return recompute(a.recompute)
    if a.experiment == "geo" and not os.path.exists(os.path.join(ROOT, "data", "geo", "questions.jsonl")):
        raise SystemExit("geo's questions are missing: run python scripts/qa_files.py geo data/geo/ --hops 2 first")
    out = os.path.abspath(a.out or os.path.join("runs", time.strftime("compare-%Y%m%d-%H%M%S")))
    exp_out = os.path.join(out, a.experiment)
    os.makedirs(exp_out, exist_ok=True)
    t_start = time.time()
    stage1, stage2_plan, plan = plan_runs(a, out)

    def show(argv):  # as a shell reads it, the folders as <out>/..., so results.md reads the same on any machine
        return shlex.join(argv).replace(out, "<out>")

    print(f"comparison '{a.experiment}' -> {exp_out}\nevery run: python mgrpo.py <options> --out <folder>, "
          f"mgrpo.py's defaults for the rest (saved in each run's args.json)", flush=True)
    print(f"stage 1: {len(stage1)} runs; stage 2: {len(plan)} runs; {a.jobs} at a time", flush=True)

    def after(stage1_job, name):
        stage1_job.result()  # raises if its stage 1 failed
        return run(name, stage2_plan[name], out, a.resume, threads)

    threads = max(1, (os.cpu_count() or 1) // a.jobs)  # the cores shared among the runs at once
    with ThreadPoolExecutor(a.jobs) as pool:
        # a stage-2 run starts once its own stage 1 is done; the queue holds every stage 1 before
        # the runs that wait for it, so none waits forever
        s1_jobs = {name: pool.submit(run, name, argv, out, a.resume, threads) for name, argv in stage1.items()}
        if a.stage1_only:
            return stage1_report({name: f.result() for name, f in s1_jobs.items()}, stage1, exp_out, show)
        s2_jobs = {name: pool.submit(after, s1_jobs[plan[name][3]], name) for name in plan}
        s1_done = {name: f.result() for name, f in s1_jobs.items()}
        summaries = {name: f.result() for name, f in s2_jobs.items()}

    curves, finals, by_name = collect(out, exp_out, plan, summaries)
    minutes = (time.time() - t_start) / 60
    text, pairs = findings(a, finals, by_name, plan)
    title = f"'{a.experiment}': {len(a.seeds)} seeds per stage 1, mean and min-max"
    has_png = plot(curves, a.arms, a.stage1_seeds, os.path.join(exp_out, "curves.png"), title)
    commands = [f"- `{name}`: `{show(argv)} --out <out>/{name}`" for name, argv in {**stage1, **stage2_plan}.items()]
    with open(os.path.join(exp_out, "results.md"), "w") as f:
        f.write(results_md(a, text, s1_done, minutes, has_png, commands))
    print("\n" + "\n\n".join(text))
    print(f"\n{minutes:.1f} min | {exp_out}/results.md" + (f" | {exp_out}/curves.png" if has_png else
                                                           " | no plot (pip install matplotlib for one)"))
    return {"finals": finals, "pair": pairs.get("sampled"), "curves": curves}


if __name__ == "__main__":
    main()
