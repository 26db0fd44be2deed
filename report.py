"""What a run of mgrpo.py writes as it goes and at the end: after each phase of the schedule its
line in metrics.jsonl, a progress line and a checkpoint; after the last, the trained agents,
summary.json and curves.png (when matplotlib is installed).
"""
import contextlib
import functools
import json
import math
import os
import time

import numpy as np
import torch

from checkpoints import KEEP, save_checkpoint


SAVE_RATIO = 20  # the work a checkpoint may wait for, in times what saving it costs


class Log:
    """After each phase of the schedule: its line in metrics.jsonl, a progress line, and a checkpoint
    (checkpoint_due) that the store hears of."""

    def __init__(self, args, agents, out, store, n_phases, n_lines):
        self.args, self.agents, self.out, self.store = args, agents, out, store
        self.n_phases, self.lines, self.io_mark = n_phases, n_lines, store.io_time if store else 0.0
        self.track, self.close = tracker(args, out)
        self.saved_at, self.save_cost = time.perf_counter(), 0.0  # checkpoint_due's: the first phase saves
        self.streaks, self.rows = {}, self.read_rows()  # the collapse alarm's: steps in a row of each signature
        for row in self.rows:  # as they were before a resume
            alarms(self.streaks, row, args.mode != "single-agent")

    def phase_done(self, idx, kind, step, rec):
        """rec: the phase's metrics, or None (the sub role's evaluations)."""
        if rec is not None:
            if self.store:  # seconds of this phase in the store's reads and writes
                rec["t_store"] = self.store.io_time - self.io_mark
            rec.update(self.watch(rec))
            with open(os.path.join(self.out, "metrics.jsonl"), "a") as f:
                f.write(json.dumps(rec) + "\n")
                f.flush()
                os.fsync(f.fileno())  # on disk before a checkpoint that counts it
            self.lines += 1
            self.track(rec)
            print(progress_line(rec, self.args.steps), flush=True)
            for key in rec.get("alarm", []):
                if self.streaks[key] == ALARM_STEPS:  # the full message once; the progress line each step
                    print(alarm_message(key, rec), flush=True)
        if self.checkpoint_due(idx):
            t0 = time.perf_counter()
            last = idx == self.n_phases - 1 and not self.store  # two roles keep their checkpoints in step
            save_checkpoint(self.out, self.agents, idx + 1, self.lines, keep=1 if last else KEEP)
            self.saved_at, self.save_cost = time.perf_counter(), time.perf_counter() - t0
            if self.store:
                self.store.saved = idx + 1
                peer_saved = self.store.check_peer().get("saved")
                if self.args.role == "main" and type(peer_saved) is int:
                    self.store.prune(min(idx + 1, peer_saved))
        if self.store:  # the next phase's store time counts from here
            self.io_mark = self.store.io_time

    def checkpoint_due(self, idx):
        """After the last phase; with two roles, whose checkpoints keep in step, after every phase; else once
        the phases since the last checkpoint took SAVE_RATIO times as long as saving it did (so that saving
        costs a few percent of the run: a checkpoint of two 135M-parameter agents with their AdamW states is
        3 GB)."""
        if idx == self.n_phases - 1 or self.store:
            return True
        return time.perf_counter() - self.saved_at >= SAVE_RATIO * self.save_cost

    def read_rows(self):
        """The metrics lines this run has written (a resumed run's too)."""
        path, rows = os.path.join(self.out, "metrics.jsonl"), []
        with open(path, errors="replace") if os.path.exists(path) else contextlib.nullcontext([]) as f:
            for n, line in zip(range(1, self.lines + 1), f):
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    rows.append(None)
                if not isinstance(rows[-1], dict) or not isinstance(rows[-1].get("step"), int):
                    raise ValueError(f"{path}, line {n}: not a metrics line of this run ({line[:80]!r}); "
                                     "resume from an untouched output folder, or start afresh")
        return rows

    def watch(self, rec):
        """What the collapse alarm adds to a phase's record: a step's alarms (if any); an evaluation's
        share of zero-variance groups per agent, the mean over the steps since the evaluation before."""
        if "eval" not in rec:
            self.rows.append(rec)
            found = alarms(self.streaks, rec, self.args.mode != "single-agent")
            return {"alarm": found} if found else {}
        steps = []
        for row in reversed(self.rows):  # back to the evaluation before (an evaluation pair shares its steps)
            if "eval" in row and row["step"] < rec["step"]:
                break
            steps += [row] * ("eval" not in row)
        self.rows.append(rec)
        shares = {key: [r[key] for r in steps if r.get(key) is not None] for key in ("zero_var_main", "zero_var_sub")}
        return {key: float(np.mean(v)) for key, v in shares.items() if v}


