"""The curves of a few runs side by side: per run, the success of each step's own rollouts (a mean
over the last --window steps) and its held-out evaluations, sampled and greedy. experiments/smollm2.md
draws its figure with it:

    python -m experiments.curves experiments/smollm2.png runs/smollm2-seed1 runs/smollm2-seed2 ...
"""
import argparse
import json
import os

import numpy as np


def read(folder):
    """(steps, success of each step's rollouts, {kind: [(step, held-out success)]}) of a run's metrics.jsonl."""
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    steps = [r for r in rows if "eval" not in r]
    evals = {kind: [(r["step"], r["eval_success"]) for r in rows if r.get("eval") == kind] for kind in ("sampled", "greedy")}
    return [r["step"] for r in steps], [r["success"] for r in steps], evals


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m experiments.curves", description=__doc__.split("\n\n")[0])
    p.add_argument("png", help="the figure to write")
    p.add_argument("runs", nargs="+", help="run folders (their metrics.jsonl)")
    p.add_argument("--window", type=int, default=5, help="steps per mean of the rollouts' success")
    p.add_argument("--title", default="")
    a = p.parse_args(argv)
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("experiments.curves draws with matplotlib, which is not installed: pip install matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
    for i, folder in enumerate(a.runs):
        steps, success, evals = read(folder)
        mean = [np.mean(success[max(0, j + 1 - a.window):j + 1]) for j in range(len(success))]
        color, name = f"C{i}", os.path.basename(os.path.normpath(folder))
        ax.plot(steps, mean, color=color, lw=1, label=f"{name}: rollouts, last {a.window} steps")
        for kind, marker in (("sampled", "o"), ("greedy", "s")):
            if evals[kind]:
                ax.plot(*zip(*evals[kind]), marker, color=color, label=f"{name}: held-out, {kind}")
    ax.set(xlabel="M-GRPO step", ylabel="success", ylim=(0, 1.02), title=a.title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, loc="lower right")
    fig.tight_layout()
    fig.savefig(a.png)
    print(a.png)


if __name__ == "__main__":
    main()
