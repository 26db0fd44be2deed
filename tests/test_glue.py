"""One M-GRPO step's glue on scripted rollouts: who delegates how often, which sub-agent call
succeeds, and which rollout is right are fixed by the test, so rewards, alignment, advantages,
batch order, masks and the modes are checked against numbers worked out by hand."""
import copy
import dataclasses
import functools
import json
import random

import pytest
import torch
import transformers

import helpers
import mgrpo
import report
import tools
import toy_tools
from agents import prompt_ids
from sampling import token_logprobs
from scripted import Plan, forced

K, D = 4, 2
UPDATE = mgrpo.update_agent
Q = [toy_tools.make_question(11, 1), toy_tools.make_question(12, 1)]
ANSWER = {q.text: q.answer for q in Q}


def right(text):
    return ANSWER[text]


def wrong(text):
    return next(c for c in toy_tools.COUNTRIES if c != ANSWER[text])


# tutorial.md's worked example: rollouts delegate 0, 1, 2 and 4 times; M is wrong, right, right,
# then breaks its format; S's calls: (1,0) ada, (2,0) bo, (2,1) cy wrong, (3,0) dex, (3,1) eli
# broken, (3,2) fay wrong, (3,3) gus
TUTORIAL = Plan({0: [("answer", wrong)],
                 1: [("call", "city of ada"), ("answer", right)],
                 2: [("call", "city of bo"), ("call", "city of cy"), ("answer", right)],
                 3: [("call", f"city of {p}") for p in ("dex", "eli", "fay", "gus")] + [("bad", None)]},
                {"city of cy": "wrong", "city of eli": "bad", "city of fay": "wrong"})


@pytest.fixture(scope="module")
def agents():
    args = mgrpo.parse_args(["--cold-start", "0", "--group-size", str(K), "--max-sub", str(D), "--max-turns", "6", "3",
                             "--questions-per-step", "1"])
    return args, helpers.load_agent("", args, seed=1), helpers.load_agent("", args, seed=2)


def toy_expert(subs, exchange):
    """The toy task's r_expert of each sub-trajectory (eq. 5), as a step computes it before alignment."""
    return mgrpo.expert_scores(subs, exchange, Q[:1], toy_tools)[0]


def scripted_rollout(agents, plan, questions, monkeypatch):
    args, main, sub = agents
    monkeypatch.setattr(mgrpo, "generate", forced(plan))
    search = toy_tools.ToySearch()
    return mgrpo.rollout(main, questions, K, args, 0, functools.partial(mgrpo.run_sub_agents, sub, args, search),
                         search)


def test_the_worked_example_through_the_rollout_and_both_sides(agents, monkeypatch):
    args = agents[0]
    mains, subs = scripted_rollout(agents, TUTORIAL, Q[:1], monkeypatch)
    assert [len(m.calls) for m in mains] == [0, 1, 2, 4] and len(subs) == 7
    assert [m.ok for m in mains] == [True, True, True, False]
    r_main, adv_main, exchange, stats = mgrpo.main_side(mains, Q[:1], K, toy_tools)
    assert r_main.tolist() == pytest.approx([0.1, 1.0, 1.0, 0.0])                               # eq. 4
    assert adv_main.tolist() == pytest.approx([-0.8923, 0.9972, 0.9972, -1.1022], abs=1e-4)     # eq. 9-10
    assert [(e["rollout"], e["correct"], len(e["subs"])) for e in exchange] == [
        (0, False, 0), (1, True, 1), (2, True, 2), (3, False, 4)]
    batch, r_sub, adv_sub, st = mgrpo.sub_side(subs, exchange, Q[:1], toy_expert(subs, exchange), D, random.Random(0), args.w_sub)
    # the tutorial's aligned slots (3,3) (3,0) (1,0) (1,0) (2,0) (2,1) (3,1) (3,3), as sub-tasks (eq. 11)
    assert [t.task for t in batch] == [f"city of {p}" for p in ("gus", "dex", "ada", "ada", "bo", "cy", "eli", "gus")]
    assert r_sub.tolist() == pytest.approx([0.6, 0.6, 1.0, 1.0, 1.0, 0.5, 0.0, 0.6])           # eq. 5
    assert adv_sub.tolist() == pytest.approx([-0.1954, -0.1954, 1.055, 1.055, 1.055, -0.508, -2.0709, -0.1954],
                                             abs=1e-4)                                          # eq. 12-13
    assert (st["n_dup"], st["n_drop"]) == (3, 2)  # (1,0) once more and two borrowed; (3,0) (3,2) dropped


