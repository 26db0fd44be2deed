"""Checkpoints of a run: each agent's weights, tokenizer and optimizer state, the RNG states, the unsync
batch and the place in the schedule; and the frozen reference of --kl-coef.

A checkpoint is a folder <out>/ckpt-<schedule position>; its state.pt loads with weights_only=True,
so a planted file cannot run code. A save goes to a temporary folder that is renamed into place, so a
kill at any moment leaves the earlier checkpoints whole.
"""
import dataclasses
import os
import random
import re
import secrets
import shutil

import torch
from transformers import AutoModelForCausalLM

from agents import Traj


def checkpoints(out):
    """The checkpoint folders in <out>, oldest first."""
    names = sorted(os.listdir(out)) if os.path.isdir(out) else []
    return [os.path.join(out, n) for n in names if re.fullmatch(r"ckpt-\d{8}", n)]


def save_checkpoint(out, agents, index, n_metrics, sft_rounds=None):
    """<out>/ckpt-<index>; the last two are kept. n_metrics: lines of metrics.jsonl it covers.
    sft_rounds: saved within the cold start, after that many rounds (None: the cold start is over)."""
    tmp = os.path.join(out, f"ckpt-tmp-{os.getpid()}-{secrets.token_hex(4)}")
    for name, a in agents.items():
        a.model.save_pretrained(os.path.join(tmp, name))
        a.tok.save_pretrained(os.path.join(tmp, name))
    pending = {n: ([dataclasses.asdict(t) for t in a.pending[0]], a.pending[1].tolist())
               for n, a in agents.items() if a.pending}
    rng = {"python": random.getstate(), "torch": torch.get_rng_state(),
           "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}
    torch.save({"index": index, "metrics_lines": n_metrics, "sft_rounds": sft_rounds, "pending": pending,
                "opt": {n: a.opt.state_dict() for n, a in agents.items()}, "rng": rng},
               os.path.join(tmp, "state.pt"))
    final = os.path.join(out, f"ckpt-{index:08d}")
    if os.path.exists(final):  # a cold-start round's, or one from before a crash and --resume: set aside, not
        os.replace(final, tmp + "-old")  # deleted, so that only the instant between two renames has none
    os.replace(tmp, final)
    leftovers = [os.path.join(out, n) for n in os.listdir(out) if n.startswith("ckpt-tmp-")]
    for path in checkpoints(out)[:-2] + leftovers:
        shutil.rmtree(path, ignore_errors=True)  # older ones, and what saves killed midway left


def load_checkpoint(out, names, load):
    """(agents, schedule position, metrics lines, cold-start rounds done or None when it is over) from
    the newest readable checkpoint in <out>, or None. load(path) builds an agent from a saved folder."""
    for path in reversed(checkpoints(out)):
        try:
            state, agents = torch.load(os.path.join(path, "state.pt"), weights_only=True), {}  # never unpickles code
            for name in names:
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
        except Exception as e:  # noqa: BLE001  (a broken checkpoint of any kind: try the one before)
            print(f"checkpoint {path} cannot be loaded ({type(e).__name__}: {e}); trying the one before", flush=True)
    return None


def clear_run(out):
    """A fresh run in a used folder: an earlier run's checkpoints, reference and cold-start check go,
    so that pruning cannot drop the new run's checkpoints as older, nor --resume continue the old run."""
    for path in checkpoints(out) + [os.path.join(out, "ref")]:
        shutil.rmtree(path, ignore_errors=True)
    if os.path.exists(os.path.join(out, "sft_check.json")):
        os.remove(os.path.join(out, "sft_check.json"))


def save_reference(out, agents):
    """--kl-coef: each agent as RL starts, saved before the checkpoint that ends the cold start, so that
    a resumed run always finds it."""
    for n, a in agents.items():
        a.model.save_pretrained(os.path.join(out, "ref", n))


def load_reference(out, agents, device):
    """--kl-coef: the frozen reference of each agent, in its sampling dtype."""
    for n, a in agents.items():
        dtype = torch.bfloat16 if a.bf16 else torch.float32
        a.ref = AutoModelForCausalLM.from_pretrained(os.path.join(out, "ref", n), dtype=dtype)
        a.ref.to(device).eval().requires_grad_(False)
