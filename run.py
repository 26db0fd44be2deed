"""The mechanics of a run of mgrpo.py, which a reader of the paper does not need to see: the command
line, the task, the output folder and seeds, the store's handshake, resume or start afresh, the
start-up printout with its memory estimate, the metrics log with its checkpoints, and the report.
"""
import argparse
import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import json
import os
import random
import re
import sys
import threading
import time

import numpy as np
import torch
import transformers

from agents import SIZES, prompt_ids
from checkpoints import clear_run, load_checkpoint, save_checkpoint
from store import FileStore, StoreError
from tools import HttpSearch, SearchError

MODES = ("co-train", "main-only", "single-agent")
# what the two roles of a decoupled run must agree on; the sub role checks it against the main role's
SHARED_ARGS = ("seed", "steps", "mode", "task", "questions_per_step", "group_size", "max_sub", "level",
               "train_levels", "eval_every", "eval_questions", "unsync", "w_sub")


# ---------------------------------------------------------------------------------------
# The command line and the task
# ---------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def load_task(name):
    """The task (--task): an importable module's name, or the path of a .py file (loaded once)."""
    if not name.endswith(".py"):
        return importlib.import_module(name)
    spec = importlib.util.spec_from_file_location(os.path.basename(name)[:-3], name)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def levels(text, default):
    """A level list such as --train-levels '1,2,2' (taken in turn); empty: [default]."""
    return [int(x) for x in (text or str(default)).split(",")]


def parse_args(args_class, argv=None, doc=""):
    """The command line, from a dataclass of settings: a flag per field, with the field's help text;
    every setting checked, and the task with its levels."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(args_class):
        kw = dict(default=f.default, help=f.metadata["help"].replace("%", "%%"))
        if isinstance(f.default, tuple):
            kw.update(type=float, nargs=len(f.default))
        elif isinstance(f.default, bool):
            kw.update(action=argparse.BooleanOptionalAction)
        else:
            kw.update(type=type(f.default))
        p.add_argument("--" + f.name.replace("_", "-"), **kw)
    a = args_class(**{k: tuple(v) if isinstance(v, list) else v for k, v in vars(p.parse_args(argv)).items()})
    errors = problems(a) + task_problems(a)
    if errors:
        p.error("; ".join(errors))
    if a.eval_questions == -1:
        a.eval_questions = 32 if a.main_model or a.sub_model or a.chat else 256
    return a


def problems(a):
    """What is wrong with the settings, one message each."""
    checks = [
        (a.group_size < 2, "--group-size must be >= 2 (a group of one has no baseline)"),
        (a.max_sub < 1, "--max-sub must be >= 1"),
        (a.mode not in MODES, "--mode must be co-train, main-only or single-agent"),
        (a.mode == "single-agent" and a.role != "both", "--mode single-agent runs in one process (--role both)"),
        (not 0 <= a.sft_until <= 1, "--sft-until is a success rate, in [0, 1]"),
        (a.sft_until and a.role != "both", "--sft-until checks both agents together: it needs --role both"),
        (a.sft_until and a.sft_steps == 0, "--sft-until checks a cold start: it needs --sft-steps > 0"),
        (a.unsync and a.mode != "co-train", "--unsync changes how S trains: it needs --mode co-train"),
        (a.loss_agg not in ("seq-mean", "token-mean"), "--loss-agg must be seq-mean or token-mean"),
        (a.model_size not in SIZES, f"--model-size must be one of {list(SIZES)}"),
        (min(a.steps, a.micro_batch, a.max_new_tokens) < 0 or a.sft_steps < -1 or a.eval_questions < -1,
         "--steps, --micro-batch, --max-new-tokens must be >= 0, --sft-steps and --eval-questions >= -1"),
        (a.dtype not in ("float32", "bfloat16"), "--dtype must be float32 or bfloat16"),
        (a.kl_coef < 0 or a.visit_max_chars < 1, "--kl-coef must be >= 0 and --visit-max-chars >= 1"),
        (not (a.lr > 0 and a.lr_sub >= 0), "--lr must be > 0 and --lr-sub >= 0"),
        (min(a.questions_per_step, a.ppo_epochs) < 1 or a.eval_questions == 0,
         "--questions-per-step, --ppo-epochs, --eval-questions must be >= 1"),
        (not all(re.fullmatch(r"\d+(,\d+)*", x or "1") for x in (a.sft_levels, a.train_levels)),
         "--sft-levels and --train-levels must list levels, e.g. 1,2"),
        (a.main_max_turns < 2 or a.sub_max_turns < 2, "--main-max-turns and --sub-max-turns must be >= 2"),
        (a.role not in ("both", "main", "sub"), "--role must be both, main or sub"),
        (a.role != "both" and not a.store, "--role main / sub needs --store DIR"),
        (a.resume and not a.out, "--resume needs the --out of the run to continue"),
        (a.save_every < 1 or a.peer_timeout <= 0 or a.progress_timeout < 0,
         "--save-every must be >= 1, --peer-timeout > 0 and --progress-timeout >= 0"),
        (a.search_timeout <= 0 or a.search_retries < 0, "--search-timeout must be > 0, --search-retries >= 0")]
    return [message for bad, message in checks if bad]


def task_problems(a):
    """The task must load, and have every level asked for (its make_question says)."""
    try:
        task = load_task(a.task)
        for level in {a.level, *map(int, re.findall(r"\d+", a.sft_levels + "," + a.train_levels))}:
            task.make_question(0, level)
    except (ImportError, FileNotFoundError, AttributeError) as e:
        return [f"--task {a.task}: {e}"]
    except ValueError as e:
        return [f"--level / --sft-levels / --train-levels: {e}"]
    return []


def agent_names(args):
    """The agents this process holds."""
    if args.mode == "single-agent":
        return ["main"]
    return {"both": ["main", "sub"], "main": ["main"], "sub": ["sub"]}[args.role]


def agent_kinds(args):
    """Each agent's kind of conversation: M plans (or, alone, searches itself), S searches."""
    return {"main": "single" if args.mode == "single-agent" else "main", "sub": "sub"}