def test_a_borrowed_or_duplicated_slot_carries_the_correctness_of_the_rollout_that_made_it(agents, monkeypatch):
    """Rollout 0 answers right without delegating; its D slots are filled from wrong and right
    siblings, each with its producer's r_correct_main (eq. 5), never rollout 0's."""
    args = agents[0]
    plan = Plan({0: [("answer", right)],
                 1: [("call", "city of ada"), ("answer", wrong)],
                 2: [("call", "city of bo"), ("call", "city of cy"), ("call", "city of dex"), ("answer", right)],
                 3: [("call", "city of eli"), ("call", "city of fay"), ("answer", wrong)]},
                {"city of cy": "wrong", "city of fay": "bad"})
    mains, subs = scripted_rollout(agents, plan, Q[:1], monkeypatch)
    correct = {0: True, 1: False, 2: True, 3: False}
    expert = {"city of cy": 0, "city of fay": 0}
    fmt = {"city of fay": False}
    _, _, exchange, _ = mgrpo.main_side(mains, Q[:1], K, toy_tools)
    for seed in range(20):  # many draws of the borrowed and dropped slots
        rng = random.Random(seed)
        batch, r_sub, adv_sub, _ = mgrpo.sub_side(subs, exchange, Q[:1], toy_expert(subs, exchange), D, random.Random(seed), args.w_sub)
        pairs = mgrpo.align_sub_trajectories([0, 1, 3, 2], D, rng)
        by_hand = []
        for (k, i), t in zip(pairs, batch):
            assert t.k == k and t.task == subs[mains[k].calls[i]].task      # slot j holds (k, i)
            ok, e = fmt.get(t.task, True), expert.get(t.task, 1)
            by_hand.append(0.1 * ok + 0.4 * correct[k] * ok + 0.5 * e * ok)
        assert r_sub.tolist() == pytest.approx(by_hand)
        mean = sum(by_hand) / len(by_hand)
        std = (sum((r - mean) ** 2 for r in by_hand) / len(by_hand)) ** 0.5  # population std
        assert adv_sub.tolist() == pytest.approx([(r - mean) / std for r in by_hand], abs=1e-4)
        assert any(k != 0 for k, _ in pairs[:D])  # rollout 0's slots were borrowed


def test_groups_are_each_querys_K_rollouts_and_advantages_follow_the_batch(agents, monkeypatch):
    """Two queries in one step: the first all right (a zero-variance group), the second mixed.
    Each agent's update gets its batch with the advantage of each row beside it."""
    args = copy.deepcopy(agents[0])
    args.questions_per_step = 2
    args_, main, sub = agents
    plan = Plan({0: [("call", "city of ada"), ("answer", right)],
                 1: [("call", "city of bo"), ("answer", lambda t: right(t) if t == Q[0].text else wrong(t))],
                 2: [("answer", right)],
                 3: [("call", "city of cy"), ("call", "city of dex"), ("answer", right)]},
                {"city of dex": "wrong"})
    monkeypatch.setattr(mgrpo, "generate", forced(plan))
    monkeypatch.setattr(toy_tools, "make_question", lambda seed, level: Q[seed % 2])  # the step's questions: Q
    seen = []
    monkeypatch.setattr(mgrpo, "update_agent", lambda agent, trajs, adv, a, **kw: seen.append((trajs, adv)) or {
        "t_fwd": 0.0, "t_bwd": 0.0, "tokens": 1.0, **{k: 0.0 for k in report.UPDATE_STATS}})
    rng = random.Random(tools.stable_seed(args.seed, "questions", 1))
    order = [rng.randrange(2 ** 31) % 2 for _ in range(2)]
    assert order[0] != order[1], "pick a step whose two questions differ"
    search = toy_tools.ToySearch()
    mgrpo.train_step(main, sub, 1, args, toy_tools, functools.partial(mgrpo.run_sub_agents, sub, args, search), search)
    (m_trajs, m_adv), (s_trajs, s_adv) = seen
    assert [(t.q, t.k) for t in m_trajs] == [(q, k) for q in range(2) for k in range(K)]
    r = {Q[0].text: [1.0, 1.0, 1.0, 1.0], Q[1].text: [1.0, 0.1, 1.0, 1.0]}
    for q in range(2):
        text = Q[order[q]].text
        rewards = torch.tensor(r[text])
        expected = torch.zeros(K) if text == Q[0].text else (rewards - rewards.mean()) / rewards.std(unbiased=False)
        assert m_adv[q * K:(q + 1) * K].tolist() == pytest.approx(expected.tolist(), abs=1e-4)
    # S: D*K slots per query, in query order, each group z-scored on its own
    assert len(s_trajs) == len(s_adv) == 2 * D * K and [t.q for t in s_trajs] == [0] * D * K + [1] * D * K
    for q in range(2):
        group = s_adv[q * D * K:(q + 1) * D * K]
        rs = [mgrpo.sub_reward(t.ok, r[Q[order[q]].text][t.k] == 1.0,
                               toy_tools.expert_score(Q[order[q]], t.task, t.result, t.reads)) for t in s_trajs[q * D * K:(q + 1) * D * K]]
        assert group.tolist() == pytest.approx(mgrpo.group_advantages(rs).tolist(), abs=1e-5)
        assert abs(float(group.sum())) < 1e-4