class UpdateLog:
    """What one agent's update logs as it goes: token-weighted means of policy_loss's statistics over the
    batch and its epochs, the seconds of its forward and backward passes, and its skipped steps."""

    def __init__(self, device, batch, epochs):
        ids, self.attn, self.mask, _ = batch
        self.n_tok, self.epochs = float(self.mask.sum().clamp(min=1)), epochs
        self.sync = functools.partial(torch.cuda.synchronize, device) if device.type == "cuda" else None
        self.rec = {"clip_frac": 0.0, "approx_kl": 0.0, "kl_ref": 0.0, "t_fwd": 0.0, "t_bwd": 0.0, "skipped": 0}

    @contextlib.contextmanager
    def timed(self, key, sync=False):
        """Seconds under rec[key]; sync: wait for the GPU first, so that the time split is the GPU's (once
        an epoch: a wait after every micro-batch would idle it)."""
        t0 = time.perf_counter()
        yield
        if sync and self.sync:
            self.sync()
        self.rec[key] += time.perf_counter() - t0

    def gap(self, trained, sampled, mask, cap):
        """A bf16 sampler's log-probs against training's, over one micro-batch's trained tokens: the mean and
        largest |difference|, and the share of tokens whose importance weight met its cap."""
        d = (trained - sampled).float()[mask.bool()]
        for key, value in (("logp_gap", float(d.abs().sum()) / self.n_tok),
                           ("is_capped", float((d >= math.log(cap)).sum()) / self.n_tok)):
            self.rec[key] = self.rec.get(key, 0.0) + value
        if len(d):
            self.rec["logp_gap_max"] = max(self.rec.get("logp_gap_max", 0.0), float(d.abs().max()))

    def add(self, stats):
        """One micro-batch's statistics (policy_loss's), weighted by its share of the batch's tokens."""
        for key in ("clip_frac", "approx_kl", "kl_ref"):
            self.rec[key] += stats.get(key, 0.0) * stats["tokens"] / self.n_tok / self.epochs

    def result(self, grad_norm):
        """The update's statistics; the last gradient norm None where it was not finite (JSON has no NaN)."""
        e = self.epochs
        return {**self.rec, "grad_norm": float(grad_norm) if torch.isfinite(grad_norm) else None,
                "tokens": float(self.mask.sum()) * e, "tokens_in": float(self.attn.sum()) * e,  # all through the model
                "sequences": len(self.mask) * e}


# what each agent's update logs, as <name>_main and <name>_sub
UPDATE_STATS = ("clip_frac", "approx_kl", "kl_ref", "grad_norm", "tokens_in", "sequences", "skipped", "kl_step",
                "halved", "logp_gap", "logp_gap_max", "is_capped")


MAX_SKIPPED = 3  # updates in a row whose loss or gradient is not finite, before the run stops


def skipped_in_a_row(agent, skipped):
    """Count updates with a skipped step in a row; warn, and stop the run at MAX_SKIPPED."""
    agent.skipped = agent.skipped + 1 if skipped else 0
    if skipped:
        print(f"warning: a step with a non-finite loss or gradient was skipped ({agent.skipped} "
              f"in a row; {MAX_SKIPPED} stop the run)", flush=True)
    if agent.skipped >= MAX_SKIPPED:
        raise FloatingPointError(f"{MAX_SKIPPED} updates in a row had a non-finite loss or "
                                 "gradient norm: the weights or the data are broken; stopping")


def answer_f1(task, trajs, questions):
    """The F1 of each answer where the task has one (qa_task.py), logged beside r_correct, not a reward; []."""
    return [task.f1(q, t.result) if t.ok else 0.0 for t, q in zip(trajs, questions)] if hasattr(task, "f1") else []


def agent_record(name, update):
    """An agent's update statistics as metrics.jsonl names them (clip_frac_main, ...)."""
    return {**{f"{k}_{name}": update[k] for k in UPDATE_STATS if k in update},
            f"t_train_{name}": update.get("t_fwd", 0.0) + update.get("t_bwd", 0.0)}


def step_record(rec, updates, trajs, t_gen, dt):
    """A step's metrics line: `rec`, each agent's update ({name: statistics}), and the time split and
    throughput of the step, which took dt seconds, t_gen of them sampling `trajs`."""
    for name, update in updates.items():
        rec.update(agent_record(name, update))
    gen_tokens = sum(sum(t.mask) for t in trajs)
    rec.update({k: sum(u.get(k, 0.0) for u in updates.values()) for k in ("t_fwd", "t_bwd")})
    rec.update(t_gen=t_gen, t_step=dt, gen_tokens=gen_tokens, gen_tokens_per_s=gen_tokens / t_gen,
               train_tokens_per_s=sum(u.get("tokens", 0.0) for u in updates.values()) / (dt - t_gen))
    return rec


