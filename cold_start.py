"""The cold start: the stand-in for the paper's stage 1, and not part of M-GRPO.

The paper's agents start from pretrained models, which already write the action format. Tiny models
built in code know nothing, and RL alone never finds the format. So each agent first learns it by
cross-entropy on the task's scripted demos, made deliberately noisy (each entity replaced by a
random one with probability `noise`), on the tokens the agent would sample (mask 1). With `until`
the system is then checked on held-out questions and, round by round until it passes, trained again
(a model built here from fresh weights). A model given by name or path gets no cold start unless
--cold-start asks for one. Its settings are a `ColdStart` (--cold-start), apart from the run's.
"""
import argparse
import dataclasses
import json
import math
import multiprocessing
import os
import random
import re
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

import torch
import transformers
from transformers import AutoModelForCausalLM

from agents import adamw, add_adapter, load_agent, message_ids, new_traj, outside_ids, share_base
from checkpoints import load_reference, save_checkpoint, save_frozen
from run import agent_kinds, exit_with_parent, load_task, search_tool
import smollm2
from sampling import collate, token_logprobs
from tiny_models import build_model
from tools import stable_seed


# ---------------------------------------------------------------------------------------
# The cold start's settings (--cold-start): a preset, a number of steps, or JSON
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ColdStart:
    steps: int = -1          # per agent; -1: 600 for a model built here, none for one given by name or path
    levels: tuple = ()       # the demos' task levels, taken in turn; (): the run's --level
    batch: int = 64          # demos per step, per agent
    lr: float = 1.5e-3       # peak learning rate (AdamW)
    warmup: float = 0.05     # share of the first steps over which the rate rises linearly to lr
    decay: float = 1.0       # share of the last steps over which it falls to 0 (a cosine); 1: all of them
    weight_decay: float = 0.0
    noise: float = 0.1       # probability that a demo replaces an entity by a random one
    bare: float = 0.0        # chat models: share of the first steps on demos without the system prompt
    until: float = 0.0       # the system's greedy success on held-out questions to reach, else another round
    uniform_first_layer: bool = False  # models built here: a first layer that attends alike to all earlier tokens

    def __str__(self):  # as --help shows the default: the preset, or the fields that differ from it
        changed = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) != f.default}
        return json.dumps(changed) if changed else "demo"


# Named settings. chat: the tiny chat models of --chat, whose cold start needs bare demos first and a
# check (docs/real-models.md). smollm2: a pretrained model learns the action format in a few steps; 20
# of 8 demos at 1e-4 fit the SmolLM2 demo's half hour (docs/real-models.md). The experiments' stage 1s
# pass their own as JSON (experiments/compare.py)
PRESETS = {"demo": {}, "none": {"steps": 0}, "chat": {"steps": 800, "batch": 16, "bare": 0.75, "until": 0.6},
           "smollm2": {"steps": 20, "batch": 8, "lr": 1e-4}}
SHARES = ("warmup", "decay", "noise", "bare", "until")


def parse_cold_start(spec):
    """--cold-start's text as ColdStart: a preset's name, a number of steps (the demo preset's
    settings), or a JSON object of ColdStart's fields (inline, or a file's path), over the preset it
    names as "preset" (else the defaults). A bad one is an error that says what is wrong, and where."""
    where = ""  # a file's name, once the spec names one
    try:
        if spec in PRESETS or re.fullmatch(r"-?[0-9]{1,9}", spec.strip()):
            fields = dict(PRESETS[spec]) if spec in PRESETS else {"steps": int(spec)}
        else:
            if not spec.lstrip().startswith("{"):
                where = spec + ": "
                with open(spec, encoding="utf-8") as f:
                    spec = f.read(1 << 20)
            fields = json.loads(spec)
            if not isinstance(fields, dict):
                raise ValueError("not a JSON object")
            base = fields.pop("preset", "demo")
            if base not in PRESETS:
                raise ValueError(f"no preset {base!r} (presets: {', '.join(PRESETS)})")
            fields = {**PRESETS[base], **fields}
        return checked_cold_start(fields)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{where}not JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    except (OSError, ValueError, TypeError, RecursionError) as e:
        raise argparse.ArgumentTypeError(f"{where}{e}; give a preset ({', '.join(PRESETS)}), a number of "
                                         "steps, or a JSON object of ColdStart's fields (cold_start.py)") from None