def test_reward_weights_reach_the_rewards(agents, monkeypatch):
    args = copy.deepcopy(agents[0])
    args.w_sub = (0.2, 0.3, 0.5)
    mains, subs = scripted_rollout(agents, TUTORIAL, Q[:1], monkeypatch)
    r_main, _, exchange, _ = mgrpo.main_side(mains, Q[:1], K, toy_tools, w_format=0.3)
    assert r_main.tolist() == pytest.approx([0.3, 1.0, 1.0, 0.0])
    _, r_sub, _, _ = mgrpo.sub_side(subs, exchange, Q[:1], toy_expert(subs, exchange), D, random.Random(0), args.w_sub)
    # slots as in the tutorial: (3,3) (3,0) right fact, M wrong; (1,0) (2,0) right, M right; (2,1) wrong fact
    assert r_sub.tolist() == pytest.approx([0.7, 0.7, 1.0, 1.0, 1.0, 0.5, 0.0, 0.7])


def test_masks_and_logprobs_of_a_scripted_rollout(agents, monkeypatch):
    """Every sampled turn has mask 1 and its log-probs; the prompt, the search results and the
    sub-agent's returned text inside M's context have mask 0."""
    args, main, sub = agents
    mains, subs = scripted_rollout(agents, TUTORIAL, Q[:1], monkeypatch)
    for t, agent in [(m, main) for m in mains] + [(s, sub) for s in subs]:
        assert len(t.ids) == len(t.mask) == len(t.logp)
        assert all(lp == 0.0 for lp, m in zip(t.logp, t.mask) if not m)
        assert all(lp < 0.0 for lp, m in zip(t.logp, t.mask) if m)
    decode = lambda agent, t, m: agent.tok.decode([i for i, x in zip(t.ids, t.mask) if x == m])  # noqa: E731
    m3 = mains[3]
    trained = decode(main, m3, 1).split()
    assert trained[:3] == ["<think>", "dex", "</think>"] and trained.count("<call>") == 4 and "<tool>" not in trained
    inserted = decode(main, m3, 0)
    assert inserted.startswith(f"<user> {Q[0].text} <assistant>") and inserted.count("<tool>") == 4
    returned = [s.result if s.ok else "none" for s in (subs[i] for i in m3.calls)]
    assert [w for w in inserted.split() if w not in ("<tool>", "<assistant>")][-4:] == returned  # S's text: mask 0
    for s in subs:
        assert decode(sub, s, 0).count("<tool>") == 1 and " ; " in decode(sub, s, 0)  # the results: mask 0
        assert decode(sub, s, 1).split()[:3] == ["<search>", s.task.split()[-1], "</search>"]