def tracker(args, out):
    """--report-to: (log, close), where log(rec) sends a metrics line's numbers to TensorBoard or W&B,
    imported only then; without it, functions that do nothing. metrics.jsonl is written either way."""
    if args.report_to == "tensorboard":
        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter(os.path.join(out, "tb"))

        def log(rec):
            for k, v in scalars(rec).items():
                writer.add_scalar(k, v, rec["step"])
            writer.flush()  # on disk line by line, as metrics.jsonl is
        return log, writer.close
    if args.report_to == "wandb":
        import wandb
        run = wandb.init(project="mgrpo", dir=out, name=os.path.basename(os.path.abspath(out)),
                         config=vars(args))
        return lambda rec: run.log(scalars(rec), step=rec["step"]), run.finish
    return (lambda rec: None), (lambda: None)


def scalars(rec):
    """A metrics line's numbers by name; an evaluation's as eval/<greedy or sampled>_success."""
    if "eval" in rec:
        return {f"eval/{rec['eval']}_success": rec["eval_success"]}
    return {k: v for k, v in rec.items() if k != "step" and type(v) in (int, float)}


def progress_line(rec, steps):
    if "eval" in rec:
        formats = ", ".join(f"{who} {rec[key]:.2f}" for who, key in (("M", "format_main"), ("S", "format_sub"))
                            if rec.get(key) is not None)
        flat = ", ".join(f"{who} {rec[key]:.2f}" for who, key in (("M", "zero_var_main"), ("S", "zero_var_sub"))
                         if key in rec)
        return (f"eval after step {rec['step']}: {rec['eval']} success {rec['eval_success']:.3f}"
                + (f" f1 {rec['eval_f1']:.3f}" if "eval_f1" in rec else "")
                + (f" (format held: {formats})" if formats else "")
                + (f"; zero-variance groups since the last evaluation: {flat}" if flat else ""))
    parts = [("main_reward", "R_M {main_reward:.3f} success {success:.3f} zero-var M {zero_var_main:.2f}"),
             ("f1", "f1 {f1:.3f}"),
             ("sub_reward", "R_S {sub_reward:.3f} zero-var S {zero_var_sub:.2f} dup {n_dup} drop {n_drop}"),
             ("approx_kl_main", "kl {approx_kl_main:.1e} gn {grad_norm_main:.2f}"), ("t_step", "{t_step:.2f}s"),
             ("t_judge", "judge {t_judge:.2f}s ({judge_failed} failed)"), ("t_store", "store {t_store:.2f}s")]
    shown = {k: float("nan") if v is None else v for k, v in rec.items()}  # a skipped step's grad norm
    if rec.get("zero_var_sub", 0) is None:  # no sub-task this step: no group to speak of
        parts[2] = ("sub_reward", "R_S -")
    return " | ".join([f"step {rec['step']:4d}/{steps}"] + [text.format(**shown) for key, text in parts if key in rec]
                      + [f"ALARM {', '.join(rec.get('alarm', []))}"] * ("alarm" in rec))


ALARM_STEPS = 10  # steps in a row with one of these signatures before the collapse alarm
ALARMS = {
    "flat_main": "every group of M's K rollouts has had one reward for all its members: M's advantages are "
                 "all 0 (eq. 10), so M gets no gradient",
    "flat_sub": "every group of S's D x K aligned sub-trajectories has had one reward for all its members: "
                "S's advantages are all 0 (eq. 13), so S gets no gradient",
    "no_delegation": "M has delegated nothing in any rollout: S gets no sub-tasks to learn from, and M "
                     "answers without a search"}
ALARM_ADVICE = ("Either every question is solved (success near 1: raise --level) or the policy collapsed "
                "(every rollout fails the same way), which GRPO cannot undo by itself. Try: resume from a "
                "checkpoint before the fall with --max-kl 0.05 (a bound on how far one update moves the policy), "
                "a lower --lr, a larger --group-size, or a longer --cold-start")


def alarms(streaks, rec, delegates=True):
    """The collapse alarm's keys (ALARMS) that hold for a step's record `rec`: a signature seen in each of
    the last ALARM_STEPS steps. streaks: the steps in a row of each signature, kept between calls.
    delegates: whether M should delegate (not in single-agent mode)."""
    if "eval" in rec:
        return []
    seen = {"flat_main": rec.get("zero_var_main") == 1.0, "flat_sub": rec.get("zero_var_sub") == 1.0}
    if delegates and isinstance(rec.get("d_k"), list):
        seen["no_delegation"] = not any(rec["d_k"])
    for key, hit in seen.items():
        streaks[key] = streaks.get(key, 0) + 1 if hit else 0
    return [key for key in seen if streaks[key] >= ALARM_STEPS]


