"""The paper's comparisons (spec 8) rerun on the toy task, in stage 2 of a two-stage curriculum.

Arms, all from the same stage-1 checkpoint and with the same settings otherwise:
  co-train          M-GRPO: both agents train (the paper's (a))
  co-train unsync   the same, S one step behind (the paper's off-policy version, Fig. 8)
  main-only         S frozen at the stage-1 checkpoint, M trains (the paper's (b))
  single-agent      one model given S's search tool, plain GRPO (the paper's (c))

Stage 1 runs once, with --stage1-seed, and every arm and seed starts from it, as in the
paper: a cold start on noisy demos of both task levels (formats, and the stand-in for a
pretrained model), then --stage1-steps of RL on level-1 (easy) questions. The system
(M and S) and the single agent each get their own stage 1, built the same way.
Stage 2: every arm, --stage2-steps at level 2 (long, noisy search results), per seed.

    python scripts/compare.py              # 4 arms x 3 seeds
    python scripts/compare.py --quick      # a very short version, to check the pipeline
    python scripts/compare.py --out DIR --resume   # continue one that was interrupted

Writes <out>/results.md (settings, commands, table), <out>/curves.csv (every evaluation),
<out>/curves.png if matplotlib is installed (optional: pip install matplotlib), and one
folder per run with its log, metrics.jsonl, args.json and summary.json.
"""
import argparse
import csv
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARMS = {"co-train": ["--mode", "co-train"],
        "co-train unsync": ["--mode", "co-train", "--unsync"],
        "main-only": ["--mode", "main-only"],
        "single-agent": ["--mode", "single-agent"]}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="stage-2 seeds, one run per arm each")
    p.add_argument("--stage1-seed", type=int, default=1, help="seed of the one shared stage 1")
    p.add_argument("--sft-steps", type=int, default=1200, help="cold-start steps (stage 1)")
    p.add_argument("--sft-levels", default="1,2,2",
                   help="levels of the cold-start demos, in turn: two level-2 demos for each level-1 one")
    p.add_argument("--sft-lr", type=float, default=1e-3,
                   help="cold-start learning rate (stage 1); mgrpo.py's 3e-3 suits level-1 demos alone")
    p.add_argument("--stage1-steps", type=int, default=60, help="RL steps on level-1 questions (stage 1)")
    p.add_argument("--stage2-steps", type=int, default=150, help="RL steps on level-2 questions, per arm and seed")
    p.add_argument("--eval-every", type=int, default=25, help="evaluate every N stage-2 steps")
    p.add_argument("--eval-questions", type=int, default=256, help="held-out questions per evaluation")
    p.add_argument("--threshold", type=float, default=0.8, help="report the first step whose success reaches this")
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS), metavar="ARM",
                   help=f"arms to run, of {list(ARMS)}")
    p.add_argument("--jobs", type=int, default=max(1, min(2, os.cpu_count() or 1)),
                   help="runs at once, each with one thread (tiny models do not gain from more)")
    p.add_argument("--extra", default="", help="more mgrpo.py options for every run, e.g. '--model-size 1M'")
    p.add_argument("--out", default="", help="output folder; empty: runs/compare-<time>")
    p.add_argument("--resume", action="store_true",
                   help="continue an interrupted comparison in --out: finished runs are reused, "
                        "cut-off ones continue from their last checkpoint")
    p.add_argument("--quick", action="store_true",
                   help="a very short version (tiny budgets, 2 seeds): checks the pipeline, shows nothing")
    a = p.parse_args(argv)
    if a.resume and not a.out:
        p.error("--resume needs the --out of the comparison to continue")
    if a.quick:
        a.seeds, a.sft_steps, a.stage1_steps, a.stage2_steps = a.seeds[:2], 150, 2, 4
        a.eval_every, a.eval_questions = 2, 16
    if min(a.sft_steps, a.stage1_steps) < 0 or min(a.stage2_steps, a.eval_every, a.eval_questions, a.jobs) < 1:
        p.error("step counts must be >= 0, and --stage2-steps, --eval-every, --eval-questions, --jobs >= 1")
    return a


