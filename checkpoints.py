"""Checkpoints of a run: each agent's weights, tokenizer and optimizer state, the RNG states, the unsync
batch and the place in the schedule; the frozen reference of --kl-coef; and the run's folder as a run
begins: a --resume from its last checkpoint, or a fresh start.

A checkpoint is a folder <out>/ckpt-<schedule position>, or ckpt-<position>.<n> when that position is
saved again (each cold-start round saves position 0); its state.pt loads with weights_only=True, so
a planted file cannot run code. A save never writes over a checkpoint: it goes to a temporary
folder, is fsynced, and is renamed to a name no checkpoint has, and only then do older ones go (each
renamed aside before it is deleted). So a kill at any instruction leaves a whole copy to resume
from: the new one, or the one before.
"""
import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import random
import re
import secrets
import shutil

import torch
from transformers import AutoModelForCausalLM

from agents import Traj
from run import agent_names

NAME = re.compile(r"ckpt-(\d{8})(?:\.(\d+))?")
KEEP = 2  # checkpoints kept while a run goes on; once its last phase is saved, that one alone (a checkpoint of
# two SmolLM2 agents with their AdamW states is 3.1 GB)


class CheckpointError(RuntimeError):
    """Checkpoints are there, and none of them can be loaded: the message names each and why."""


def order(path):
    """(schedule position, how many times saved before) of a checkpoint folder."""
    m = NAME.fullmatch(os.path.basename(path))
    return int(m.group(1)), int(m.group(2) or 0)


def checkpoints(out):
    """The checkpoint folders in <out>, oldest first."""
    names = os.listdir(out) if os.path.isdir(out) else []
    return sorted((os.path.join(out, n) for n in names if NAME.fullmatch(n)), key=order)