def _run_steps(agents, monkeypatch, steps, **opts):
    args = copy.deepcopy(agents[0])
    for k, v in opts.items():
        setattr(args, k, v)
    main, sub = copy.deepcopy(agents[1]), copy.deepcopy(agents[2])
    monkeypatch.setattr(mgrpo, "generate", forced(TUTORIAL))
    monkeypatch.setattr(toy_tools, "make_question", lambda seed, level: Q[0])
    updates, real = [], mgrpo.update_agent
    monkeypatch.setattr(mgrpo, "update_agent", lambda agent, trajs, adv, a, **kw: updates.append(
        (agent is sub, copy.deepcopy(agent.model.state_dict()), trajs, adv.clone())) or real(agent, trajs, adv, a))
    batches = []
    real_side = mgrpo.sub_side
    monkeypatch.setattr(mgrpo, "sub_side", lambda *a: batches.append(real_side(*a)) or batches[-1])
    search = toy_tools.ToySearch()
    delegate = functools.partial(mgrpo.run_sub_agents, sub, args, search)
    for step in range(1, steps + 1):
        mgrpo.train_step(main, sub, step, args, toy_tools, delegate, search)
    return args, sub, [u for u in updates if u[0]], batches


def test_unsync_trains_S_on_exactly_the_previous_steps_batch(agents, monkeypatch):
    args, sub, updates, batches = _run_steps(agents, monkeypatch, 3, mode="unsync")
    assert len(updates) == 2 and len(batches) == 3  # step 1 only keeps its batch; the last is never used
    for (_, _, trajs, adv), (prev_batch, _, prev_adv, _) in zip(updates, batches):
        assert trajs is prev_batch and torch.equal(adv, prev_adv)  # step t trains on step t-1's batch
    # an independent replay: S as it started, updated synchronously on the batches of steps 1 and 2
    replay = copy.deepcopy(agents[2])
    for batch, _, adv, _ in batches[:2]:
        UPDATE(replay, batch, adv, args)
    for a, b in zip(replay.model.parameters(), sub.model.parameters()):
        assert torch.equal(a, b)
    start = dict(agents[2].model.named_parameters())
    assert any(not torch.equal(p, start[n]) for n, p in sub.model.named_parameters())


def test_sync_trains_S_on_its_own_steps_batch(agents, monkeypatch):
    args, sub, updates, batches = _run_steps(agents, monkeypatch, 2)
    assert [u[2] for u in updates] == [b[0] for b in batches]


def test_main_only_leaves_S_bit_identical(agents, monkeypatch):
    args, sub, updates, batches = _run_steps(agents, monkeypatch, 3, mode="main-only")
    assert updates == [] and len(batches) == 3  # R_S is still computed (and logged)
    start = agents[2].model.state_dict()
    assert all(torch.equal(v, start[k]) for k, v in sub.model.state_dict().items())


def test_single_agent_has_no_sub_agent(tmp_path):
    s = mgrpo.main(["--mode", "single-agent", "--cold-start", "5", "--steps", "2", "--questions-per-step", "2",
                    "--group-size", "2", "--eval-questions", "4", "--eval-every", "0", "--out", str(tmp_path)])
    assert s["params"] == sum(p.numel() for p in helpers.load_agent(str(tmp_path / "main"), mgrpo.parse_args([]),
                                                                     0).model.parameters())
    assert not (tmp_path / "sub").exists()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    steps = [r for r in rows if "eval" not in r]
    assert len(steps) == 2 and all(r["sub_calls"] == 0 and "sub_reward" not in r for r in steps)


def test_levels_mix_the_training_questions_and_evaluations_keep_the_first(tmp_path, monkeypatch):
    made, real = [], toy_tools.make_question

    def spy(seed, level):
        if seed:  # seed 0: parse_args checking that the levels exist
            made.append((seed >= mgrpo.EVAL_SEED, level))
        return real(seed, level)
    monkeypatch.setattr(toy_tools, "make_question", spy)
    mgrpo.main(["--level", "1", "2", "2", "--cold-start", "0", "--steps", "2", "--questions-per-step",
                "6", "--group-size", "2", "--eval-questions", "3", "--eval-every", "0", "--model-size", "0.1M",
                "--out", str(tmp_path)])
    assert [level for held_out, level in made if not held_out] == [1, 2, 2, 1, 2, 2] * 2  # in turn, per step
    assert {level for held_out, level in made if held_out} == {1}


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("positions", ["rotary", "absolute"])
def test_padding_on_either_side_scores_like_no_padding(agents, side, positions):
    """Rotary models (Llama, Qwen) are blind to a shift of every position; a model with learned
    absolute positions (GPT-2) is not, so it checks that position ids skip the padding."""
    _, main, _ = agents
    model = main.model
    if positions == "absolute":
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=len(main.tok), n_positions=64, n_embd=32, n_layer=2, n_head=4)).eval()
    rows = [prompt_ids(main, "main", q.text) + [7, 8, 9][:n] for n, q in enumerate(Q + Q)]
    L = max(map(len, rows)) + 2
    ids = torch.full((len(rows), L), main.pad_id)
    attn = torch.zeros_like(ids)
    for b, r in enumerate(rows):
        span = slice(L - len(r), L) if side == "left" else slice(0, len(r))
        ids[b, span], attn[b, span] = torch.tensor(r), 1
    with torch.no_grad():
        padded = token_logprobs(model, ids, attn)
        for b, r in enumerate(rows):
            alone = token_logprobs(model, torch.tensor([r]), torch.ones(1, len(r), dtype=torch.long))[0]
            span = slice(L - len(r), L) if side == "left" else slice(0, len(r))
            assert torch.allclose(padded[b, span], alone, atol=1e-5)
            assert padded[b][attn[b] == 0].abs().max() == 0  # padding scores 0
            assert alone[0] == 0 and (alone[1:] < 0).all()  # nothing predicts the first token


