"""What does each agent know after its cold start (or at a checkpoint)? Per relation and level.

Builds the agents exactly as `python mgrpo.py <options>` does (same seeds) and runs their
cold starts. The sub-agent gets 200 held-out sub-tasks per relation and level: the share it
answers right (r_expert), and the share whose first search asks for the sub-task's own entity
(whether it copies the name from its task). The main agent gets 200 held-out questions per level with a
perfect sub-agent (one that returns the true fact for any well-formed sub-task): its success
shows whether it plans the hops and answers, apart from S. Greedy and sampled at temperature 1.
With --mode single-agent: the single agent on 200 held-out questions per level, greedy, and
for each failure the first search that asks for a wrong entity (the hop before was misread) and
where the misread fact stood in its list. For the single agent and the sub-agent: whether it reads a
person's fact at each distance back from the end of a list (reads_by_distance).
The probes of stage 1s in experiments/stage1.md come from it. It probes the toy task only:

    python -m experiments.sub_probe --cold-start '{"levels": [1, 2, 2, 3]}'
    python -m experiments.sub_probe --main-model runs/compare/stage1-levels122-seed2-system/main \
        --sub-model runs/compare/stage1-levels122-seed2-system/sub
    python -m experiments.sub_probe --mode single-agent --main-model <stage 1>/main
    python -m experiments.sub_probe --help     # any mgrpo.py option
"""
import random
import re
import sys
import time

import torch
import transformers

import cold_start
import mgrpo
import toy_tools
from agents import Traj, load_agent, new_traj
from sampling import collate
from tools import tool_calls


def sub_tasks(level, n=200):
    """n held-out questions of this level and, per hop of its chain, the sub-task that a
    perfect main agent would write: {hop name: [sub-task per question]}."""
    qs = [toy_tools.make_question(mgrpo.EVAL_SEED + i, level) for i in range(n)]
    rels = toy_tools.chain(level)
    names = [rel if rels.count(rel) == 1 else f"{rel}{rels[:i + 1].count(rel)}" for i, rel in enumerate(rels)]
    tasks = {name: [] for name in names}
    for q in qs:
        kb, x = toy_tools.knowledge_base(q.seed, level), q.text.split()[-2]
        for name, rel in zip(names, rels):
            tasks[name].append(f"{rel} of {x}")
            x = kb[(rel, x)]
    return qs, tasks


def first_search(agent, traj):
    """The argument of the first search in a trajectory (word-level tags or a chat tool call), or None."""
    m = re.search(r'<search> (\S+) </search>|"query": "([^"]*)"', agent.tok.decode(traj.ids))
    return m and (m.group(1) or m.group(2))


def fact_place(q, task):
    """Where the fact that a sub-task asks for stands in the result list of a search for its entity
    (0: first; -1: not in the list)."""
    rel, e = toy_tools.parse_subtask(task)
    fact = toy_tools.fact_text(rel, e, toy_tools.knowledge_base(q.seed, q.level)[(rel, e)])
    facts = [r["content"] for r in toy_tools.search_results(q.seed, q.level, e)]
    return facts.index(fact) if fact in facts else -1


def miss_places(qs, trajs):
    """Where the fact that each missed sub-task asks for stands in the result list of a search for the
    sub-task's entity (0: first): {place: misses}. A model that misses every fact at the head of a long
    list, and no other, copies only from so far back (experiments/stage1.md)."""
    places = {}
    for q, t in zip(qs, trajs):
        if toy_tools.expert_score(q, t.task, t.result, t.reads):
            continue
        place = fact_place(q, t.task)
        places[place] = places.get(place, 0) + 1
    return places


def perfect_sub_agent(tasks, questions, seed, greedy):
    """A sub-agent that returns the true fact of each well-formed sub-task, and 'none' else."""
    out = []
    for task, q in zip(tasks, questions):
        parsed = toy_tools.parse_subtask(task)
        value = toy_tools.knowledge_base(q.seed, q.level).get(parsed) if parsed else None
        out.append(Traj([], [], [], task=task, result=value or "none", ok=True))
    return out