def run(name, argv, out, resume=False):
    """One mgrpo.py run in its own process with one thread; returns its summary.

    resume: a run that finished with the same options is reused, one that was cut off
    continues from its last checkpoint (mgrpo.py --resume)."""
    folder = os.path.join(out, name)
    os.makedirs(folder, exist_ok=True)
    cmd_file, summary_file = os.path.join(folder, "options.json"), os.path.join(folder, "summary.json")
    if resume and os.path.exists(cmd_file):
        with open(cmd_file) as f:
            old = json.load(f)
        if old != argv:
            raise RuntimeError(f"{folder} holds a run with other options ({' '.join(old)}); use another --out")
        if os.path.exists(summary_file):
            print(f"  reused {name} (finished before)", flush=True)
            with open(summary_file) as f:
                return json.load(f)
    else:
        with open(cmd_file, "w") as f:
            json.dump(argv, f)
    cmd = [sys.executable, os.path.join(ROOT, "mgrpo.py"), *argv, "--out", folder] + (["--resume"] if resume else [])
    t0 = time.time()
    print(f"  start {name} (log: {os.path.join(folder, 'log.txt')})", flush=True)
    with open(os.path.join(folder, "log.txt"), "a" if resume else "w") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                             env={**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    if rc != 0:
        with open(os.path.join(folder, "log.txt")) as f:
            tail = "".join(f.readlines()[-15:])
        raise RuntimeError(f"run {name} failed (exit {rc}); last lines of {folder}/log.txt:\n{tail}")
    with open(summary_file) as f:
        s = json.load(f)
    print(f"  done {name:28s} success {s['eval_success_start']:.3f} -> {s['eval_success_end']:.3f} "
          f"({time.time() - t0:.0f}s)", flush=True)
    return s


def curve(folder):
    """[(step, sampled success)] of one run's evaluations."""
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [(r["step"], r["eval_success"]) for r in rows if r.get("eval") == "sampled"]


def table(curves, arms, threshold):
    """Markdown rows: final success (mean, spread over seeds) and steps to reach the threshold."""
    lines = ["| arm | final sampled success, mean ± std | per seed | min - max | "
             f"first step with success ≥ {threshold} (per seed) |", "|---|---|---|---|---|"]
    for arm in arms:
        runs = curves[arm]
        final = np.array([c[-1][1] for c in runs])
        reach = [next((s for s, v in c if v >= threshold), None) for c in runs]
        reach_s = ", ".join("never" if r is None else str(r) for r in reach)
        lines.append(f"| {arm} | {final.mean():.3f} ± {final.std():.3f} | "
                     f"{', '.join(f'{v:.3f}' for v in final)} | {final.min():.3f} - {final.max():.3f} | {reach_s} |")
    return "\n".join(lines)


def plot(curves, arms, path, title):
    """Mean and min-max band of sampled success against step, one line per arm."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    for arm in arms:
        steps = [s for s, _ in curves[arm][0]]
        v = np.array([[x for _, x in c] for c in curves[arm]])
        ax.plot(steps, v.mean(0), marker="o", ms=3, label=arm)
        ax.fill_between(steps, v.min(0), v.max(0), alpha=0.2)
    ax.set(xlabel="stage-2 step", ylabel="sampled success (held-out questions)", ylim=(0, 1), title=title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def main(argv=None):
    a = parse(argv)
    out = os.path.abspath(a.out or os.path.join("runs", time.strftime("compare-%Y%m%d-%H%M%S")))
    os.makedirs(out, exist_ok=True)
    t_start = time.time()
    extra = a.extra.split()
    common = ["--eval-questions", str(a.eval_questions), *extra]
    stage1 = ["--level", "1", "--sft-levels", a.sft_levels, "--sft-steps", str(a.sft_steps), "--sft-lr", str(a.sft_lr),
              "--steps", str(a.stage1_steps), "--eval-every", "0", "--seed", str(a.stage1_seed), *common]
    # level 2 takes three hops: D = 3 is the paper's rule, P(d_k <= D) ~ 0.99
    stage2 = ["--level", "2", "--max-sub", "3", "--sft-steps", "0", "--steps", str(a.stage2_steps),
              "--eval-every", str(a.eval_every), *common]
    jobs = {"stage1-system": stage1, "stage1-single": stage1 + ["--mode", "single-agent"]}
    plan = {}
    for arm in sorted(a.arms, key=lambda arm: arm == "single-agent"):  # its stage 1 takes longest: last
        s1 = os.path.join(out, "stage1-single" if arm == "single-agent" else "stage1-system")
        init = ["--main-model", os.path.join(s1, "main")] + (
            [] if arm == "single-agent" else ["--sub-model", os.path.join(s1, "sub")])
        for seed in a.seeds:
            plan[f"{arm.replace(' ', '-')}-seed{seed}"] = (arm, stage2 + ARMS[arm] + init + ["--seed", str(seed)])
    if not any(arm == "single-agent" for arm in a.arms):
        jobs.pop("stage1-single")
    if all(arm == "single-agent" for arm in a.arms):
        jobs.pop("stage1-system")

    print(f"comparison -> {out}\nevery run: python mgrpo.py <options> --out <folder>; mgrpo.py's defaults "
          f"for everything not listed (saved in each run's args.json)", flush=True)

    def show(argv):  # the folders as <out>/..., so results.md reads the same on any machine
        return " ".join(argv).replace(out, "<out>")

    for name, argv in {**jobs, **{k: v[1] for k, v in plan.items()}}.items():
        print(f"  {name}: {show(argv)}")
    print(f"stage 1: {len(jobs)} runs; stage 2: {len(plan)} runs; {a.jobs} at a time", flush=True)

    def after(stage1_job, name, argv):
        stage1_job.result()  # raises if stage 1 failed
        return run(name, argv, out, a.resume)

    with ThreadPoolExecutor(a.jobs) as pool:
        # a stage-2 run starts as soon as its own stage 1 is done and a slot is free; the
        # queue holds each stage 1 before the runs that wait for it, so none waits forever
        s1_jobs = {name: pool.submit(run, name, argv, out, a.resume) for name, argv in jobs.items()}
        s2_jobs = [pool.submit(after, s1_jobs["stage1-single" if arm == "single-agent" else "stage1-system"],
                               name, argv) for name, (arm, argv) in plan.items()]
        s1 = {name: f.result() for name, f in s1_jobs.items()}
        pool_results = [f.result() for f in s2_jobs]
    curves = {arm: [] for arm in a.arms}
    with open(os.path.join(out, "curves.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["arm", "seed", "step", "sampled_success"])
        for name, (arm, argv) in plan.items():
            c = curve(os.path.join(out, name))
            curves[arm].append(c)
            w.writerows([arm, argv[-1], s, v] for s, v in c)

    minutes = (time.time() - t_start) / 60
    title = f"stage 2 (level 2), {len(a.seeds)} seeds: mean and min-max"
    has_png = plot(curves, a.arms, os.path.join(out, "curves.png"), title)
    s1_line = ", ".join(f"{k}: success at level 1 {v['eval_success_start']:.3f} -> {v['eval_success_end']:.3f}"
                        for k, v in s1.items())
    greedy = {arm: np.mean([r["eval_greedy_success_end"] for (ar, _), r in zip(plan.values(), pool_results)
                            if ar == arm]) for arm in a.arms}
    md = "\n".join([
        f"# Comparison: {', '.join(a.arms)}", "",
        f"{len(a.seeds)} seeds ({', '.join(map(str, a.seeds))}), {a.stage2_steps} stage-2 steps per run, "
        f"{a.eval_questions} held-out level-2 questions per evaluation, sampled at temperature 1. "
        f"Wall time {minutes:.1f} min with {a.jobs} runs at a time.", "",
        table(curves, a.arms, a.threshold), "",
        "Greedy success at the end, mean over seeds: "
        + ", ".join(f"{arm} {g:.3f}" for arm, g in greedy.items()) + ".", "",
        f"Stage 1 (shared by every arm and seed): {s1_line}.", "",
        "![curves](curves.png)" if has_png else "(no plot: matplotlib is not installed)", "",
        "## Commands", "", "Each run is `python mgrpo.py <options>`, `<out>` the folder of this comparison; all "
        "other settings are mgrpo.py's defaults, and every run's full settings are in its `args.json`.", "",
        *[f"- `{name}`: `{show(argv)} --out <out>/{name}`" for name, argv in jobs.items()],
        *[f"- `{name}`: `{show(argv)} --out <out>/{name}`" for name, (_, argv) in plan.items()], ""])
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(md)
    print("\n" + table(curves, a.arms, a.threshold))
    print(f"\n{minutes:.1f} min | {out}/results.md" + (f" | {out}/curves.png" if has_png else
                                                       " | no plot (pip install matplotlib for one)"))
    return curves


if __name__ == "__main__":
    main()