def fsync_tree(path):
    """Every file under `path` and every folder, down to the disk, folders after their files."""
    for folder, _, files in os.walk(path, topdown=False):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(folder)


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_state(folder, agents, index, n_metrics, sft_rounds):
    """The agents and state.pt into `folder`."""
    for name, a in agents.items():
        (a.peft or a.model).save_pretrained(os.path.join(folder, name))  # with LoRA: the adapter
        a.tok.save_pretrained(os.path.join(folder, name))
    pending = {n: ([dataclasses.asdict(t) for t in a.pending[0]], a.pending[1].tolist())
               for n, a in agents.items() if a.pending}
    rng = {"python": random.getstate(), "torch": torch.get_rng_state(),
           "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}
    torch.save({"index": index, "metrics_lines": n_metrics, "sft_rounds": sft_rounds, "pending": pending,
                "opt": {n: a.opt.state_dict() for n, a in agents.items()}, "rng": rng},
               os.path.join(folder, "state.pt"))


def save_checkpoint(out, agents, index, n_metrics, sft_rounds=None, keep=KEEP):
    """<out>/ckpt-<index> (or .<n>, saved again); the last `keep` are kept. n_metrics: lines of
    metrics.jsonl it covers. sft_rounds: saved within the cold start, after that many rounds (None:
    the cold start is over)."""
    tmp = os.path.join(out, f"ckpt-tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        write_state(tmp, agents, index, n_metrics, sft_rounds)
        fsync_tree(tmp)
    except Exception as e:  # noqa: BLE001  (safetensors and torch.save report a full disk as errors of their own)
        shutil.rmtree(tmp, ignore_errors=True)
        if getattr(e, "errno", None) != errno.ENOSPC and "No space left on device" not in str(e):
            raise
        raise SystemExit(f"error: the disk of {out} is full: this checkpoint was not saved, and the last one "
                         "is whole; free some space and go on with --resume") from None
    again = [order(p)[1] + 1 for p in checkpoints(out) if order(p)[0] == index]
    final = os.path.join(out, f"ckpt-{index:08d}" + (f".{max(again)}" if again else ""))
    os.rename(tmp, final)  # a new name: no checkpoint is ever written over
    fsync_dir(out)
    for path in checkpoints(out)[:-keep]:  # older ones: renamed aside first, so none is left half deleted
        aside = os.path.join(out, f"ckpt-tmp-old-{secrets.token_hex(4)}")
        os.rename(path, aside)
        shutil.rmtree(aside, ignore_errors=True)
    for name in os.listdir(out):  # what saves and deletions killed midway left
        if name.startswith("ckpt-tmp-"):
            shutil.rmtree(os.path.join(out, name), ignore_errors=True)


def load_checkpoint(out, names, load):
    """(agents, schedule position, metrics lines, cold-start rounds done or None when it is over) from
    the newest readable checkpoint in <out>, or None if there is none; CheckpointError if there are
    checkpoints but none loads. load(path) builds an agent from a saved folder."""
    failures = []
    for path in reversed(checkpoints(out)):
        try:
            return read_checkpoint(path, names, load)
        except Exception as e:  # noqa: BLE001  (a broken checkpoint of any kind: try the one before)
            failures.append(f"{path}: {type(e).__name__}: {e}")
            print(f"checkpoint {path} cannot be loaded ({type(e).__name__}: {e}); trying the one before", flush=True)
    if failures:
        raise CheckpointError(f"no checkpoint in {out} can be loaded, and nothing there was changed:\n  "
                              + "\n  ".join(failures))
    return None


def read_checkpoint(path, names, load):
    state, agents = torch.load(os.path.join(path, "state.pt"), weights_only=True), {}  # never unpickles code
    for name in names:
        if name not in state["opt"]:
            raise KeyError(f"it holds no {name!r} agent (its agents: {sorted(state['opt'])})")
        a = agents[name] = load(os.path.join(path, name))
        a.opt.load_state_dict(state["opt"][name])
        if name in state["pending"]:
            trajs, adv = state["pending"][name]
            a.pending = ([Traj(**t) for t in trajs], torch.tensor(adv))
    python = state["rng"]["python"]
    random.setstate((python[0], tuple(python[1]), python[2]))
    torch.set_rng_state(state["rng"]["torch"])
    if state["rng"]["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    rounds = state.get("sft_rounds")
    return agents, int(state["index"]), int(state["metrics_lines"]), None if rounds is None else int(rounds)


def clear_run(out):
    """A fresh run over an earlier one (--overwrite): its checkpoints, reference and cold-start check
    go, so that pruning cannot drop the new run's checkpoints as older, nor --resume continue the old
    run."""
    for path in checkpoints(out) + [os.path.join(out, "ref"), os.path.join(out, "base")]:
        shutil.rmtree(path, ignore_errors=True)
    if os.path.exists(os.path.join(out, "sft_check.json")):
        os.remove(os.path.join(out, "sft_check.json"))


def save_frozen(out, folder, agents):
    """Models that a run keeps as they are now, in <out>/<folder>/<agent>: --kl-coef's reference ("ref",
    saved before the checkpoint that ends the cold start, so that a resumed run always finds it) and
    --lora-rank's bases ("base"). Like a checkpoint, written aside, fsynced and renamed in."""
    tmp, final = os.path.join(out, f"ckpt-tmp-{folder}-{secrets.token_hex(4)}"), os.path.join(out, folder)
    for n, a in agents.items():
        a.model.save_pretrained(os.path.join(tmp, n))
    fsync_tree(tmp)
    if os.path.exists(final):  # a cold start cut off and resumed saves it again
        aside = os.path.join(out, f"ckpt-tmp-old-{secrets.token_hex(4)}")
        os.rename(final, aside)
        shutil.rmtree(aside, ignore_errors=True)
    os.rename(tmp, final)
    fsync_dir(out)


def load_reference(out, agents, device):
    """--kl-coef: the frozen reference of each agent, in its sampling dtype (with LoRA: none, the base
    with its adapter switched off is the reference)."""
    for n, a in agents.items():
        if a.peft:
            continue
        dtype = torch.bfloat16 if a.bf16 else torch.float32
        a.ref = AutoModelForCausalLM.from_pretrained(os.path.join(out, "ref", n), dtype=dtype)
        a.ref.to(device).eval().requires_grad_(False)


# ---------------------------------------------------------------------------------------
# The run's folder: a resume, or a fresh start
# ---------------------------------------------------------------------------------------
# what a --resume must agree on with the run it continues: its agents, its task, its schedule (steps
# may grow: positions up to the old end keep their phases) and its cold start but for its check (a resume
# without one takes the rounds done as the cold start)
SAME_RUN = ("mode", "role", "task", "seed", "level", "questions_per_step", "group_size",
            "max_sub", "w_sub", "main_model", "sub_model", "model_size", "chat", "eval_every", "kl_coef",
            "lora_rank", "cold_start")


def identity(settings):
    """The settings of SAME_RUN in a dict of args.json's shape; of the cold start all but its check. An
    older run's --level L with --train-levels T reads as today's --level T (or L without T), where T
    starts with L, its evaluations' level."""
    same = {k: settings[k] for k in SAME_RUN if k in settings}
    if isinstance(same.get("level"), int):
        old = list(settings.get("train_levels") or [same["level"]])
        same["level"] = old if old[0] == same["level"] else [same["level"], "train_levels", *old]
    if isinstance(same.get("cold_start"), dict):
        same["cold_start"] = {k: v for k, v in same["cold_start"].items() if k != "until"}
    return same


@contextlib.contextmanager
def own_out(args, out, made=False):
    """This process's hold on the output folder for the whole run: a lock that keeps a second run off
    it, and the checks that must pass before anything in it or in the store is touched: a --resume
    with the run's own settings; a fresh start only where no run is, or with --overwrite. A folder this
    run `made` goes again if the run fails before it wrote anything there (a model that cannot load)."""
    try:
        fd = os.open(os.path.join(out, ".lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:  # a symlink or a folder planted there
        raise SystemExit(f"error: cannot lock {out}/.lock ({e})") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            made = False  # the folder is the other run's
            raise SystemExit(f"error: another run is using {out}") from None
        if args.resume:
            same_run(args, out)
        elif holds_run(out) and not args.overwrite:
            raise SystemExit(f"error: {out} holds a run: continue it with --resume, or start afresh over it "
                             "with --overwrite (its checkpoints go), or pick another --out")
        yield
    except BaseException:
        with contextlib.suppress(OSError):  # never in the way of the error itself
            if made and os.listdir(out) == [".lock"]:
                os.remove(os.path.join(out, ".lock"))
                os.rmdir(out)
        raise
    finally:
        os.close(fd)


def resume_or_start(args, out, load):
    """(agents, schedule position, metrics lines, cold-start rounds done or None once RL began): from
    the last readable checkpoint in `out` with --resume (a resume whose checkpoints all fail to load
    stops, touching nothing), else new agents in a folder cleared of an earlier run."""
    if args.resume:
        resumed = resume(args, out, load)
        if resumed:
            return resumed
        print(f"no checkpoint in {out}: starting afresh", flush=True)
    return start_afresh(args, out, load)


def holds_run(out):
    """Does `out` hold a run: checkpoints, its settings, or metrics?"""
    metrics = os.path.join(out, "metrics.jsonl")
    return bool(checkpoints(out)) or os.path.exists(os.path.join(out, "args.json")) or (
        os.path.isfile(metrics) and os.path.getsize(metrics) > 0)


def same_run(args, out):
    """--resume: stop, touching nothing, if the settings contradict those in <out>/args.json."""
    path = os.path.join(out, "args.json")
    if not os.path.exists(path):
        return
    try:
        with open(path) as f:
            saved = json.load(f)
        if not isinstance(saved, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: {path} cannot be read ({e}); --resume needs the run's settings") from None
    saved, now = identity(saved), identity(json.loads(json.dumps(dataclasses.asdict(args))))  # as args.json has it
    diff = {k: (saved[k], now[k]) for k in saved if saved[k] != now.get(k)}
    if diff:
        raise SystemExit(f"error: --resume with other settings than the run in {out} has (the run's, "
                         f"yours): {diff}; resume with its settings, or start afresh with --overwrite")


def resume(args, out, load):
    """--resume: resume_or_start's tuple from the last readable checkpoint in `out`, with
    metrics.jsonl cut back to it; None if there is none."""
    try:
        resumed = load_checkpoint(out, agent_names(args), load)
    except CheckpointError as e:
        raise SystemExit(f"error: {e}") from None
    if resumed is None:
        return None
    path = os.path.join(out, "metrics.jsonl")
    with open(path) as f:
        lines = f.readlines()
    if len(lines) < resumed[2]:
        print(f"warning: {path} has {len(lines)} lines, its checkpoint counts {resumed[2]}; "
              "the missing phases' metrics are lost", flush=True)
    write_atomically(path, "".join(lines[:resumed[2]]))  # the lines of phases after the checkpoint go
    print(f"resumed from {out} at schedule position {resumed[1]}" + (
        f", in the cold start after round {resumed[3]}" if resumed[3] is not None else ""), flush=True)
    return resumed


def start_afresh(args, out, load):
    """New agents (seeds args.seed and args.seed + 1; S at its --lr), in a folder cleared of any
    earlier run: (agents, 0, 0, 0), as resume's."""
    given, agents = {"main": args.main_model, "sub": args.sub_model}, {}
    for n in agent_names(args):
        try:
            agents[n] = load(given[n], seed=args.seed + (n == "sub"), lr=args.lr[-1] if n == "sub" else args.lr[0])
        except (OSError, ValueError) as e:  # a model given that is none (a folder without its files, say)
            if not given[n]:
                raise
            why = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            raise SystemExit(f"error: --{n}-model {given[n]} cannot be loaded: {why}") from None
    clear_run(out)  # first: a kill from here on leaves no earlier run's checkpoints under new settings
    open(os.path.join(out, "metrics.jsonl"), "w").close()
    write_atomically(os.path.join(out, "args.json"), json.dumps(dataclasses.asdict(args), indent=1))
    return agents, 0, 0, 0


def write_atomically(path, text):
    """`path` holds the old text or the new, whatever the moment of a kill or a power loss."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