def alarm_message(key, rec):
    return (f"ALARM {key} for {ALARM_STEPS} steps (success {rec.get('success', float('nan')):.3f}): "
            f"{ALARMS[key]}. {ALARM_ADVICE}")


def report(args, agents, out, t_start, d_rule):
    """After the last phase: the trained agents, summary.json, curves.png and the figures.
    d_rule(d values) -> the D that the paper's rule picks from them."""
    for n, a in agents.items():  # the trained agents, ready for from_pretrained (LoRA: for peft)
        (a.peft or a.model).save_pretrained(os.path.join(out, n))
        a.tok.save_pretrained(os.path.join(out, n))
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    steps = [r for r in rows if "eval" not in r]
    summary = {"role": args.role, "mode": args.mode, "level": args.level, "steps": len(steps),
               "params": sum(p.numel() for a in agents.values() for p in a.model.parameters()),
               "wall_time_s": round(time.time() - t_start, 1), **cold_start_outcome(out)}
    if args.role != "both":
        t_step = sum(r["t_step"] for r in steps)
        summary["store_share_of_step_time"] = sum(r.get("t_store", 0.0) for r in steps) / max(t_step, 1e-9)
        print(f"store: {100 * summary['store_share_of_step_time']:.1f}% of step time in reads and writes")
    if args.role != "sub":
        summary.update(main_summary(args, rows, d_rule))
        plot = plot_curves(out, rows)
        print(f"curves: {plot}" if plot else "no curves.png: matplotlib is not installed (it is optional)")
    if torch.device(args.device).type == "cuda":
        summary["peak_gpu_mem_gib"] = torch.cuda.max_memory_allocated(args.device) / 2 ** 30
        print(f"peak GPU memory of this process: {summary['peak_gpu_mem_gib']:.2f} GiB")
    print(f"{summary['wall_time_s']:.0f}s in all | {out}", flush=True)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary


def cold_start_outcome(out):
    """{"sft_check": ...} as this run's cold start wrote it (its check, `until`), if it had one."""
    try:
        with open(os.path.join(out, "sft_check.json")) as f:
            return {"sft_check": json.load(f)}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        print(f"warning: {out}/sft_check.json cannot be read ({e}); summary.json goes without it", flush=True)
        return {}


def main_summary(args, rows, d_rule):
    """Held-out success before and after RL, and the d_k of every rollout against the D in use."""
    evals = {(r["step"], r["eval"]): r["eval_success"] for r in rows if "eval" in r}
    all_d = [d for r in rows if "d_k" in r for d in r["d_k"]]
    hist = {int(d): int(n) for d, n in zip(*np.unique(all_d, return_counts=True))} if all_d else {}
    s = {"eval_success_start": evals[(0, "sampled")], "eval_greedy_success_start": evals[(0, "greedy")],
         "eval_success_end": evals[(args.steps, "sampled")], "eval_greedy_success_end": evals[(args.steps, "greedy")],
         "d_k_histogram": hist, "D_in_use": args.max_sub, "D_paper_rule": d_rule(all_d)}
    if args.mode != "single-agent":
        print(f"d_k over all rollouts: {hist}; the paper's rule P(d_k <= D) >= 0.99 picks D = {s['D_paper_rule']} "
              f"(in use: D = {args.max_sub})")
    print(f"eval after RL: sampled success {s['eval_success_end']:.3f} (before {s['eval_success_start']:.3f}), "
          f"greedy {s['eval_greedy_success_end']:.3f}")
    return s


def plot_curves(out, rows):
    """<out>/curves.png (rewards per step, held-out success per evaluation) when matplotlib is installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
    for key in ("main_reward", "sub_reward", "success"):
        if points := [(r["step"], r[key]) for r in rows if key in r]:
            ax.plot(*zip(*points), lw=1, label=key)
    for how, marker in (("sampled", "o"), ("greedy", "s")):
        ax.plot(*zip(*[(r["step"], r["eval_success"]) for r in rows if r.get("eval") == how]), marker, label=how)
    ax.set(xlabel="M-GRPO step", ylim=(0, 1.02), title="rewards; held-out success (sampled, greedy)")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.savefig(os.path.join(out, "curves.png"))
    plt.close(fig)
    return os.path.join(out, "curves.png")