def single_agent_misses(agent, args, n=200):
    """--mode single-agent: per level, the greedy rollouts on n held-out questions sorted by the
    first search that asks for a wrong entity (the hop before it was misread), or right."""
    for level in sorted(toy_tools.N_SNIPPETS):
        qs, tasks = sub_tasks(level, n)
        trajs = [new_traj(agent, "single", q.text) for q in qs]
        act = tool_calls(toy_tools.ToySearch(), qs, agent.chat)
        trajs = mgrpo.agent_loop(agent, "single", trajs, act, args.max_turns[0], 0, True)
        seen, places = {}, {}
        for j, (t, q) in enumerate(zip(trajs, qs)):
            chain = [hop[j].split()[-1] for hop in tasks.values()]  # "city of bo": search "bo"
            asked = re.findall(r"<search> (\S+) </search>", agent.tok.decode(t.ids))
            wrong = next((i for i, (a, b) in enumerate(zip(asked, chain)) if a != b), None)
            key = ("right" if t.ok and toy_tools.answer_correct(q, t.result) else
                   f"search {wrong + 1} asks for a wrong entity" if wrong is not None else "other")
            seen[key] = seen.get(key, 0) + 1
            if wrong and key != "right":  # the misread fact's place in the list before (0: first)
                places.setdefault(key, []).append(fact_place(q, list(tasks.values())[wrong - 1][j]))
        print(f"  level {level}: " + ", ".join(f"{k} {v}" for k, v in sorted(seen.items())), flush=True)
        for k, v in sorted(places.items()):
            print(f"    {k}: the fact misread stood at places " + ", ".join(
                f"{p} ({v.count(p)})" for p in sorted(set(v))) + " of its list", flush=True)


def reads_by_distance(agent, kind, lengths=(8, 12), n=60):
    """Whether the agent reads a person's fact by how far back it stands: for n level-2 questions, the
    result list of the first search rebuilt with `length` facts (the list's own, then other country
    facts) and the person's friend (or city) fact k facts from its end, for each k; the share of greedy
    next words after "<think> X knows" ("X lives") that are the friend (the city). Each fact is 4
    tokens, so k facts back is 4k tokens back. Then, per k in lists of the first length, the head that
    attends most from there to the value in the list: the one that copies it (layer.head, weight)."""
    was = agent.model.config._attn_implementation
    agent.model.set_attn_implementation("eager")  # the attention weights, which sdpa does not return
    try:
        for rel in ("friend", "city"):
            read, heads = reads_of(agent, kind, rel, lengths, n)
            for length in lengths:
                print(f"  {rel}, list of {length}: " + ", ".join(f"{k} {sum(read[(length, k)]) / n:.2f}"
                                                               for k in range(1, length + 1)), flush=True)
            print(f"  {rel}, the head that attends most to the value, list of {lengths[0]}: " + ", ".join(
                f"{k} {top(heads[k] / n)}" for k in range(1, lengths[0] + 1)), flush=True)
    finally:  # the caller's model as it was, even when the probe fails
        agent.model.set_attn_implementation(was)


def top(weights):
    """'layer.head weight' of the largest mean attention in a [layers, heads] tensor."""
    i = int(weights.argmax())
    return f"{i // weights.shape[1]}.{i % weights.shape[1]} {weights.max():.2f}"


def reads_of(agent, kind, rel, lengths, n):
    """reads_by_distance's reads of one relation: {(length, k): [right or not, per question]}, and per k
    in lists of the first length the summed attention from the read's position to the value ([layers, heads])."""
    read, heads, think = {}, {}, agent.tok.convert_tokens_to_ids("<think>")
    for i in range(n):
        q = toy_tools.make_question(10 ** 6 + i, 2)
        kb, x = toy_tools.knowledge_base(q.seed, 2), q.text.split()[-2]
        fact, value = toy_tools.fact_text(rel, x, kb[(rel, x)]), agent.tok.convert_tokens_to_ids(kb[(rel, x)])
        facts = [r["content"] for r in toy_tools.search_results(q.seed, 2, x)]
        others = [f for f in facts if f != fact] + [f for f in (toy_tools.fact_text(
            "country", c, kb[("country", c)]) for c in toy_tools.CITIES) if f not in facts]
        search = toy_tools.action_text("search", x)
        msgs = (toy_tools.single_demo(q, random.Random(i), 0.0)[:3] if kind == "single" else [
            {"role": "user", "content": f"{rel} of {x}"}, {"role": "assistant", "content": search},
            {"role": "tool", "content": ""}]) + [{"role": "assistant", "content": toy_tools.quote(fact)}]
        rows, at = [], []
        for length in lengths:
            rest = others[:length - 1]
            for k in range(1, length + 1):
                msgs[2] = {"role": "tool", "content": " ; ".join(rest[:length - k] + [fact] + rest[length - k:])}
                t = cold_start.encode_demo(agent, msgs, kind)
                rows.append(t)  # the agent reads on from "<think> X knows"; the value, where it stands in the list
                j = t.ids.index(think)
                at.append((length, k, j + 2, max(p for p in range(j) if t.ids[p] == value)))
        ids, attn, _, _ = collate(rows, agent.pad_id, agent.model.device)
        with torch.no_grad():
            out = agent.model(input_ids=ids, attention_mask=attn, output_attentions=True)
        for r, (length, k, j, v) in enumerate(at):
            read.setdefault((length, k), []).append(int(out.logits[r, j].argmax()) == value)
            if length == lengths[0]:
                heads[k] = heads.get(k, 0) + torch.stack([a[r, :, j, v] for a in out.attentions]).float()
    return read, heads