# ---------------------------------------------------------------------------------------
# Before the first phase
# ---------------------------------------------------------------------------------------
def start(args):
    """Seeds, threads and the output folder; a run started by scripts/compare.py ends with it."""
    parent = os.environ.pop("MGRPO_PARENT_PID", "")
    if re.fullmatch(r"[1-9][0-9]*", parent):
        exit_with_parent(int(parent))
    transformers.utils.logging.disable_progress_bar()
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    if args.role != "both" and args.device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))  # the two roles share the cores
    out = args.out or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S") + f"-seed{args.seed}"
                                   + ("" if args.role == "both" else "-" + args.role))
    os.makedirs(out, exist_ok=True)
    return out


def exit_with_parent(parent):
    """In a worker process: exit as soon as `parent`, the pid of the process that started it, is
    gone (killed, say), instead of training on for nothing on the cores of whatever runs next.
    The parent passes its pid: a worker that asked for it late would get the pid of its new parent."""
    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        print(f"the process that started this one ({parent}) is gone: exiting", file=sys.stderr, flush=True)
        os._exit(1)
    threading.Thread(target=watch, daemon=True).start()


def search_tool(args, task):
    """The task's own tool (--search toy) or an HTTP search server, probed once where an agent of this
    process searches, so that a server that is down stops the run here, clearly, before any training."""
    if args.search == "toy":
        search = task.search_tool()
    else:
        search = HttpSearch(args.search, args.search_timeout, args.search_retries,
                            visit_hosts=args.visit_hosts.split(","))
    if args.mode == "single-agent" or "sub" in agent_names(args):
        try:
            search.search("ada", 0, args.level)
        except SearchError as e:
            raise SearchError(f"{e}; the toy server starts with: python toy_tools.py serve --port PORT") from None
    return search


