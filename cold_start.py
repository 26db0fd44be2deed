"""The cold start: the stand-in for the paper's stage 1, and not part of M-GRPO.

The paper's agents start from pretrained models, which already write the action format. Tiny models
built in code know nothing, and RL alone never finds the format. So each agent first learns it by
cross-entropy on the task's scripted demos, made deliberately noisy (each entity replaced by a
random one with probability --demo-noise), on the tokens the agent would sample (mask 1). With
--sft-until the system is then checked on held-out questions and, round by round until it passes,
trained again (a model built here from fresh weights). A model given by name or path gets no cold
start unless --sft-steps asks for one.
"""
import copy
import functools
import json
import math
import multiprocessing
import os
import dataclasses
import random
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

import torch
import transformers
from transformers import AutoModelForCausalLM

from agents import adamw, add_adapter, build_model, load_agent, message_ids, new_traj, share_base
from checkpoints import load_reference, save_checkpoint, save_frozen
from run import agent_kinds, exit_with_parent, levels, load_task
from sampling import collate, token_logprobs
from tools import stable_seed


def cold_start_steps(args, models):
    """Cold-start steps per agent, {name: model name or path ('' for one built here)}: --sft-steps, or
    with -1, 600 for a model built here and none for one given, which has learned its format already."""
    return {n: args.sft_steps if args.sft_steps >= 0 else 0 if path else 600 for n, path in models.items()}


def encode_demo(agent, msgs, kind):
    """A demo conversation as a Traj, built exactly as rollouts build contexts (log-probs unused)."""
    t = new_traj(agent, kind, msgs[0]["content"])
    for msg in msgs[1:]:
        if msg["role"] == "assistant":
            ids = agent.tok(msg["content"], add_special_tokens=False).input_ids + [agent.end[0]]
            t.add(ids, [0.0] * len(ids))
        else:
            t.add(message_ids(agent, msg["role"], msg["content"]))
    return t


def sft_rate(i, steps, warmup, decay=1.0):
    """The cold start's learning rate at step i of `steps`, as a share of --sft-lr: a linear rise over the
    first `warmup` share of the steps, times a cosine decay over the last `decay` share (1: all of them).
    Without the rise, AdamW's first full-size steps on random weights left a tiny sub-agent blind to facts
    at a few places of its result lists, on most init seeds (docs/stage1.md)."""
    rise, fall = max(1, round(warmup * steps)), max(1, round(decay * steps))
    held = max(0, i - (steps - fall))  # steps into the decay
    return min(1.0, (i + 1) / rise) * 0.5 * (1 + math.cos(math.pi * held / fall))


def jittered_positions(attn, mask, share, gen):
    """Position ids for a cold-start batch: in a `share` of the rows, chosen at random, a gap of one
    position opens with probability 1/2 before each token the agent did not write (mask 0: prompt, tool
    output). Trained on a result list whose facts stand a fixed number of tokens apart, a tiny
    model learned to read them by their distance back, and was blind at a few distances (docs/stage1.md);
    the other rows keep the plain positions that rollouts use."""
    rows = torch.rand(len(attn), 1, generator=gen) < share
    skip = rows & (mask == 0) & (torch.rand(attn.shape, generator=gen) < 0.5)
    return ((attn + skip.long() * attn).cumsum(-1) - 1).clamp(min=0)


def cold_start(agent, kind, args, task, seed, steps):
    """`steps` steps of cross-entropy on the mask-1 tokens of fresh noisy demos, at the rate of sft_rate;
    the loss and the time left printed now and then. A non-finite loss stops the run before any
    checkpoint holds the broken weights. Returns the final loss: its mean over the last 2% of the steps
    (at least one per demo level), steady enough to rank draws by where no check does (cold_start_all)."""
    opt = adamw(agent.model, args.sft_lr, args.sft_weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: sft_rate(i, steps, args.sft_warmup, args.sft_decay))
    rng, mix = random.Random(seed), levels(args.sft_levels, args.level)
    gen = torch.Generator().manual_seed(seed)
    t0, loss, tail = time.time(), torch.tensor(0.0), []
    # --sft-bare: a tiny model behind a system prompt of hundreds of tokens takes many times longer to learn to
    # copy a name from its task; learned on bare demos first, the copy carries over in ~100 steps
    bare = dataclasses.replace(agent, system=None, splits={})
    for i in range(steps):
        demos, enc = [], bare if agent.system and i < args.sft_bare * steps else agent
        for _ in range(args.sft_batch):  # a question, then its demo, from the one rng; one level per step,
            q = task.make_question(rng.randrange(2 ** 31), mix[i % len(mix)])  # padded to its own length
            demos.append(encode_demo(enc, task.demo(q, rng, args.demo_noise, kind, agent.chat), kind))
        ids, attn, mask, _ = collate(demos, agent.pad_id, "cpu")
        pos = jittered_positions(attn, mask, args.sft_jitter, gen).to(agent.model.device) if args.sft_jitter else None
        ids, attn, mask = (x.to(agent.model.device) for x in (ids, attn, mask))
        agent.model.train(args.grad_checkpointing)
        with agent.autocast():
            loss = -token_logprobs(agent.model, ids, attn, mask, pos).sum() / mask.sum()
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
    agent.model.eval()
    opt.zero_grad(set_to_none=True)  # no stale gradient left on the weights (nor its memory)
    return sum(tail) / max(1, len(tail))