def checked_cold_start(fields):
    """ColdStart from a dict, each field of its own type and range, or a ValueError that names it."""
    kinds = {f.name: type(f.default) for f in dataclasses.fields(ColdStart)}
    unknown = sorted(set(fields) - set(kinds))
    if unknown:
        raise ValueError(f"unknown fields {unknown} (ColdStart has {', '.join(kinds)})")
    for k, v in fields.items():
        ok = (type(v) is int if kinds[k] is int else type(v) in (int, float) and math.isfinite(v) if kinds[k] is float else
              type(v) is bool if kinds[k] is bool else isinstance(v, list) and all(type(x) is int for x in v))
        if not ok:
            raise ValueError(f"{k} must be {'a list of levels' if kinds[k] is tuple else kinds[k].__name__}, "
                             f"not {v!r}")
    c = ColdStart(**{k: tuple(v) if kinds[k] is tuple else v for k, v in fields.items()})
    if not all(0 <= getattr(c, k) <= 1 for k in SHARES) or c.decay == 0:
        raise ValueError(f"{', '.join(SHARES)} are shares, in [0, 1] (decay above 0)")
    if c.steps < -1 or c.batch < 1 or not c.lr > 0 or c.weight_decay < 0 or min(c.levels, default=1) < 1:
        raise ValueError("steps must be >= -1, batch >= 1, lr > 0, weight_decay >= 0, levels >= 1")
    return c


# ---------------------------------------------------------------------------------------
# The cold start itself
# ---------------------------------------------------------------------------------------
def cold_start_steps(args, models):
    """Cold-start steps per agent, {name: model name or path ('' for one built here)}: ColdStart.steps,
    or with -1, 600 for a model built here and none for one given, which has learned its format already."""
    steps = args.cold_start.steps
    return {n: steps if steps >= 0 else 0 if path else 600 for n, path in models.items()}


def encode_demo(agent, msgs, kind):
    """A demo conversation as a Traj, built exactly as rollouts build contexts (log-probs unused)."""
    t = new_traj(agent, kind, msgs[0]["content"])
    for msg in msgs[1:]:
        if msg["role"] == "assistant":
            ids = outside_ids(agent, msg["content"], tags=False) + [agent.end[0]]  # quotes outside text
            t.add(ids, [0.0] * len(ids))
        else:
            t.add(message_ids(agent, msg["role"], msg["content"]))
    return t


def demo_levels(args):
    """The cold-start demos' levels, taken in turn: ColdStart.levels, else the run's first --level."""
    return list(args.cold_start.levels or args.level[:1])


def sft_rate(i, steps, warmup, decay=1.0):
    """The cold start's learning rate at step i of `steps`, as a share of its peak: a linear rise over the
    first `warmup` share of the steps, times a cosine decay over the last `decay` share (1: all of them).
    Without the rise, AdamW's first full-size steps on random weights left a tiny sub-agent blind to facts
    at a few places of its result lists, on most init seeds."""
    rise, fall = max(1, round(warmup * steps)), max(1, round(decay * steps))
    held = max(0, i - (steps - fall))  # steps into the decay
    return min(1.0, (i + 1) / rise) * 0.5 * (1 + math.cos(math.pi * held / fall))