def test_a_context_budget_ends_the_single_agents_long_search_while_M_and_S_fit(agents, monkeypatch):
    """--max-context, alike for every agent: a conversation goes on only while its context holds the
    next tool result and a whole turn. At level 3 the single agent's four result lists overflow 160
    tokens, so it ends unanswered (r_format = 0) on a search whose results never entered; M, which
    reads S's one-word answers, and S, which reads one list, finish within the same budget."""
    args, main, sub = copy.deepcopy(agents[0]), *agents[1:]
    q = toy_tools.make_question(5, 3)
    args.level, args.max_turns = (3,), (6, 3)
    search = toy_tools.ToySearch()
    hops = [("search", "ada")] * 4 + [("answer", lambda t: q.answer)]
    monkeypatch.setattr(mgrpo, "generate", forced(Plan({k: hops for k in range(K)})))
    budget = 160
    for limit in (0, budget, 10):
        single = dataclasses.replace(main, max_context=limit)
        trajs, _ = mgrpo.rollout(single, [q], K, dataclasses.replace(args, mode="single-agent"), 0, None, search)
        if limit == 0:  # no budget: four searches and the answer
            assert all(t.ok and t.result == q.answer for t in trajs) and min(len(t.ids) for t in trajs) > budget
        elif limit == budget:  # ends on a search whose results did not fit: the last token is its own
            assert not any(t.ok for t in trajs) and all(len(t.ids) <= budget and t.mask[-1] == 1 for t in trajs)
            assert all(1 < sum(t.mask[i] and not t.mask[i + 1] for i in range(len(t.ids) - 1)) < 4 for t in trajs)
        else:  # not even the prompt and a turn fit: nothing sampled
            assert not any(t.ok or any(t.mask) for t in trajs)
    # four delegations, as a four-hop plan makes (a sub-task is not "country of ...": Plan reads that as M's)
    calls = [("call", f"{rel} of ada") for rel in ("friend", "friend", "city", "city")] + [("answer", lambda t: q.answer)]
    monkeypatch.setattr(mgrpo, "generate", forced(Plan({k: calls for k in range(K)})))
    m, s = (dataclasses.replace(a, max_context=budget) for a in (main, sub))
    mains, subs = mgrpo.rollout(m, [q], K, args, 0, functools.partial(mgrpo.run_sub_agents, s, args, search), search)
    assert all(t.ok and len(t.ids) <= budget for t in mains + subs) and len(subs) == 4 * K


def test_a_step_without_sub_tasks_has_no_share_of_zero_variance_groups_for_S():
    """No rollout delegated: S has no group, so its share of zero-variance groups is none (null), not 0.00,
    and the progress line says R_S - ; the evaluation's mean over steps skips it."""
    exchange = [{"query": 0, "rollout": k, "correct": False, "subs": []} for k in range(K)]
    batch, _, adv, st = mgrpo.sub_side([], exchange, Q[:1], [], D, random.Random(0))
    assert batch == [] and len(adv) == 0 and st["zero_var_sub"] is None
    line = report.progress_line({"step": 1, "main_reward": 0.0, "success": 0.0, "zero_var_main": 1.0, **st}, 5)
    assert "R_S -" in line and "zero-var S" not in line