def cold_start_job(path, kind, args, seed, steps, parent):
    """A cold start in a process of its own: the agent saved at `path`, trained with one thread, saved
    back; it ends when the process `parent` does."""
    exit_with_parent(parent)
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    task = load_task(args.task)
    agent = load_agent(path, args, task)
    loss = cold_start(agent, kind, args, task, seed, steps)
    agent.model.save_pretrained(path)
    return loss


def built_model(agent, args, *seed):
    """A model like `agent`'s, built here from new random weights (an init seed from `seed`'s parts)."""
    with torch.random.fork_rng(devices=[]):  # the run's own RNG streams stay as they were
        return build_model(agent.tok, args.model_size, args.chat, stable_seed(args.seed, "init", *seed),
                           args.uniform_first_layer)


def draw_jobs(steps, given, args, more):
    """The cold starts of round `more`, {(agent, draw): (steps, demo seed)}: with --sft-draws d, d draws
    of each agent built here (draw 0 from its weights as they are, draw i from new random weights of
    its own), one of a model given by name or path. Each draw, and each round after the first, on
    demos of its own."""
    jobs = {}
    for n, s in steps.items():
        for d in range(1 if given[n] else args.sft_draws) if s else ():
            jobs[n, d] = s, stable_seed(args.seed, "sft-" + n, *[more] * bool(more), *["draw", d] * bool(d))
    return jobs


def cold_start_all(agents, steps, args, task, more=0, score=None):
    """Every agent's cold start ({name: steps}) in round `more`; with --sft-draws d, d draws of each agent
    built here (draw_jobs). The agents keep the draw of highest score(draw, losses), called with its
    weights loaded ({name: final loss}; without score, the lowest summed loss), draw d of each agent
    together. Returns (the kept draw, its {name: final loss}). On a CPU with cores to spare the draws run
    in processes of their own, one per core (a tiny model uses a second thread poorly, and they share
    nothing); short ones do not pay for a process start."""
    given, kinds = {"main": args.main_model, "sub": args.sub_model}, agent_kinds(args)
    jobs, trained = draw_jobs(steps, given, args, more), {}
    if len(jobs) < 2 or args.device != "cpu" or (os.cpu_count() or 1) < 2 or min(s for s, _ in jobs.values()) < 100:
        many = {n for n, d in jobs if d}  # agents with draws to choose from: each draw's weights are copied
        for (n, d), (s, seed) in jobs.items():  # draw 0 first, from the weights as they are
            if d:
                agents[n].model.load_state_dict(built_model(agents[n], args, n, more, "draw", d).state_dict())
            loss = cold_start(agents[n], kinds[n], args, task, seed, s)
            trained[n, d] = loss, copy.deepcopy(agents[n].model.state_dict()) if n in many else None
        return kept_draw(agents, trained, score)
    spawn, path = multiprocessing.get_context("spawn"), lambda job: os.path.join(tmp, f"{job[0]}-{job[1]}")
    with tempfile.TemporaryDirectory() as tmp, ProcessPoolExecutor(min(len(jobs), os.cpu_count()), spawn) as pool:
        for n, d in jobs:
            (built_model(agents[n], args, n, more, "draw", d) if d else agents[n].model).save_pretrained(path((n, d)))
            agents[n].tok.save_pretrained(path((n, d)))
        futures = {job: pool.submit(cold_start_job, path(job), kinds[job[0]], args, seed, s, os.getpid())
                   for job, (s, seed) in jobs.items()}
        for job, f in futures.items():
            trained[job] = f.result(), AutoModelForCausalLM.from_pretrained(path(job)).state_dict()
    return kept_draw(agents, trained, score)


def kept_draw(agents, trained, score):
    """The agents given the weights of the best of the trained draws, {(name, draw): (final loss, weights;
    None: the weights the agent holds)}; an agent with one draw is in each. Returns (its draw, {name: loss})."""
    if not trained:  # no agent had steps
        return 0, {}
    names, n_draws = {n for n, _ in trained}, 1 + max(d for _, d in trained)

    def load(d):
        draw = {n: trained.get((n, d), trained[n, 0]) for n in names}
        for n, (_, weights) in draw.items():
            if weights is not None:
                agents[n].model.load_state_dict(weights)
        return {n: loss for n, (loss, _) in draw.items()}
    values = []
    for d in range(n_draws):
        losses = load(d)
        values.append(score(d, losses) if score else -sum(losses.values()))
    best = max(range(n_draws), key=values.__getitem__)  # the first of equals
    return best, load(best)