def cold_start(agent, kind, args, task, seed, steps):
    """`steps` steps of cross-entropy on the mask-1 tokens of fresh noisy demos, at the rate of sft_rate;
    the loss and the time left printed now and then. A non-finite loss stops the run before any
    checkpoint holds the broken weights. Returns the final loss: its mean over the last 2% of the steps
    (at least one per demo level)."""
    c = args.cold_start
    opt = adamw(agent.model, c.lr, c.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: sft_rate(i, steps, c.warmup, c.decay))
    rng, mix = random.Random(seed), demo_levels(args)
    t0, loss, tail = time.time(), torch.tensor(0.0), []
    # `bare`: a tiny model behind a system prompt of hundreds of tokens takes many times longer to learn to
    # copy a name from its task; learned on bare demos first, the copy carries over in ~100 steps
    bare = dataclasses.replace(agent, system=None, splits={})
    with agent.training():
        for i in range(steps):
            demos, enc = [], bare if agent.system and i < c.bare * steps else agent
            for _ in range(c.batch):  # a question, then its demo, from the one rng; one level per step,
                q = task.make_question(rng.randrange(2 ** 31), mix[i % len(mix)])  # padded to its own length
                demos.append(encode_demo(enc, task.demo(q, rng, c.noise, kind, agent.chat), kind))
            ids, attn, mask, _ = collate(demos, agent.pad_id, "cpu")
            ids, attn, mask = (x.to(agent.model.device) for x in (ids, attn, mask))
            with agent.autocast():
                loss = -token_logprobs(agent.model, ids, attn, mask).sum() / mask.sum()
            if not torch.isfinite(loss):
                raise FloatingPointError(f"non-finite loss {loss.item()} in the cold start of {kind}, step {i + 1}")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(agent.model.parameters(), args.grad_clip)
            opt.step()
            schedule.step()
            tail = (tail + [loss.item()])[-max(len(mix), steps // 50):]
            if (i + 1) % max(1, steps // 4) == 0 and i + 1 < steps:
                print(f"  cold start {kind}: step {i + 1}/{steps}, loss {loss.item():.3f}, about "
                      f"{(time.time() - t0) / (i + 1) * (steps - i - 1):.0f}s left", flush=True)
    opt.zero_grad(set_to_none=True)  # no stale gradient left on the weights (nor its memory)
    return sum(tail) / max(1, len(tail))


def cold_start_job(path, kind, args, seed, steps, parent):
    """A cold start in a process of its own: the agent saved at `path`, trained with one thread, saved
    back; it ends when the process `parent` does."""
    exit_with_parent(parent)
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    task = load_task(args.task)
    if hasattr(task, "use_search"):  # a task whose demos search (qa_task.py): handed the run's search tool
        search_tool(args, task)
    agent = load_agent(path, args, task)
    loss = cold_start(agent, kind, args, task, seed, steps)
    agent.model.save_pretrained(path)
    return loss


def built_model(agent, args, *seed):
    """A model like `agent`'s, built here from new random weights (an init seed from `seed`'s parts)."""
    with torch.random.fork_rng(devices=[]):  # the run's own RNG streams stay as they were
        return build_model(agent.tok, args.model_size, args.chat, stable_seed(args.seed, "init", *seed),
                           args.cold_start.uniform_first_layer)


def cold_start_round(agents, steps, args, task, rnd=0):
    """Every agent's cold start ({name: steps}) in round `rnd`, each on demos of its own: {name: final loss}.
    On a CPU with cores to spare the agents train in processes of their own, one per core (a tiny model
    uses a second thread poorly, and they share nothing); short ones do not pay for a process start."""
    kinds = agent_kinds(args)
    jobs = {n: (s, stable_seed(args.seed, "sft-" + n, *[rnd] * bool(rnd))) for n, s in steps.items() if s}
    if len(jobs) < 2 or args.device != "cpu" or (os.cpu_count() or 1) < 2 or min(s for s, _ in jobs.values()) < 100:
        return {n: cold_start(agents[n], kinds[n], args, task, seed, s) for n, (s, seed) in jobs.items()}
    spawn, losses = multiprocessing.get_context("spawn"), {}
    with tempfile.TemporaryDirectory() as tmp, ProcessPoolExecutor(min(len(jobs), os.cpu_count()), spawn) as pool:
        for n in jobs:
            agents[n].model.save_pretrained(os.path.join(tmp, n))
            agents[n].tok.save_pretrained(os.path.join(tmp, n))
        futures = {n: pool.submit(cold_start_job, os.path.join(tmp, n), kinds[n], args, seed, s, os.getpid())
                   for n, (s, seed) in jobs.items()}
        for n, f in futures.items():
            losses[n] = f.result()
            agents[n].model.load_state_dict(AutoModelForCausalLM.from_pretrained(os.path.join(tmp, n)).state_dict())
    return losses


def fresh_weights(agents, given, args, rnd):
    """Round `rnd` > 0, after a failed check: each agent built here starts again from new random weights
    (an init seed of the round's own): rounds that went on from a stalled tiny model's weights did not
    move its check, so another round is a new draw instead. A model given by name or path, already
    pretrained, goes on from where it is."""
    for n, a in agents.items():
        if not given[n]:
            a.model.load_state_dict(built_model(a, args, n, rnd).state_dict())


def cold_start_checked(agents, args, task, out, done, check):
    """The cold start, then (`until`) its check: check(level), the system's greedy success on held-out
    questions of each demo level; below the bar, another round on new demos, from fresh weights
    (fresh_weights), at most 3 more, each after a checkpoint (`done`: rounds a resumed run has behind it).
    The outcome goes to <out>/sft_check.json (and so into summary.json)."""
    given = {"main": args.main_model, "sub": args.sub_model}
    steps = cold_start_steps(args, {n: given[n] for n in agents})
    until = args.cold_start.until
    if not any(steps.values()) or (done and not until):  # resumed without a check: its rounds done
        return
    for rnd in range(done, 4 if until else 1):
        t0 = time.time()
        if rnd:
            fresh_weights(agents, given, args, rnd)
        losses = cold_start_round(agents, steps, args, task, rnd)
        print("cold start on noisy demos" + f" (round {rnd + 1}, from fresh weights)" * (rnd > 0) + ", final loss "
              + " ".join(f"{n} {v:.3f} ({steps[n]} steps)" for n, v in losses.items())
              + f" ({time.time() - t0:.0f}s)", flush=True)
        if not until:
            return
        result = {lv: check(lv) for lv in sorted(set(demo_levels(args)))}
        passed = min(result.values()) >= until
        print("cold-start check, greedy success: " + ", ".join(f"level {lv} {v:.3f}" for lv, v in result.items())
              + ("" if passed else f", below {until}" + ": going on" * (rnd < 3)), flush=True)
        if passed:
            break
        if rnd < 3:  # a round of a small model's long demos can take most of an hour on a CPU
            save_checkpoint(out, agents, 0, 0, sft_rounds=rnd + 1)
    with open(os.path.join(out, "sft_check.json"), "w") as f:
        json.dump({"passed": passed, "rounds": rnd + 1, "greedy": result}, f)
    if not passed:
        print(f"warning: the cold start did not reach {until} after 3 more rounds; RL starts anyway", flush=True)


def attach_adapters(agents, args, out):
    """--lora-rank, as RL starts: each agent's weights frozen and an adapter of its own put on them.
    A base that this run built or cold-started is saved first, to <out>/base/<agent>, which its
    adapter names; a given one is named as given. Both on one given base: it is held once (one_base)."""
    given = {"main": args.main_model, "sub": args.sub_model}
    steps = cold_start_steps(args, {n: given[n] for n in agents})
    own = {n: a for n, a in agents.items() if not given[n] or steps[n]}
    if own:
        save_frozen(out, "base", own)
    for n, a in agents.items():
        # each adapter's init from a seed of its own, in one process as in two (peft draws it on the CPU,
        # then moves the adapter to its base's device)
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(stable_seed(args.seed, "lora", n))
            base = os.path.abspath(os.path.join(out, "base", n)) if n in own else smollm2.resolve(given[n])
            add_adapter(a, args.lora_rank, base)
    if one_base(args, agents):
        share_base(agents)


def one_base(args, agents):
    """Do both agents, in this process, put their LoRA adapters on one given base that no cold start
    changes? Then that base is held once, not twice (agents.share_base)."""
    given = {"main": args.main_model, "sub": args.sub_model}
    return bool(args.lora_rank and len(agents) == 2 and given["main"] and given["main"] == given["sub"]
                and not any(cold_start_steps(args, given).values()))


def before_rl(agents, args, task, out, done, check):
    """What comes before the first RL step. For a new run (done = 0), or one cut off in its cold
    start (done: its rounds), the cold start with its check, --lora-rank's adapters, then --kl-coef's
    frozen reference (saved before the checkpoint that ends the cold start, so that a resumed run
    always finds it) and the checkpoint that RL starts from; done = None: a resumed run past all that
    (its agents hold their adapters; one given base is shared again). With --kl-coef, the
    reference is loaded into each agent."""
    if done is not None:
        cold_start_checked(agents, args, task, out, done, check)
        if args.lora_rank:
            attach_adapters(agents, args, out)
        if args.kl_coef and not args.lora_rank:
            save_frozen(out, "ref", agents)
        save_checkpoint(out, agents, 0, 0)
    elif one_base(args, agents):
        share_base(agents)
    if args.kl_coef:
        load_reference(out, agents, args.device)