def open_store(args):
    """--role main / sub: the shared store, with the handshake on the run's settings; else no store."""
    if args.role == "both":
        return contextlib.nullcontext()
    store = FileStore(args.store, args.run_id, args.role, args.peer_timeout, args.progress_timeout)
    shared = json.loads(json.dumps({k: getattr(args, k) for k in SHARED_ARGS}))  # as the store holds it
    try:
        if args.role == "main":
            previous = store.read("run")
            if previous is not None and (not args.resume or previous != shared):
                raise StoreError(f"the store {store.dir} holds an earlier run" + (
                    f" with other settings: {previous}" if args.resume else
                    "; use --resume, another --run-id or an empty store"))
            store.put("run", shared)
        else:
            if not args.resume:
                store.wait_peer()  # a live main role, not the records of an earlier run
            _, previous = store.wait("run")
            if previous != shared:
                diff = {k: (v, shared.get(k)) for k, v in previous.items() if shared.get(k) != v}
                raise StoreError(f"the sub role's settings differ from the main role's (main, sub): {diff}")
    except BaseException:
        store.close()
        raise
    return store


def resume(args, out, load):
    """--resume: (agents, schedule position, metrics lines, cold-start rounds done or None) from the last
    readable checkpoint in `out`, with metrics.jsonl cut back to it; None if there is none."""
    resumed = load_checkpoint(out, agent_names(args), load) if args.resume else None
    if resumed is None:
        if args.resume:
            print(f"no checkpoint in {out}: starting afresh", flush=True)
        return None
    path = os.path.join(out, "metrics.jsonl")
    with open(path) as f:
        kept = f.readlines()[:resumed[2]]  # drop the lines of phases after the checkpoint
    with open(path + ".tmp", "w") as f:
        f.writelines(kept)
    os.replace(path + ".tmp", path)  # atomically: a kill now leaves one whole file
    print(f"resumed from {out} at schedule position {resumed[1]}" + (
        f", in the cold start after round {resumed[3]}" if resumed[3] is not None else ""), flush=True)
    return resumed


def start_afresh(args, out, load):
    """New agents (seeds args.seed and args.seed + 1; S at --lr-sub if set), in a folder cleared of any
    earlier run: (agents, 0, 0, 0), as resume's."""
    given = {"main": args.main_model, "sub": args.sub_model}
    agents = {n: load(given[n], seed=args.seed + (n == "sub"), lr=args.lr_sub if n == "sub" else None)
              for n in agent_names(args)}
    with open(os.path.join(out, "args.json"), "w") as f:
        json.dump(dataclasses.asdict(args), f, indent=1)
    open(os.path.join(out, "metrics.jsonl"), "w").close()
    clear_run(out)
    return agents, 0, 0, 0


def print_plan(args, agents, out):
    """What this process runs, and each agent's memory estimate."""
    sizes = ", ".join(f"{n} {sum(p.numel() for p in a.model.parameters()) / 1e6:.2f}M params" for n, a in agents.items())
    print(f"M-GRPO | role {args.role} | {sizes} | {args.mode} K={args.group_size} D={args.max_sub} "
          f"level={args.level} device={args.device} {args.dtype}" + (" unsync" if args.unsync else "")
          + f" | out: {out}", flush=True)
    for n, a in agents.items():
        static, act, mb, T = memory_estimate(a, agent_kinds(args)[n], args)
        print(f"memory estimate, {n}: {static + act:.2f} GiB = {static:.2f} weights, grads, AdamW"
              + (", reference" if args.kl_coef else "") + f" + {act:.2f} one micro-batch ({mb} x up to {T} tokens;"
              " --micro-batch and --grad-checkpointing lower it)", flush=True)
    if args.main_model or args.sub_model:
        print("a model given by name or path: " + ("no cold start" if args.sft_steps == -1 else
              f"{args.sft_steps} cold-start steps") + f", {args.eval_questions} questions per evaluation, "
              f"{next(iter(agents.values())).max_new} new tokens per turn (--sft-steps, --eval-questions and "
              "--max-new-tokens change them)", flush=True)