def probe_sub(sub, args):
    """The sub-agent on 200 held-out sub-tasks per hop and level: its expert score, greedy and sampled,
    the share of first searches for the sub-task's own entity, and where the facts it missed stood."""
    misses = {}
    for level in sorted(toy_tools.N_SNIPPETS):
        qs, tasks = sub_tasks(level)
        scores, copied, misses[level] = [], [], {}
        for rel, ts in tasks.items():
            acc = []
            for greedy in (True, False):
                trajs = mgrpo.run_sub_agents(sub, args, toy_tools.ToySearch(), ts, qs, seed=0, greedy=greedy)
                acc.append(sum(toy_tools.expert_score(q, t.task, t.result, t.reads) for q, t in zip(qs, trajs)) / len(qs))
                if greedy:
                    for place, n in miss_places(qs, trajs).items():
                        misses[level][place] = misses[level].get(place, 0) + n
                    copied.append(sum(first_search(sub, t) == task.split()[-1] for t, task in zip(trajs, ts)))
            scores.append(f"{rel} {acc[0]:.2f} / {acc[1]:.2f}")
        print(f"  level {level}: " + ", ".join(scores) + f" (greedy, first search for the sub-task's own "
              f"entity: {sum(copied) / len(qs) / len(copied):.2f})", flush=True)
    print("sub-agent's greedy misses by the place of the asked fact in its result list (0: first):")
    for level, places in misses.items():
        print(f"  level {level}: " + (", ".join(f"{p}: {n}" for p, n in sorted(places.items())) or "none"))


def main(argv=None):
    args = mgrpo.parse_args(argv)
    if args.task != "toy_tools":
        sys.exit("sub_probe.py reads the toy task's knowledge base: it probes --task toy_tools only")
    transformers.utils.logging.disable_progress_bar()
    t0 = time.time()
    steps = cold_start.cold_start_steps(args, {"main": args.main_model, "sub": args.sub_model})
    if args.mode == "single-agent":
        agent = load_agent(args.main_model, args, toy_tools, seed=args.seed)
        cold_start.cold_start_round({"main": agent}, {"main": steps["main"]}, args, toy_tools)
        print("single agent, greedy, 200 held-out questions per level:")
        single_agent_misses(agent, args)
        print("single agent, level 2's facts about a person read (greedy), by how many facts back they stand:")
        return reads_by_distance(agent, "single")
    agents = {"main": load_agent(args.main_model, args, toy_tools, seed=args.seed),
              "sub": load_agent(args.sub_model, args, toy_tools, seed=args.seed + 1)}
    cold_start.cold_start_round(agents, steps, args, toy_tools)
    what = [f"from {args.main_model or 'a new model'} and {args.sub_model or 'a new model'}"]
    if any(steps.values()):
        what.append(f"after {' / '.join(map(str, steps.values()))} cold-start steps (main / sub; levels "
                    f"{cold_start.demo_levels(args)}, lr {args.cold_start.lr}, seed {args.seed})")
    print(f"agents {' '.join(what)}, {time.time() - t0:.0f}s\nsub-agent, expert score greedy / sampled:")
    probe_sub(agents["sub"], args)
    print("sub-agent, level 2's facts about a person read (greedy), by how many facts back they stand:")
    reads_by_distance(agents["sub"], "sub")
    print("main agent with a perfect sub-agent, success greedy / sampled:")
    for level in sorted(toy_tools.N_SNIPPETS):
        args.level, args.eval_questions = (level,), 200
        acc = [mgrpo.evaluate(agents["main"], args, toy_tools, perfect_sub_agent, None, greedy)
               for greedy in (True, False)]
        print(f"  level {level}: {acc[0]:.2f} / {acc[1]:.2f}", flush=True)


if __name__ == "__main__":
    main()