def fresh_weights(agents, given, args, rnd):
    """Round `rnd` > 0, after a failed check: each agent built here starts again from new random weights
    (an init seed of the round's own): rounds that went on from a stalled tiny model's weights did not
    move its check (docs/stage1.md), so another round is a new draw instead. A model given by name or
    path, already pretrained, goes on from where it is."""
    for n, a in agents.items():
        if not given[n]:
            a.model.load_state_dict(built_model(a, args, n, rnd).state_dict())


def draw_score(d, losses, args, check, checks, draws):
    """A draw's rank in a round with --sft-until: its check, check(level) on each demo level (kept in
    `checks`), by the lowest level, then the sum, then the lowest summed final loss. The final loss alone
    does not tell a draw that passes: one that failed ended among those that passed (docs/stage1.md)."""
    checks[d] = {lv: check(lv) for lv in sorted(set(levels(args.sft_levels, args.level)))}
    if draws > 1:
        print(f"  draw {d + 1} of {draws}: final loss " + " ".join(f"{n} {v:.3f}" for n, v in losses.items())
              + ", check " + ", ".join(f"level {lv} {v:.3f}" for lv, v in checks[d].items()), flush=True)
    return min(checks[d].values()), sum(checks[d].values()), -sum(losses.values())


def cold_start_checked(agents, args, task, out, done, check):
    """The cold start, then (--sft-until) its check: check(level), the system's greedy success on
    held-out questions of each demo level, on each draw (the best kept); below the bar, another round on
    new demos, from fresh weights (fresh_weights), at most 3 more, each after a checkpoint (`done`: rounds
    a resumed run has behind it). The outcome goes to <out>/sft_check.json (and so into summary.json)."""
    given = {"main": args.main_model, "sub": args.sub_model}
    steps = cold_start_steps(args, {n: given[n] for n in agents})
    if not any(steps.values()) or (done and not args.sft_until):  # resumed without --sft-until: rounds done
        return
    draws = 1 if all(given[n] for n in agents if steps[n]) else args.sft_draws  # a given model: one draw
    for more in range(done, 4 if args.sft_until else 1):
        t0, checks = time.time(), {}
        if more:
            fresh_weights(agents, given, args, more)
        score = functools.partial(draw_score, args=args, check=check, checks=checks, draws=draws)
        kept, losses = cold_start_all(agents, steps, args, task, more, score if args.sft_until else None)
        print("cold start on noisy demos" + f" (round {more + 1}, from fresh weights)" * (more > 0) + ", final loss "
              + " ".join(f"{n} {v:.3f} ({steps[n]} steps)" for n, v in losses.items())
              + f", draw {kept + 1} of {draws} kept" * (draws > 1)
              + f" ({time.time() - t0:.0f}s)", flush=True)
        if not args.sft_until:
            return
        result, passed = checks[kept], min(checks[kept].values()) >= args.sft_until
        print("cold-start check, greedy success: " + ", ".join(f"level {lv} {v:.3f}" for lv, v in result.items())
              + ("" if passed else ", below --sft-until" + ": going on" * (more < 3)), flush=True)
        if passed:
            break
        if more < 3:  # a round of a small model's long demos can take most of an hour on a CPU
            save_checkpoint(out, agents, 0, 0, sft_rounds=more + 1)
    with open(os.path.join(out, "sft_check.json"), "w") as f:
        json.dump({"passed": passed, "rounds": more + 1, "greedy": result}, f)
    if not passed:
        print("warning: the cold start did not reach --sft-until after 3 more rounds; RL starts anyway", flush=True)


def attach_adapters(agents, args, out):
    """--lora-rank, as RL starts: each agent's weights frozen and an adapter of its own put on them.
    A base that this run built or cold-started is saved first, to <out>/base/<agent>, which its
    adapter names; a given one is named as given. --share-base: then one base serves both."""
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
            add_adapter(a, args, os.path.abspath(os.path.join(out, "base", n)) if n in own else given[n])
    if args.share_base:
        share_base(agents)


def before_rl(agents, args, task, out, done, check):
    """What comes before the first RL step. For a new run (done = 0), or one cut off in its cold
    start (done: its rounds), the cold start with its check, --lora-rank's adapters, then --kl-coef's
    frozen reference (saved before the checkpoint that ends the cold start, so that a resumed run
    always finds it) and the checkpoint that RL starts from; done = None: a resumed run past all that
    (its agents hold their adapters; --share-base shares their base again). With --kl-coef, the
    reference is loaded into each agent."""
    if done is not None:
        cold_start_checked(agents, args, task, out, done, check)
        if args.lora_rank:
            attach_adapters(agents, args, out)
        if args.kl_coef and not args.lora_rank:
            save_frozen(out, "ref", agents)
        save_checkpoint(out, agents, 0, 0)
    elif args.share_base:
        share_base(agents)
    if args.kl_coef:
        load_reference(out, agents, args.device)