def memory_estimate(agent, kind, args):
    """A rough estimate of one agent's training memory in GiB: fp32 weights, grads and AdamW states at
    16 bytes a parameter (plus the reference), and one micro-batch of the longest contexts the turn
    limits allow: activations (~34 h bytes a layer and token in 16 bits, ~2 h kept with checkpointing),
    logits + their fp32 log-softmax + its gradient (~10-12 bytes a vocabulary entry).
    Returns (weights and optimizer, one micro-batch, its rows, its tokens per row)."""
    cfg = getattr(agent.model.config, "text_config", agent.model.config)
    obs = 30 if kind == "main" else (args.visit_max_chars // 3 if agent.chat else 60)  # tokens per tool result
    turns = args.sub_max_turns if kind == "sub" else args.main_max_turns
    T = len(prompt_ids(agent, kind, "x" * 40)) + turns * (agent.max_new + obs)
    B = args.questions_per_step * args.group_size * (args.max_sub if kind == "sub" else 1)
    mb = min(args.micro_batch or B, B)
    act = cfg.num_hidden_layers * cfg.hidden_size * (2 if args.grad_checkpointing else 34) * (1 if agent.bf16 else 2)
    static = sum(p.numel() for p in agent.model.parameters()) * (16 + (2 if agent.bf16 else 4) * (args.kl_coef > 0))
    return static / 2 ** 30, mb * T * (act + (10 if agent.bf16 else 12) * cfg.vocab_size) / 2 ** 30, mb, T


# ---------------------------------------------------------------------------------------
# During the run, and after it
# ---------------------------------------------------------------------------------------
class Log:
    """After each phase of the schedule: its line in metrics.jsonl, a progress line, and a checkpoint
    (every --save-every steps, after each evaluation and at the end) that the store hears of."""

    def __init__(self, args, agents, out, store, n_phases, n_lines):
        self.args, self.agents, self.out, self.store = args, agents, out, store
        self.n_phases, self.lines, self.io_mark = n_phases, n_lines, store.io_time if store else 0.0

    def phase_done(self, idx, kind, step, rec):
        if rec is not None:
            if self.store:  # seconds of this phase in the store's reads and writes
                rec["t_store"] = self.store.io_time - self.io_mark
                self.io_mark = self.store.io_time
            with open(os.path.join(self.out, "metrics.jsonl"), "a") as f:
                f.write(json.dumps(rec) + "\n")
            self.lines += 1
            print(progress_line(rec, self.args.steps), flush=True)
        if kind == "eval" or step % self.args.save_every == 0 or idx == self.n_phases - 1:
            save_checkpoint(self.out, self.agents, idx + 1, self.lines)
            if self.store:
                self.store.saved = idx + 1
                peer_saved = self.store.check_peer().get("saved")
                if self.args.role == "main" and type(peer_saved) is int:
                    self.store.prune(min(idx + 1, peer_saved))


def progress_line(rec, steps):
    if "eval" in rec:
        return f"eval after step {rec['step']}: {rec['eval']} success {rec['eval_success']:.3f}"
    parts = [("main_reward", "R_M {main_reward:.3f} success {success:.3f} zero-var M {zero_var_main:.2f}"),
             ("sub_reward", "R_S {sub_reward:.3f} zero-var S {zero_var_sub:.2f} dup {n_dup} drop {n_drop}"),
             ("approx_kl_main", "kl {approx_kl_main:.1e} gn {grad_norm_main:.2f}"), ("t_step", "{t_step:.2f}s"),
             ("t_store", "store {t_store:.2f}s")]
    return " | ".join([f"step {rec['step']:4d}/{steps}"] + [text.format(**rec) for key, text in parts if key in rec])


def report(args, agents, out, t_start, d_rule):
    """After the last phase: the trained agents, summary.json, curves.png and the figures.
    d_rule(d values) -> the D that the paper's rule picks from them."""
    for n, a in agents.items():  # the trained agents, ready for from_pretrained
        a.model.save_pretrained(os.path.join(out, n))
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
    """{"sft_check": ...} as this run's cold start wrote it (--sft-until), if it had one."""
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
