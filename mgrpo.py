"""M-GRPO in one file: a main agent (planner) and a sub-agent (searcher), two LLMs with two optimizers,
trained with group-relative advantages computed for each agent on its own.

Paper: "Multi-Agent Deep Research: Training Multi-Agent Systems with M-GRPO", arXiv 2511.13288
(https://arxiv.org/abs/2511.13288); the authors' code: github.com/AQ-MedAI/MrlX. Comments cite the
paper's equations (`eq. 13`); tutorial.md states each one in words, next to this code.

What the algorithm really is, per training step:
  1. Rollout. For each of Q questions, K rollouts of the system. In rollout k the main agent M delegates
     sub-tasks to the sub-agent S (d_k times; d_k varies) and answers; each delegation runs S's own tool
     loop, whose answer is pasted into M's context. A token has loss mask 1 if its agent sampled it, 0 if
     it was inserted (the prompt, tool output, S's answer in M's context).
  2. Rewards: R_M per rollout (eq. 4), R_S per sub-trajectory (eq. 5).
  3. A_M: R_M standardised over the K rollouts of a question (eq. 9-10).
  4. Alignment: each rollout's sub-trajectories duplicated or dropped to exactly D (eq. 11).
  5. A_S: R_S standardised over the D*K aligned sub-trajectories of a question (eq. 12-13).
  6. Each agent takes its own clipped policy-gradient step (eq. 14-19): token-level ratio, asymmetric
     clip, no KL, no entropy bonus. With one epoch per batch (the default) the ratio is 1: REINFORCE with
     a per-agent group baseline (S under --unsync excepted).
  7. M's side hands S's side a few statistics per rollout (the paper's Fig. 3): in memory when one process
     holds both agents, through a file store with --role main / sub; no gradient and no tensor crosses
     between the agents.

The default run needs no download: two tiny Llama-style models with a word-level tokenizer, built in
code and first taught the answer format by a short supervised cold start on noisy scripted demos (the
stand-in for the paper's stage 1). `--main-model` / `--sub-model` take a Hugging Face name or path,
`--task` another task (toy_tools.py describes what a task provides).

    python mgrpo.py              # CPU demo: cold start, then M-GRPO on the toy task
    python mgrpo.py --help
"""
import argparse
import dataclasses
import functools
import importlib
import importlib.util
import inspect
import itertools
import json
import math
import multiprocessing
import os
import random
import re
import shutil
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

import toy_tools
from infra.runtime import (GraphDecoder, checkpoints, exit_with_parent, load_checkpoint, memory_estimate,
                           plot_curves, progress_line, save_checkpoint)
from infra.store import FileStore, StoreError


def arg(default, help):
    return field(default=default, metadata={"help": help})


@dataclass
class Args:
    seed: int = arg(1, "seeds everything: model init, questions, sampling, alignment")
    steps: int = arg(200, "M-GRPO steps (each updates both agents)")
    questions_per_step: int = arg(8, "questions (queries) per step")
    group_size: int = arg(8, "K: rollouts per question, the group of the main agent's advantage (eq. 9-10)")
    max_sub: int = arg(2, "D: aligned sub-trajectories per rollout (eq. 11); the paper picks P(d_k <= D) ~ 0.99")
    mode: str = arg("co-train", "co-train: M-GRPO, both agents train; main-only: S stays as it starts, M trains "
                    "(GRPO); single-agent: one model searches for itself and answers (GRPO), no S")
    task: str = arg("toy_tools", "the task: a module or a .py file with what toy_tools.py describes")
    level: int = arg(1, "task level; toy task: 1 = 2 hops, 3 clean snippets per search; 2 = 3 hops, 8 noisy ones; "
                     "3 = 4 hops, 12 noisy ones")
    train_levels: str = arg("", "levels of the training questions, taken in turn, e.g. '1,2'; empty: --level (a "
                            "mix keeps what a small model knows of a level it would otherwise not see); evaluations "
                            "use --level")
    main_model: str = arg("", "main agent: a Hugging Face name or path (a chat model); empty: a tiny model built here")
    sub_model: str = arg("", "sub-agent: a Hugging Face name or path; empty: a tiny model built here")
    model_size: str = arg("0.2M", "size of the models built here: 0.1M, 0.2M, 1M, 4M or 30M parameters")
    chat: bool = arg(False, "build the models as Qwen2 chat models (byte-level BPE, a Qwen-style template, JSON "
                     "tool calls): the path real instruct models take, without a download")
    lr: float = arg(3e-4, "M-GRPO learning rate, both agents (the paper: 1e-6 for 30B models)")
    lr_sub: float = arg(0.0, "the sub-agent's own learning rate; 0: --lr")
    weight_decay: float = arg(0.1, "AdamW weight decay; betas (0.9, 0.98) as in the paper")
    ppo_epochs: int = arg(1, "passes over each batch; with 1 the ratio is 1 and the clip never acts")
    micro_batch: int = arg(0, "sequences per forward/backward (the loss is still normalised over the batch); 0: all")
    eps_low: float = arg(0.2, "clip range below 1 (eq. 14-19)")
    eps_high: float = arg(0.28, "clip range above 1 ('clip-higher', as the authors ran it)")
    loss_agg: str = arg("seq-mean", "seq-mean: over each sequence's tokens, then over sequences; token-mean")
    grad_clip: float = arg(1.0, "max gradient norm per agent")
    kl_coef: float = arg(0.0, "weight of a k3 KL term to a frozen copy of each agent as RL starts (0, as the paper)")
    w_main_format: float = arg(0.1, "eq. 4: R_M = w r_format + (1 - w) r_correct if the format is valid, else 0")
    w_sub: tuple = arg((0.1, 0.4, 0.5), "eq. 5: weights of r_format, r_correct_main, r_expert in R_S")
    main_max_turns: int = arg(4, "main agent turns per rollout (delegations + the answer)")
    sub_max_turns: int = arg(3, "sub-agent turns per sub-task (tool calls + the answer)")
    max_new_tokens: int = arg(0, "tokens per turn (a turn not ended by then is invalid); 0: 8, chat models 256")
    sft_steps: int = arg(-1, "cold-start steps on noisy scripted demos (the stand-in for stage 1); -1: 600 for a "
                         "model built here, none for a model given by name or path")
    sft_levels: str = arg("", "task levels of the cold-start demos, taken in turn, e.g. '1,2'; empty: --level")
    sft_batch: int = arg(64, "demos per cold-start step, per agent")
    sft_lr: float = arg(1.5e-3, "cold-start learning rate")
    sft_until: float = arg(0.0, "after the cold start, greedy success of the system on 256 held-out questions per "
                           "--sft-levels level; below this on any level, --sft-steps more (at most 3 times); "
                           "0: no check")
    demo_noise: float = arg(0.1, "probability that a demo replaces an entity by a random one")
    eval_questions: int = arg(-1, "held-out questions per evaluation; -1: 256, or 32 for a given or chat model")
    eval_every: int = arg(50, "evaluate every N steps as well as before and after RL; 0: before and after only")
    search: str = arg("toy", "'toy' (the task's own tool, in-process) or the URL of a SearXNG-style JSON API")
    search_timeout: float = arg(10.0, "seconds per search request, all of it")
    search_retries: int = arg(2, "retries of a request that timed out, failed to connect or got a 5xx answer")
    visit_hosts: str = arg("", "hosts (comma-separated) whose pages the agents may visit beyond their own results")
    visit_max_chars: int = arg(2000, "chat models' visit tool: page text is cut to this many characters")
    device: str = arg("cpu", "torch device of this process's agents: cpu, cuda, cuda:1 (two GPUs: one per --role)")
    dtype: str = arg("float32", "float32, or bfloat16: matmuls in bf16 (autocast) over fp32 weights and AdamW")
    cuda_graphs: bool = arg(True, "on a GPU, decode with CUDA graphs over a static KV cache (else the eager loop)")
    grad_checkpointing: bool = arg(False, "recompute activations in the backward pass: less memory, slower")
    role: str = arg("both", "both: one process holds both agents; main / sub: one agent, the other role's process "
                    "reached through --store (decoupled training)")
    store: str = arg("", "shared store for --role main / sub: a directory both processes can reach")
    run_id: str = arg("run", "names this run's records inside the store")
    unsync: bool = arg(False, "the sub-agent trains on the previous step's data (the paper's off-policy version)")
    peer_timeout: float = arg(60.0, "seconds without a heartbeat from the other role before this one stops")
    progress_timeout: float = arg(0.0, "seconds a role waits for one record of its live peer; 0: no limit")
    out: str = arg("", "output folder; empty: runs/<time>-seed<seed>")
    resume: bool = arg(False, "continue from the last checkpoint in --out")
    save_every: int = arg(1, "checkpoint every N steps (and after each evaluation)")


# =========================================================================================
# 1. The system: two distinct LLMs, each with its own optimizer (the paper's vertical
#    multi-agent system: M plans and delegates, S runs a multi-turn tool loop per sub-task)
# =========================================================================================
def levels(text, default):
    """A level list such as --train-levels '1,2,2' (taken in turn); empty: [default]."""
    return [int(x) for x in (text or str(default)).split(",")]


@functools.lru_cache(maxsize=None)
def load_task(name):
    """The task (--task): an importable module's name, or the path of a .py file."""
    if not name.endswith(".py"):
        return importlib.import_module(name)
    spec = importlib.util.spec_from_file_location(os.path.basename(name)[:-3], name)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass
class Agent:  # each agent has its own model, tokenizer and optimizer: nothing is shared with the other
    model: torch.nn.Module
    tok: object
    opt: torch.optim.Optimizer = None
    stop_ids: tuple = ()   # token ids that end a turn
    suppress: tuple = ()   # never sampled: pad and unk would look like padding
    pad_id: int = 0        # the tokenizer's pad, else its eos (padding is found by length anyway)
    end: tuple = (0, 0)    # (id, length of its text) of the stop token that closes an assistant turn
    chat: bool = False     # a chat model: tools in the system prompt, <tool_call> JSON (else word-level tags)
    system: dict = None    # chat models: the task's system prompt per agent kind (main, sub, single)
    bf16: bool = False     # --dtype bfloat16: autocast over fp32 weights
    ref: torch.nn.Module = None  # --kl-coef: the frozen reference
    pending: tuple = None  # --unsync: (batch, advantages) of the previous step, not yet trained on
    graphs: dict = None    # --cuda-graphs on a GPU: (rows, cache slots) -> GraphDecoder
    splits: dict = field(default_factory=dict)  # render_ids: (template, key) -> (head, tail) or None

    def autocast(self, cache_enabled=True):  # a CUDA graph's capture needs cache_enabled=False
        return torch.autocast(self.model.device.type, dtype=torch.bfloat16, enabled=self.bf16,
                              cache_enabled=cache_enabled)


SIZES = {  # models built here: (hidden, layers, heads, kv heads, MLP)
    "0.1M": (64, 2, 8, 4, 192), "0.2M": (96, 2, 8, 4, 256), "1M": (128, 4, 4, 2, 512), "4M": (256, 4, 8, 4, 1024),
    "30M": (512, 8, 8, 4, 1536)}


def load_agent(name, args, seed):
    """A model by Hugging Face name or path, or (name empty) a tiny one built in code, with its
    tokenizer, its own AdamW, and what sampling needs to know of its tokens."""
    task = load_task(args.task)
    if name:
        tok = AutoTokenizer.from_pretrained(name)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32)  # fp32 master weights
    else:  # Llama, not Qwen2: a saved "qwen2" folder would load Qwen2's BPE over the word-level vocabulary
        tok = toy_tools.chat_tokenizer(task) if args.chat else toy_tools.word_tokenizer(task.WORDS)
        torch.manual_seed(seed)
        cfg = dict(zip(("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                        "intermediate_size"), SIZES[args.model_size]), vocab_size=len(tok), tie_word_embeddings=False,
                   pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
        model = (transformers.Qwen2ForCausalLM(transformers.Qwen2Config(max_position_embeddings=4096, **cfg))
                 if args.chat else transformers.LlamaForCausalLM(transformers.LlamaConfig(max_position_embeddings=256,
                                                                                         **cfg)))
    if not tok.chat_template:
        raise ValueError(f"{name}: the tokenizer has no chat template; the agents need one (an instruct model)")
    model.to(args.device).eval()  # eval: no dropout, so sampling and training log-probs agree
    eos = model.generation_config.eos_token_id
    stop = {tok.eos_token_id, *(eos if isinstance(eos, list) else [eos])} - {None}
    if args.grad_checkpointing:  # HF recomputes only in train mode, which must then change nothing else
        if any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()) or getattr(
                model.config, "attention_dropout", 0.0):
            raise ValueError(f"--grad-checkpointing trains in train mode, and {name or 'the model'} has dropout")
        if hasattr(model, "activation_checkpointing_enable"):  # the name from transformers 5.2x on
            model.activation_checkpointing_enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # which stop token closes an assistant turn in the template, and how much text it takes
    after, texts = template_text(tok, "user", "?"), {i: tok.decode([i]) for i in sorted(stop)}
    end = next(((i, m.end()) for i, t in texts.items() if t for m in [re.match(r"\s*" + re.escape(t), after)] if m),
               None)
    if end is None:
        raise ValueError(f"{name}: the chat template ends an assistant turn with {after[:30]!r}, which starts "
                         f"with none of the stop tokens {list(texts.values())}")
    chat = tok.chat_template != toy_tools.WORD_TEMPLATE
    return Agent(model, tok, torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98),
                                               weight_decay=args.weight_decay),
                 tuple(sorted(stop)), tuple(sorted({tok.pad_token_id, tok.unk_token_id} - stop - {None})),
                 tok.pad_token_id if tok.pad_token_id is not None else min(stop), end, chat,
                 task.SYSTEM if chat else None, args.dtype == "bfloat16",
                 graphs={} if args.cuda_graphs and model.device.type == "cuda" else None)


# Contexts grow by appending ids, never by re-rendering and re-tokenising the conversation, so the ids
# trained on are exactly the ids sampled. A message's ids are cut from a render in which an assistant
# turn precedes it: templates render a message alone with a default system prompt (Qwen2.5) or render
# the last assistant turn differently (Qwen3).
MARK = "@@MARK@@"


def template_text(tok, key, content, system=None, end=0):
    """The template's text for `key`: "prompt-<kind>", a new conversation (system prompt, tools, the
    user's `content`, the assistant prompt); or a role, the text after an assistant turn's content
    (less the `end` characters of its closing token): that role's message and the next assistant prompt."""
    if key.startswith("prompt-"):
        kind, msgs, kw = key[7:], [{"role": "user", "content": content}], {}
        if system:
            tools = [toy_tools.TOOLS[n] for n in toy_tools.CHAT_TOOLS[kind]]
            if "tools" in tok.chat_template:
                kw["tools"] = tools
            else:  # a template that cannot list tools: they go into the system prompt as JSON
                system = {**system, kind: system[kind] + "\nTools:\n" + "\n".join(json.dumps(t) for t in tools)}
            msgs.insert(0, {"role": "system", "content": system[kind]})
        return tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, **kw)
    text = tok.apply_chat_template([{"role": "user", "content": "?"}, {"role": "assistant", "content": MARK},
                                    {"role": key, "content": content}], add_generation_prompt=True, tokenize=False)
    return text[text.index(MARK) + len(MARK) + end:]


def render_ids(agent, key, content):
    """Token ids of template_text(key, content). A template that pastes the content in unchanged is
    rendered once per key, as head + content + tail (checked on two probes); one that transforms it
    (trims it, say) is rendered for every call. kind: main, sub or single; role: tool, user."""
    content = content.encode("utf-8", "replace").decode("utf-8")  # no lone surrogate reaches a tokenizer
    render = functools.partial(template_text, agent.tok, key, system=agent.system, end=agent.end[1])
    if (agent.tok.chat_template, key) not in agent.splits:
        a, b = "\x01A\x01", " \n\x02B \x02\n "
        ra, rb = render(a), render(b)
        head, _, tail = ra.partition(a)
        agent.splits[agent.tok.chat_template, key] = (head, tail) if a in ra and rb == head + b + tail else None
    split = agent.splits[agent.tok.chat_template, key]
    return agent.tok(split[0] + content + split[1] if split else render(content), add_special_tokens=False).input_ids


def message_ids(agent, role, content):
    """Ids of one message (a tool result) and the next assistant prompt, to append after an assistant
    turn, which ends with the stop token the model sampled (`agent.end`)."""
    return render_ids(agent, role, content)


def prompt_ids(agent, kind, content):
    """Ids of a new conversation of agent `kind` (main, sub, single) whose user message is `content`."""
    return render_ids(agent, "prompt-" + kind, content)


@dataclass
class Traj:
    """One agent's trajectory: the exact token ids, which of them its policy sampled (mask 1),
    and the sampling log-prob of each sampled token (0 elsewhere)."""
    ids: list
    mask: list
    logp: list
    q: int = 0               # question index in the step
    k: int = 0               # rollout index within the question
    task: str = ""           # sub-agent: the sub-task it was given
    result: str = None       # main: the answer; sub: the returned text
    ok: bool = False         # format valid (r_format)
    calls: list = field(default_factory=list)  # main: indices of its sub-trajectories

    def add(self, ids, logp=None):
        self.ids += ids
        self.mask += [0 if logp is None else 1] * len(ids)
        self.logp += [0.0] * len(ids) if logp is None else logp


def new_traj(agent, kind, content, **kw):
    ids = prompt_ids(agent, kind, content)
    return Traj(ids, [0] * len(ids), [0.0] * len(ids), **kw)


# =========================================================================================
# 2. Rollout: M's turns, with S's multi-turn tool loops nested in them, all in lockstep
# =========================================================================================
def max_new(agent, args):
    return args.max_new_tokens or (256 if agent.chat else 8)


def sample_token(logits, suppress, generator, greedy=False):
    """Draw one token per row from the raw logits [B, V]: (tokens, their log-probs).

    The log-prob kept is the token's under the raw distribution, log_softmax(logits) in fp32:
    the policy that `token_logprobs` recomputes in training. Suppressed ids (pad, unk: they would
    look like padding) are removed before the draw, which is at temperature 1 (the argmax when
    greedy); no top-k, top-p or repetition penalty.
    """
    logp = logits.float().log_softmax(-1)
    allowed = logp.index_fill(-1, suppress, -math.inf) if len(suppress) else logp
    tok = allowed.argmax(-1) if greedy else torch.multinomial(allowed.exp(), 1, generator=generator)[:, 0]
    return tok, logp.gather(-1, tok[:, None])[:, 0]


@functools.lru_cache(maxsize=None)
def cache_keyword(model_class):
    """The forward's name for the KV cache: past_key_values, renamed cache in transformers 5.2x."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def forward_last(model, ids, attn, pos, cache):
    """Logits of the last position; the KV cache grows (or fills) by the new positions."""
    return model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, logits_to_keep=1,
                 **{cache_keyword(type(model)): cache}).logits[:, -1]


@torch.no_grad()
def generate(agent, contexts, max_new_tokens, seed, greedy=False):
    """Sample one turn for a batch of contexts: per context (new ids, their log-probs, ended?).

    The left-padded contexts go through the model once (prefill, into a KV cache, keeping the
    last position's logits); then one token per forward. Each token is drawn by `sample_token`
    with a torch.Generator seeded from `seed`, so a call does not depend on what ran before. A
    row ends at its first stop token and leaves the batch (its rows of the cache go too).
    Nothing in the model's `generation_config` (temperature, top_k, top_p, repetition penalty)
    is read: what is sampled is exactly the policy that training scores. With `agent.graphs`
    (--cuda-graphs on a GPU) the steps replay a CUDA graph over a static cache instead
    (`GraphDecoder`), and finished rows stay in the batch, masked.
    """
    model, dev = agent.model, agent.model.device
    B, L = len(contexts), max(map(len, contexts))
    static = agent.graphs is not None
    R = 1 << (B - 1).bit_length() if static else B          # a graph's rows: a power of two
    ids = torch.full((R, L), agent.pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for b, c in enumerate(contexts + [contexts[0]] * (R - B)):  # padding rows repeat the first
        ids[b, L - len(c):], attn[b, L - len(c):] = torch.tensor(c, dtype=torch.long), 1
    ids, attn = ids.to(dev), attn.to(dev)
    gen = torch.Generator(dev).manual_seed(seed)
    suppress = torch.tensor(agent.suppress, dtype=torch.long, device=dev)
    stop_ids = torch.tensor(agent.stop_ids, dtype=torch.long, device=dev)
    new = torch.full((R, max_new_tokens), agent.pad_id, dtype=torch.long, device=dev)
    new_lp = torch.zeros(R, max_new_tokens, device=dev)
    length = torch.full((R,), max_new_tokens, device=dev)     # a row's turn ends at its first stop token
    running = torch.ones(R, dtype=torch.bool, device=dev)
    rows, next_pos = torch.arange(R, device=dev), attn.sum(-1, keepdim=True)  # rows sampling; their next position
    pos = (attn.cumsum(-1) - 1).clamp(min=0)                   # prefill: positions count real tokens only
    try:
        if static:
            T = -(-(L + max_new_tokens) // 256) * 256
            if (R, T) not in agent.graphs:
                agent.graphs.clear()  # one shape at a time: a static cache can be large
                agent.graphs[R, T] = GraphDecoder(agent, R, T, forward_last)
            decoder = agent.graphs[R, T]
            logits = decoder.prefill(ids, attn, pos)
        else:
            cache = transformers.DynamicCache(config=model.config)
            with agent.autocast():
                logits = forward_last(model, ids, attn, pos, cache)
        for t in range(max_new_tokens):
            tok, lp = sample_token(logits, suppress, gen, greedy)
            new[rows, t], new_lp[rows, t] = tok, lp
            done = torch.isin(tok, stop_ids) & running[rows]
            length[rows[done]] = t + 1
            running[rows[done]] = False
            if t == max_new_tokens - 1 or not running[:B].any():
                break
            if static:
                logits = decoder.step(tok, next_pos + t, L + t)
                continue
            if done.any():  # finished rows leave the batch
                keep = (~done).nonzero()[:, 0]
                cache.batch_select_indices(keep)
                rows, tok, attn, next_pos = rows[keep], tok[keep], attn[keep], next_pos[keep]
            attn = torch.cat([attn, attn.new_ones(len(rows), 1)], 1)
            with agent.autocast():
                logits = forward_last(model, tok[:, None], attn, next_pos + t, cache)
    except RuntimeError as e:
        if not static:
            raise
        print(f"CUDA graphs off for this agent ({e}); decoding eagerly", flush=True)
        agent.graphs = None
        return generate(agent, contexts, max_new_tokens, seed, greedy)
    out = []
    for row, lp, n in zip(new[:B].tolist(), new_lp[:B].tolist(), length[:B].long().tolist()):
        out.append((row[:n], lp[:n], row[n - 1] in agent.stop_ids))
    return out


FINAL = {"main": "answer", "sub": "return", "single": "answer"}  # the tag that ends a conversation


def turn_action(agent, new, ended, kind):
    """Parse one turn's output: (tag, argument), or None for invalid format."""
    if not ended:  # overlong: never closed its turn
        return None
    text = agent.tok.decode(new[:-1], skip_special_tokens=False)
    if agent.chat:
        return toy_tools.parse_chat_action(text, kind)
    return toy_tools.parse_action(text, toy_tools.TAGS[kind])


def agent_loop(agent, kind, trajs, act, max_turns, args, seed, greedy):
    """One loop for M, S and the single agent: every conversation of the batch, turn by turn in
    lockstep, one generate call per turn for those still going. A turn with the final tag ends
    its conversation with a result (ok); one that breaks the format, or calls a tool on the
    last turn, ends it with none. Every other turn is a tool call: act(calls, turn) answers the
    turn's calls [(index, tag, argument)] with one message each, which enters with mask 0."""
    active = list(range(len(trajs)))
    for turn in range(max_turns):
        if not active:
            break
        outs = generate(agent, [trajs[j].ids for j in active], max_new(agent, args),
                        toy_tools.stable_seed(seed, kind, turn), greedy)
        calls = []
        for j, (new, logp, ended) in zip(active, outs):
            trajs[j].add(new, logp)
            action = turn_action(agent, new, ended, kind)
            if action and action[0] == FINAL[kind]:
                trajs[j].result, trajs[j].ok = action[1], True
            elif action and turn < max_turns - 1:
                calls.append((j, *action))
        for (j, _, _), message in zip(calls, act(calls, turn) if calls else []):
            trajs[j].add(message_ids(agent, "tool", message))
        active = [j for j, _, _ in calls]
    return trajs


def tool_calls(search, questions, args, chat):
    """act for S and the single agent: each call searches or (chat models) visits a page; a
    visit may only go to a URL among the conversation's own search results. A tool that fails
    on its argument (model output) answers with the error, and the run goes on."""
    seen = [set() for _ in questions]

    def act(calls, turn):
        messages = []
        for j, tag, arg in calls:
            q = questions[j]
            try:
                if tag == "visit":
                    messages.append(search.visit(arg, args.visit_max_chars, allowed=seen[j]))
                    continue
                results = search.search(arg, q.seed, q.level)
                seen[j].update(r["url"] for r in results)
                messages.append(toy_tools.search_observation(results, chat))
            except toy_tools.SearchError as e:
                messages.append(f"error: {e}")
            except Exception as e:  # noqa: BLE001  (a bug in a tool, shown, but no reason to stop a long run)
                print(f"warning: the {tag} tool raised {type(e).__name__}: {e}", flush=True)
                messages.append(f"error: {type(e).__name__}")
        return messages
    return act


def run_sub_agents(sub, args, search, tasks, questions, seed, greedy=False):
    """S's tool loops for a batch of sub-tasks, one per delegation; each returns one answer."""
    trajs = [new_traj(sub, "sub", t, task=t) for t in tasks]
    return agent_loop(sub, "sub", trajs, tool_calls(search, questions, args, sub.chat), args.sub_max_turns, args,
                      seed, greedy)


def rollout(main, questions, K, args, seed, delegate=None, search=None, greedy=False):
    """K rollouts per question: (M's trajectories, S's trajectories). The delegations of a turn
    go to S together, through delegate(tasks, questions, seed, greedy): S in this process
    (`run_sub_agents`) or in the other role's (`RemoteSub`). --mode single-agent: one model with
    S's tools instead, and no S (the paper's single-agent baseline)."""
    questions = [q for q in questions for _ in range(K)]
    kind = "single" if args.mode == "single-agent" else "main"
    trajs = [new_traj(main, kind, q.text, q=i // K, k=i % K) for i, q in enumerate(questions)]
    if kind == "single":
        act = tool_calls(search, questions, args, main.chat)
        return agent_loop(main, kind, trajs, act, args.main_max_turns, args, seed, greedy), []
    sub_trajs = []

    def call_sub_agent(calls, turn):
        done = delegate([arg for _, _, arg in calls], [questions[j] for j, _, _ in calls],
                        toy_tools.stable_seed(seed, "turn", turn), greedy)
        for (j, _, _), s in zip(calls, done):
            s.q, s.k = trajs[j].q, trajs[j].k
            trajs[j].calls.append(len(sub_trajs))
            sub_trajs.append(s)
        return [s.result if s.ok else "none" for s in done]  # S's answer enters M's context with mask 0
    return agent_loop(main, kind, trajs, call_sub_agent, args.main_max_turns, args, seed, greedy), sub_trajs


# =========================================================================================
# 3. Rewards (eq. 4-5)
# =========================================================================================
def main_reward(format_ok, correct, w_format=0.1):
    """eq. 4: R_M = 0.1 r_format + 0.9 r_correct if M's format is valid, else 0."""
    return w_format + (1 - w_format) * float(correct) if format_ok else 0.0


def sub_reward(format_ok, main_correct, expert, w=(0.1, 0.4, 0.5)):
    """eq. 5: R_S = 0.1 r_format + 0.4 r_correct_main + 0.5 r_expert if S's format is valid, else 0;
    r_correct_main is the correctness of the rollout this sub-trajectory came from."""
    return w[0] + w[1] * float(main_correct) + w[2] * float(expert) if format_ok else 0.0


# =========================================================================================
# 4. Group-relative advantages, per agent (eq. 9-10 for M, eq. 12-13 for S)
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
# 5. Trajectory alignment (eq. 11): exactly D sub-trajectories per rollout
# =========================================================================================
def align_sub_trajectories(counts, D, rng):
    """counts[k] = d_k, the sub-trajectories of rollout k of one query. Returns D*K pairs (k', i):
    slot j belongs to rollout j // D and holds sub-trajectory i of rollout k'.

    d_k >= D: D distinct ones of its own, chosen uniformly (drop d_k - D).
    0 < d_k < D: all its own, plus D - d_k duplicates chosen uniformly from its own.
    d_k = 0 (the paper is silent): D drawn uniformly, with replacement, from the siblings'.
    No rollout of the query delegated: [] (nothing for S to learn from this query).
    """
    pool = [(k, i) for k, d in enumerate(counts) for i in range(d)]
    if not pool:
        return []
    out = []
    for k, d in enumerate(counts):
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
# 6. The objectives (eq. 14-19): one clipped surrogate per agent, no gradient between them
# =========================================================================================
def token_logprobs(model, ids, attn):
    """logp[b, t] = log p(ids[b, t] | ids[b, :t]), and 0 at padding and at each row's first
    token (nothing predicts it). Any padding side: position ids come from the attention mask,
    so a padded row is scored as if it were unpadded; logits at t-1 predict the token at t."""
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False).logits
    lp = logits[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
    lp = lp * (attn[:, 1:] * attn[:, :-1])
    return torch.cat([torch.zeros_like(lp[:, :1]), lp], 1)


def policy_loss(logp, old_logp, advantages, mask, eps_low=0.2, eps_high=0.28, agg="seq-mean",
                ref_logp=None, kl_coef=0.0):
    """The negated clipped surrogate of one agent, eq. 14-19. Returns (loss, stats).

    M's objective (over its K rollouts per query) and S's (over its D*K aligned sub-trajectories)
    differ only in the batch, so this one function computes each (eq. 14, eq. 15, eq. 16, eq.
    17, eq. 18, eq. 19). logp, old_logp, mask: [B, T]; advantages: [B], broadcast to each row's
    tokens. Token-level ratio exp(logp - old_logp), clipped to [1 - eps_low, 1 + eps_high], as
    the authors ran it (the paper writes a sequence-level ratio). Only mask-1 tokens count.
    agg="seq-mean": mean over each row's tokens, then over rows (a row without tokens counts
    0); "token-mean": over all tokens of the batch. ref_logp, kl_coef: an optional penalty
    kl_coef * k3 per token to a frozen reference, k3 = exp(ref - logp) - (ref - logp) - 1.
    """
    m = mask.to(logp.dtype)
    log_ratio = torch.where(mask.bool(), logp - old_logp, torch.zeros_like(logp))
    ratio = log_ratio.exp()
    a = advantages.to(logp.dtype)[:, None]
    surr = torch.minimum(ratio * a, ratio.clamp(1 - eps_low, 1 + eps_high) * a)  # min(rho A, clip(rho) A)
    per_tok = -surr * m
    if ref_logp is not None and kl_coef:
        d = torch.where(mask.bool(), ref_logp - logp, torch.zeros_like(logp))
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


def collate(trajs, pad_id, device):
    """Right-padded tensors; the attention mask comes from lengths, never from token ids."""
    B, T = len(trajs), max(len(t.ids) for t in trajs)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    attn, mask, old = torch.zeros_like(ids), torch.zeros_like(ids), torch.zeros(B, T)
    for b, t in enumerate(trajs):
        n = len(t.ids)
        ids[b, :n], attn[b, :n] = torch.tensor(t.ids), 1
        mask[b, :n], old[b, :n] = torch.tensor(t.mask), torch.tensor(t.logp)
    return ids.to(device), attn.to(device), mask.to(device), old.to(device)


def update_agent(agent, trajs, adv, args):
    """One agent's policy step(s) on its own batch; returns stats with the time split.
    Micro-batches weight their loss so that the sum is the whole batch's loss (normalised over
    the whole batch, not per micro-batch)."""
    model, dev = agent.model, agent.model.device
    ids, attn, mask, old = collate(trajs, agent.pad_id, dev)
    adv = adv.to(dev)
    B, mb = len(trajs), args.micro_batch or len(trajs)
    n_tok = mask.sum().clamp(min=1)
    ref = None
    if agent.ref is not None:  # --kl-coef: the frozen reference's log-probs, once per batch
        with torch.no_grad(), agent.autocast():
            ref = torch.cat([token_logprobs(agent.ref, ids[s:s + mb], attn[s:s + mb]) for s in range(0, B, mb)])
    acc = {"clip_frac": 0.0, "approx_kl": 0.0, "kl_ref": 0.0, "t_fwd": 0.0, "t_bwd": 0.0}
    model.train(args.grad_checkpointing)  # recomputation needs train mode (no dropout: checked at load)
    for _ in range(args.ppo_epochs):
        agent.opt.zero_grad(set_to_none=True)
        for s in range(0, B, mb):
            t0 = time.perf_counter()
            sl = slice(s, s + mb)
            with agent.autocast():
                logp = token_logprobs(model, ids[sl], attn[sl])
            loss, stats = policy_loss(logp, old[sl], adv[sl], mask[sl], args.eps_low, args.eps_high,
                                      args.loss_agg, None if ref is None else ref[sl], args.kl_coef)
            w = (min(mb, B - s) / B) if args.loss_agg == "seq-mean" else mask[sl].sum() / n_tok
            if not torch.isfinite(loss):
                raise FloatingPointError(f"non-finite loss {loss.item()} in the policy update; stopping")
            t1 = time.perf_counter()
            (loss * w).backward()
            acc["t_fwd"] += t1 - t0
            acc["t_bwd"] += time.perf_counter() - t1
            for key in ("clip_frac", "approx_kl", "kl_ref"):
                acc[key] += stats.get(key, 0.0) * stats["tokens"] / float(n_tok) / args.ppo_epochs
        t1 = time.perf_counter()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        if not torch.isfinite(grad_norm):
            raise FloatingPointError(f"non-finite gradient norm {grad_norm.item()}; stopping")
        agent.opt.step()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)  # so that the time split is the GPU's, not the launch queue's
        acc["t_bwd"] += time.perf_counter() - t1
    model.eval()
    return {**acc, "grad_norm": float(grad_norm), "tokens": float(n_tok) * args.ppo_epochs,
            "tokens_in": float(attn.sum()) * args.ppo_epochs,  # every token through the model (for MFU)
            "sequences": B * args.ppo_epochs}


# =========================================================================================
# 7. One M-GRPO step. M's side and S's side share only `exchange`, a list of plain dicts, so
#    that they can run in two processes around the file store (section 9)
# =========================================================================================
def main_side(main_trajs, questions, K, args):
    """M: rewards (eq. 4), advantages over the K rollouts of each query (eq. 9-10), and the few
    statistics S needs: per rollout its ids, M's correctness and its sub-trajectories."""
    task = load_task(args.task)
    correct = [t.ok and task.answer_correct(questions[t.q], t.result) for t in main_trajs]
    r_main = torch.tensor([main_reward(t.ok, c, args.w_main_format) for t, c in zip(main_trajs, correct)])
    adv = group_advantages(r_main.view(-1, K)).view(-1)
    exchange = [{"query": t.q, "rollout": t.k, "correct": bool(c), "subs": list(t.calls)}
                for t, c in zip(main_trajs, correct)]
    zero_var = float((r_main.view(-1, K).std(-1, unbiased=False) <= 1e-6).float().mean())
    return r_main, adv, exchange, {"success": float(np.mean(correct)), "zero_var_main": zero_var}


def sub_side(sub_trajs, exchange, questions, K, args, rng):
    """S: rewards (eq. 5), alignment to D per rollout (eq. 11), advantages over the D*K aligned
    sub-trajectories of each query (eq. 12-13). Returns (batch, R_S, A_S, stats)."""
    task, D = load_task(args.task), args.max_sub
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
        group = [sub_trajs[rows[k]["subs"][i]] for k, i in pairs]
        r = [sub_reward(s.ok, rows[k]["correct"], task.expert_score(questions[q], s.task, s.result), args.w_sub)
             for s, (k, _) in zip(group, pairs)]  # each slot: the correctness of the rollout that made it
        batch += group
        rewards += r
        adv.append(group_advantages(r))
        n_groups += 1
        n_zero += int(np.std(r) <= 1e-6)
    stats = {"n_dup": n_dup, "n_drop": n_drop, "zero_var_sub": n_zero / max(1, n_groups)}
    return batch, torch.tensor(rewards), (torch.cat(adv) if adv else torch.zeros(0)), stats


def sub_step(sub, sub_trajs, exchange, questions, step, args):
    """S's side of a step: R_S, alignment, A_S and S's update. With --unsync S updates on the
    previous step's batch (kept in `sub.pending`): its rollouts run one update behind."""
    rng = random.Random(toy_tools.stable_seed(args.seed, "align", step))
    batch, r_sub, adv, stats = sub_side(sub_trajs, exchange, questions, args.group_size, args, rng)
    if args.unsync:
        (batch, adv), sub.pending = sub.pending or ([], None), (batch, adv)
    if args.mode == "main-only":
        batch = []  # S frozen (the paper's baseline): its rewards are still computed, to be logged
    update = update_agent(sub, batch, adv, args) if batch else {}
    return {"sub_reward": float(r_sub.mean()) if len(r_sub) else 0.0, **stats, **{
        f"{k}_sub": update[k] for k in ("clip_frac", "approx_kl", "kl_ref", "grad_norm", "tokens_in", "sequences")
        if k in update}, "t_train_sub": update.get("t_fwd", 0.0) + update.get("t_bwd", 0.0)}, update


def train_step(main, sub, step, args, delegate, search=None, store=None, phase=""):
    """Rollouts, M's side, and (when S lives in this process) S's side; the step's metrics. In
    single-agent mode M's side is all there is: plain GRPO. With S in the other process, M
    writes `exchange` to the store before its own update, so that both updates run at once."""
    t0 = time.perf_counter()
    rng = random.Random(toy_tools.stable_seed(args.seed, "questions", step))
    mix, Q = levels(args.train_levels, args.level), args.questions_per_step  # in turn, across steps too
    questions = [load_task(args.task).make_question(rng.randrange(2 ** 31), mix[(step * Q + i) % len(mix)])
                 for i in range(Q)]
    K = args.group_size
    main_trajs, sub_trajs = rollout(main, questions, K, args, toy_tools.stable_seed(args.seed, "rollout", step),
                                    delegate, search)
    t_gen = time.perf_counter() - t0
    r_main, adv_main, exchange, main_stats = main_side(main_trajs, questions, K, args)
    if store:
        store.put(f"{phase}-done", {"exchange": exchange, "questions": [[q.seed, q.level] for q in questions]})
    updates = [update_agent(main, main_trajs, adv_main, args)]
    rec = {"step": step, "main_reward": float(r_main.mean()), **main_stats,
           "d_k": [len(t.calls) for t in main_trajs], "sub_calls": len(sub_trajs),
           "t_train_main": updates[0]["t_fwd"] + updates[0]["t_bwd"],
           **{f"{k}_main": updates[0][k] for k in ("clip_frac", "approx_kl", "kl_ref", "grad_norm", "tokens_in",
                                                    "sequences")}}
    if sub:
        sub_record, update = sub_step(sub, sub_trajs, exchange, questions, step, args)
        rec.update(sub_record)
        updates.append(update)
    dt, gen_tokens = time.perf_counter() - t0, sum(sum(t.mask) for t in main_trajs + sub_trajs)
    rec.update({k: sum(u.get(k, 0.0) for u in updates) for k in ("t_fwd", "t_bwd")}, t_gen=t_gen, t_step=dt,
               gen_tokens=gen_tokens, gen_tokens_per_s=gen_tokens / t_gen,
               train_tokens_per_s=sum(u.get("tokens", 0.0) for u in updates) / (dt - t_gen))
    return rec


# =========================================================================================
# 8. Training: the schedule of evaluations and steps, walked by one process or by both roles
# =========================================================================================
EVAL_SEED = 2 ** 40  # question seeds at or above this are never used for training


def schedule(args):
    """The phases both roles walk through in the same order: (kind, step, greedy)."""
    phases = [("eval", 0, False), ("eval", 0, True)]
    for s in range(1, args.steps + 1):
        phases.append(("step", s, False))
        if args.eval_every and s % args.eval_every == 0 and s < args.steps:
            phases.append(("eval", s, False))
    return phases + ([("eval", args.steps, False), ("eval", args.steps, True)] if args.steps else [])


def evaluate(main, args, delegate, search, greedy=False, first=EVAL_SEED):
    """Success on the held-out questions, sampled (temperature 1, as in training) or greedy."""
    task = load_task(args.task)
    questions = [task.make_question(first + i, args.level) for i in range(args.eval_questions)]
    correct = []
    for s in range(0, len(questions), 256):
        batch = questions[s:s + 256]
        trajs, _ = rollout(main, batch, 1, args, toy_tools.stable_seed("eval", s), delegate, search, greedy)
        correct += [t.ok and task.answer_correct(q, t.result) for t, q in zip(trajs, batch)]
    return float(np.mean(correct))


def train(args, agents, out, store, search, start, n_lines):
    """Walk the schedule from position `start`: evaluations and M-GRPO steps (the sub role
    answers S's part of each phase through the store), each phase's metrics line, checkpoints."""
    plan = schedule(args)
    metrics = open(os.path.join(out, "metrics.jsonl"), "a")

    def finish_phase(idx, rec):
        nonlocal n_lines
        if rec is not None:
            metrics.write(json.dumps(rec) + "\n")
            metrics.flush()
            n_lines += 1
            print(progress_line(rec, args.steps), flush=True)
        kind, step, _ = plan[idx]
        if kind == "eval" or step % args.save_every == 0 or idx == len(plan) - 1:
            save_checkpoint(out, agents, idx + 1, n_lines)
            if store:
                store.saved = idx + 1
                peer_saved = store.check_peer().get("saved")
                if args.role == "main" and type(peer_saved) is int:
                    store.prune(min(idx + 1, peer_saved))

    try:
        if args.role == "sub":
            return serve_sub(agents["sub"], store, args, search, start, finish_phase)
        main, sub = agents["main"], agents.get("sub")
        for idx, (kind, step, greedy) in enumerate(plan[start:], start):
            phase = f"p{idx:06d}"
            delegate = RemoteSub(store, phase) if store else functools.partial(run_sub_agents, sub, args, search)
            io0 = store.io_time if store else 0.0
            if store:
                store.phase = idx
            if kind == "eval":
                rec = {"step": step, "eval": "greedy" if greedy else "sampled",
                       "eval_success": evaluate(main, args, delegate, search, greedy)}
                if store:
                    store.put(f"{phase}-done", {})
            else:
                rec = train_step(main, sub, step, args, delegate, search, store, phase)
            if store:
                rec["t_store"] = store.io_time - io0
            finish_phase(idx, rec)
    finally:
        metrics.close()


# =========================================================================================
# 9. Decoupled training (the paper's Fig. 3): two processes, one directory of small records
#    (infra/store.py: FileStore, the file layer under it: atomic writes, locks, heartbeats)
# =========================================================================================
# What crosses the store besides the run's settings and the heartbeats: per main turn, the sub-tasks one
# way and S's answers the other; after the rollouts, `exchange` (section 7). The checks below hold for
# what the peer writes; a store is untrusted input, so anything else is an error that names the record.
def questions_ok(pairs):
    return all(type(seed) is int and type(level) is int for seed, level in pairs)


def tasks_ok(rec):
    return (all(type(t) is str for t in rec["tasks"]) and len(rec["tasks"]) == len(rec["questions"])
            and questions_ok(rec["questions"]) and type(rec["seed"]) is int and type(rec["greedy"]) is bool)


def results_ok(rec, n_tasks):
    return len(rec["results"]) == n_tasks and all((a is None or type(a) is str) and type(ok) is bool
                                                  for a, ok in rec["results"])


def exchange_ok(rec, n_subs):
    return questions_ok(rec["questions"]) and all(
        0 <= e["query"] < len(rec["questions"]) and type(e["rollout"]) is int and type(e["correct"]) is bool
        and all(type(i) is int and 0 <= i < n_subs for i in e["subs"]) for e in rec["exchange"])


def store_record(store, key, rec, check, args=None):
    """rec if check(rec) holds (and, given args, the questions it names exist); else a StoreError."""
    try:
        if check(rec):
            return rec, args and [load_task(args.task).make_question(s, level) for s, level in rec["questions"]]
    except (KeyError, TypeError, ValueError, IndexError):
        pass
    raise StoreError(f"store {store.dir}: record {key} is not what the {store.peer} role writes; start both roles "
                     f"on an empty store (or another --run-id)")


class RemoteSub:
    """S in the other process, as M's side sees it: each turn's sub-tasks go into the store, S's answers
    come back (S keeps its own token ids and log-probs)."""

    def __init__(self, store, phase):
        self.store, self.phase, self.turns = store, phase, itertools.count()

    def __call__(self, tasks, questions, seed, greedy):
        key = f"{self.phase}-t{next(self.turns)}"
        self.store.put(key + "-tasks", {"tasks": tasks, "questions": [[q.seed, q.level] for q in questions],
                                        "seed": seed, "greedy": greedy})
        key, rec = self.store.wait(key + "-results")
        rec, _ = store_record(self.store, key, rec, functools.partial(results_ok, n_tasks=len(tasks)))
        if rec["tasks"] != tasks:  # a replay after a crash that did not sample the same tasks
            raise StoreError(f"store record {key} answers other sub-tasks than this run asked; restart both roles "
                             f"with --resume")
        return [Traj([], [], [], task=t, result=a, ok=ok) for t, (a, ok) in zip(tasks, rec["results"])]


def serve_sub(sub, store, args, search, start, finish_phase):
    """The sub role: answer every turn of every phase from schedule position `start` on, and take S's
    side of each training step when M's side has written its statistics."""
    for idx, (kind, step, greedy) in enumerate(schedule(args)[start:], start):
        store.phase, phase, sub_trajs, t_gen = idx, f"p{idx:06d}", [], 0.0
        t0, io0 = time.perf_counter(), store.io_time
        for turn in itertools.count():
            key, rec = store.wait(f"{phase}-t{turn}-tasks", f"{phase}-done")
            if key.endswith("-done"):
                break
            rec, questions = store_record(store, key, rec, tasks_ok, args)
            t1 = time.perf_counter()
            trajs = run_sub_agents(sub, args, search, rec["tasks"], questions, rec["seed"], rec["greedy"])
            t_gen += time.perf_counter() - t1
            sub_trajs += trajs
            store.put(f"{phase}-t{turn}-results", {"tasks": rec["tasks"], "results": [[s.result, s.ok] for s in trajs]})
        out = None
        if kind == "step":
            rec, questions = store_record(store, key, rec, functools.partial(exchange_ok, n_subs=len(sub_trajs)),
                                          args)
            sub_record, _ = sub_step(sub, sub_trajs, rec["exchange"], questions, step, args)
            out = {"step": step, **sub_record, "t_step": time.perf_counter() - t0, "t_store": store.io_time - io0,
                   "t_gen_sub": t_gen, "gen_tokens_sub": sum(sum(s.mask) for s in sub_trajs)}
        finish_phase(idx, out)


# =========================================================================================
# Appendix: the run. The cold start, the command line, the set-up and the report (checkpoints,
# CUDA graphs, the memory estimate, progress lines and plots are in infra/runtime.py)
# =========================================================================================
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


def cold_start(agent, kind, args, seed, steps=None):
    """The stand-in for stage 1 (not M-GRPO): cross-entropy on the mask-1 tokens of fresh noisy demos,
    `steps` steps (default --sft-steps; -1: 600), the loss and the time left printed now and then. A
    non-finite loss stops the run before any checkpoint holds the broken weights."""
    steps, task = (steps if steps is not None else args.sft_steps if args.sft_steps >= 0 else 600), load_task(args.task)
    opt = torch.optim.AdamW(agent.model.parameters(), lr=args.sft_lr, betas=(0.9, 0.98), weight_decay=0.0)
    cosine = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.5 * (1 + math.cos(math.pi * i / steps)))
    rng, mix = random.Random(seed), levels(args.sft_levels, args.level)
    t0, loss = time.time(), torch.tensor(0.0)
    for i in range(steps):
        demos = [task.demo(task.make_question(rng.randrange(2 ** 31), mix[j % len(mix)]), rng, args.demo_noise,
                           kind, agent.chat) for j in range(args.sft_batch)]
        ids, attn, mask, _ = collate([encode_demo(agent, d, kind) for d in demos], agent.pad_id, agent.model.device)
        agent.model.train(args.grad_checkpointing)
        with agent.autocast():
            loss = -(token_logprobs(agent.model, ids, attn) * mask).sum() / mask.sum()
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite loss {loss.item()} in the cold start of {kind}, step {i + 1}")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(agent.model.parameters(), args.grad_clip)
        opt.step()
        cosine.step()
        if (i + 1) % max(1, steps // 4) == 0 and i + 1 < steps:
            print(f"  cold start {kind}: step {i + 1}/{steps}, loss {loss.item():.3f}, about "
                  f"{(time.time() - t0) / (i + 1) * (steps - i - 1):.0f}s left", flush=True)
    agent.model.eval()
    return loss.item()


def cold_start_steps(args, models):
    """Cold-start steps per agent, {name: model name or path ('' for one built here)}: --sft-steps, or
    with -1, 600 for a model built here and none for one given, which has learned its format already."""
    return {n: args.sft_steps if args.sft_steps >= 0 else 0 if path else 600 for n, path in models.items()}


def cold_start_job(path, kind, args, seed, steps, parent):
    """A cold start in a process of its own: the agent saved at `path`, trained with one thread, saved
    back; it ends when the process `parent` does."""
    exit_with_parent(parent)
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    agent = load_agent(path, args, seed=0)
    loss = cold_start(agent, kind, args, seed, steps)
    agent.model.save_pretrained(path)
    return loss


def cold_start_all(agents, kinds, steps, args, more=0):
    """Every agent's cold start ({name: steps}); their final losses. On a CPU with cores to spare they
    run at once, each in a process of its own (a tiny model uses a second thread poorly, and the agents
    share nothing); short ones do not pay for a process start. more > 0: the more-th continuation,
    on demos of its own."""
    jobs = {n: s for n, s in steps.items() if s}
    seeds = {n: toy_tools.stable_seed(args.seed, "sft-" + n, *[more] * (more > 0)) for n in steps}
    if len(jobs) < 2 or args.device != "cpu" or (os.cpu_count() or 1) < 2 or min(jobs.values()) < 100:
        return {n: cold_start(agents[n], kinds[n], args, seeds[n], s) for n, s in jobs.items()}
    with tempfile.TemporaryDirectory() as tmp, ProcessPoolExecutor(len(jobs), multiprocessing.get_context("spawn")) \
            as pool:
        for n in jobs:
            agents[n].model.save_pretrained(os.path.join(tmp, n))
            agents[n].tok.save_pretrained(os.path.join(tmp, n))
        futures = {n: pool.submit(cold_start_job, os.path.join(tmp, n), kinds[n], args, seeds[n], s, os.getpid())
                   for n, s in jobs.items()}
        losses = {n: f.result() for n, f in futures.items()}
        for n in jobs:
            agents[n].model.load_state_dict(AutoModelForCausalLM.from_pretrained(os.path.join(tmp, n)).state_dict())
    return losses


def cold_start_checked(agents, kinds, steps, args, search, out, done=0):
    """The cold start, then (--sft-until) its check: the system's greedy success on 256 held-out
    questions of each demo level, seeds that evaluations never use; below the bar, another round on
    new demos, at most 3 more, each after a checkpoint (`done`: rounds a resumed run has behind it).
    The outcome goes to <out>/sft_check.json (and so into summary.json)."""
    if done and not args.sft_until:  # resumed without --sft-until: the rounds behind it are the cold start
        return
    delegate = functools.partial(run_sub_agents, agents["sub"], args, search) if "sub" in agents else None
    check_levels = sorted(set(levels(args.sft_levels, args.level)))
    for more in range(done, 4 if args.sft_until else 1):
        t0 = time.time()
        losses = cold_start_all(agents, kinds, steps, args, more)
        print("cold start on noisy demos" + " (more)" * (more > 0) + ", final loss " + " ".join(
            f"{n} {v:.3f} ({steps[n]} steps)" for n, v in losses.items()) + f" ({time.time() - t0:.0f}s)", flush=True)
        if not args.sft_until:
            return
        check = {lv: evaluate(agents["main"], dataclasses.replace(args, level=lv, eval_questions=256), delegate,
                              search, True, EVAL_SEED + 2 ** 30) for lv in check_levels}
        passed = min(check.values()) >= args.sft_until
        print("cold-start check, greedy success: " + ", ".join(f"level {lv} {v:.3f}" for lv, v in check.items())
              + ("" if passed else ", below --sft-until" + ": going on" * (more < 3)), flush=True)
        if passed:
            break
        if more < 3:  # a round of a small model's long demos can take most of an hour on a CPU
            save_checkpoint(out, agents, 0, 0, sft_rounds=more + 1)
    with open(os.path.join(out, "sft_check.json"), "w") as f:
        json.dump({"passed": passed, "rounds": more + 1, "greedy": check}, f)
    if not passed:
        print("warning: the cold start did not reach --sft-until after 3 more rounds; RL starts anyway", flush=True)


def parse_args(argv=None):
    """The command line, from Args: a flag per field, with the field's help text."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(Args):
        kw = dict(default=f.default, help=f.metadata["help"].replace("%", "%%"))
        if isinstance(f.default, tuple):
            kw.update(type=float, nargs=len(f.default))
        elif isinstance(f.default, bool):
            kw.update(action=argparse.BooleanOptionalAction)
        else:
            kw.update(type=type(f.default))
        p.add_argument("--" + f.name.replace("_", "-"), **kw)
    a = Args(**{k: tuple(v) if isinstance(v, list) else v for k, v in vars(p.parse_args(argv)).items()})
    errors = [msg for bad, msg in [
        (a.group_size < 2, "--group-size must be >= 2 (a group of one has no baseline)"),
        (a.max_sub < 1, "--max-sub must be >= 1"),
        (a.mode not in ("co-train", "main-only", "single-agent"), "--mode must be co-train, main-only or single-agent"),
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
        (a.search_timeout <= 0 or a.search_retries < 0, "--search-timeout must be > 0, --search-retries >= 0")] if bad]
    try:  # the task, and its own check of the levels asked for
        for level in {a.level, *map(int, re.findall(r"\d+", a.sft_levels + "," + a.train_levels))}:
            load_task(a.task).make_question(0, level)
    except (ImportError, FileNotFoundError, AttributeError) as e:
        errors.append(f"--task {a.task}: {e}")
    except ValueError as e:
        errors.append(f"--level / --sft-levels / --train-levels: {e}")
    if errors:
        p.error("; ".join(errors))
    if a.eval_questions == -1:
        a.eval_questions = 32 if a.main_model or a.sub_model or a.chat else 256
    return a


SHARED_ARGS = ("seed", "steps", "mode", "task", "questions_per_step", "group_size", "max_sub", "level", "train_levels",
               "eval_every", "eval_questions", "unsync", "w_sub")  # what the two roles must agree on


def prepare(args, out, names, store):
    """Everything before the first phase: the search tool, the store's run record, the agents
    (from the last checkpoint with --resume), the cold start, the first checkpoint, the reference."""
    search = load_task(args.task).search_tool() if args.search == "toy" else toy_tools.HttpSearch(
        args.search, args.search_timeout, args.search_retries, visit_hosts=args.visit_hosts.split(","))
    if "sub" in names or args.mode == "single-agent":
        try:  # a server that is down fails here, clearly, before any training
            search.search("ada", 0, args.level)
        except toy_tools.SearchError as e:
            raise toy_tools.SearchError(f"{e}; the toy server starts with: python toy_tools.py serve --port PORT")
    shared = json.loads(json.dumps({k: getattr(args, k) for k in SHARED_ARGS}))  # as the store holds it
    if store and args.role == "main":
        previous = store.read("run")
        if previous is not None and (not args.resume or previous != shared):
            raise StoreError(f"the store {store.dir} holds an earlier run" + (
                f" with other settings: {previous}" if args.resume else "; use --resume, another --run-id or an "
                                                                          "empty store"))
        store.put("run", shared)
    if store and args.role == "sub":
        if not args.resume:
            store.wait_peer()  # a live main role, not the records of an earlier run
        _, previous = store.wait("run")
        if previous != shared:
            diff = {k: (v, shared.get(k)) for k, v in previous.items() if shared.get(k) != v}
            raise StoreError(f"the sub role's settings differ from the main role's (main, sub): {diff}")
    resumed = load_checkpoint(out, names, functools.partial(load_agent, args=args, seed=0), Traj) if args.resume \
        else None
    if resumed:
        agents, start, n_lines, sft_done = resumed
        path = os.path.join(out, "metrics.jsonl")
        with open(path) as f:
            kept = f.readlines()[:n_lines]  # drop the lines of phases after the checkpoint
        with open(path + ".tmp", "w") as f:
            f.writelines(kept)
        os.replace(path + ".tmp", path)  # atomically: a kill now leaves one whole file
        print(f"resumed from {out} at schedule position {start}" + (
            f", in the cold start after round {sft_done}" if sft_done is not None else ""), flush=True)
    else:
        if args.resume:
            print(f"no checkpoint in {out}: starting afresh", flush=True)
        agents = {n: load_agent(args.main_model if n == "main" else args.sub_model, args, seed=args.seed + (n == "sub"))
                  for n in names}
        if "sub" in agents and args.lr_sub:
            agents["sub"].opt.param_groups[0]["lr"] = args.lr_sub
        with open(os.path.join(out, "args.json"), "w") as f:
            json.dump(dataclasses.asdict(args), f, indent=1)
        open(os.path.join(out, "metrics.jsonl"), "w").close()
        for path in checkpoints(out) + [os.path.join(out, "ref")]:  # an earlier run's, in the same folder
            shutil.rmtree(path, ignore_errors=True)
        if os.path.exists(os.path.join(out, "sft_check.json")):
            os.remove(os.path.join(out, "sft_check.json"))
        start, n_lines, sft_done = 0, 0, 0
    kinds, given = {"main": "single" if args.mode == "single-agent" else "main", "sub": "sub"}, {
        "main": args.main_model, "sub": args.sub_model}
    print(f"M-GRPO | role {args.role} | " + ", ".join(f"{n} {sum(p.numel() for p in a.model.parameters()) / 1e6:.2f}M "
                                                        f"params" for n, a in agents.items())
          + f" | {args.mode} K={args.group_size} D={args.max_sub} level={args.level} device={args.device} "
            f"{args.dtype}" + (" unsync" if args.unsync else "") + f" | out: {out}", flush=True)
    for n, a in agents.items():
        static, act, mb, T = memory_estimate(a, kinds[n], args, len(prompt_ids(a, kinds[n], "x" * 40)),
                                             max_new(a, args))
        print(f"memory estimate, {n}: {static + act:.2f} GiB = {static:.2f} weights, grads, AdamW"
              + (", reference" if args.kl_coef else "") + f" + {act:.2f} one micro-batch ({mb} x up to {T} tokens;"
              " --micro-batch and --grad-checkpointing lower it)", flush=True)
    if any(given[n] for n in names):
        print("a model given by name or path: " + ("no cold start" if args.sft_steps == -1 else
              f"{args.sft_steps} cold-start steps") + f", {args.eval_questions} questions per evaluation, "
              f"{max_new(agents[names[0]], args)} new tokens per turn (--sft-steps, --eval-questions and "
              "--max-new-tokens change them)", flush=True)
    if sft_done is not None:  # a new run, or one cut off in its cold start
        sft = cold_start_steps(args, {n: given[n] for n in names})
        if any(sft.values()):
            cold_start_checked(agents, kinds, sft, args, search, out, sft_done)
        if args.kl_coef:  # the frozen reference: each agent as RL starts, saved before the checkpoint that
            for n, a in agents.items():  # ends the cold start, so that a resumed run always finds it
                a.model.save_pretrained(os.path.join(out, "ref", n))
        save_checkpoint(out, agents, 0, 0)
    if args.kl_coef:
        for n, a in agents.items():
            path = os.path.join(out, "ref", n)
            a.ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16 if a.bf16 else torch.float32)
            a.ref.to(args.device).eval().requires_grad_(False)
    return agents, start, n_lines, search


def report(args, agents, out, store, t_start):
    """After the last phase: the trained agents, summary.json, curves.png and the figures."""
    for n, a in agents.items():  # the trained agents, ready for from_pretrained
        a.model.save_pretrained(os.path.join(out, n))
        a.tok.save_pretrained(os.path.join(out, n))
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    steps = [r for r in rows if "eval" not in r]
    evals = {(r["step"], r["eval"]): r["eval_success"] for r in rows if "eval" in r}
    summary = {"role": args.role, "mode": args.mode, "level": args.level, "steps": len(steps),
               "params": sum(p.numel() for a in agents.values() for p in a.model.parameters()),
               "wall_time_s": round(time.time() - t_start, 1)}
    try:  # written by this run's cold start (--sft-until), if it had one
        with open(os.path.join(out, "sft_check.json")) as f:
            summary["sft_check"] = json.load(f)
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as e:
        print(f"warning: {out}/sft_check.json cannot be read ({e}); summary.json goes without it", flush=True)
    if store:
        t_step = sum(r["t_step"] for r in steps)
        summary["store_share_of_step_time"] = sum(r.get("t_store", 0.0) for r in steps) / max(t_step, 1e-9)
        print(f"store: {100 * summary['store_share_of_step_time']:.1f}% of step time in reads and writes")
    if args.role != "sub":
        all_d = [d for r in steps for d in r["d_k"]]
        hist = {int(d): int(n) for d, n in zip(*np.unique(all_d, return_counts=True))} if all_d else {}
        summary.update(eval_success_start=evals[(0, "sampled")], eval_greedy_success_start=evals[(0, "greedy")],
                       eval_success_end=evals[(args.steps, "sampled")],
                       eval_greedy_success_end=evals[(args.steps, "greedy")],
                       d_k_histogram=hist, D_in_use=args.max_sub, D_paper_rule=paper_D(all_d))
        if args.mode != "single-agent":
            print(f"d_k over all rollouts: {hist}; the paper's rule P(d_k <= D) >= 0.99 picks "
                  f"D = {summary['D_paper_rule']} (in use: D = {args.max_sub})")
        print(f"eval after RL: sampled success {summary['eval_success_end']:.3f} "
              f"(before {summary['eval_success_start']:.3f}), greedy {summary['eval_greedy_success_end']:.3f}")
        plot = plot_curves(out, rows)
        print(f"curves: {plot}" if plot else "no curves.png: matplotlib is not installed (it is optional)")
    if torch.device(args.device).type == "cuda":
        summary["peak_gpu_mem_gib"] = torch.cuda.max_memory_allocated(args.device) / 2 ** 30
        print(f"peak GPU memory of this process: {summary['peak_gpu_mem_gib']:.2f} GiB")
    print(f"{summary['wall_time_s']:.0f}s in all | {out}", flush=True)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary


def main(argv=None):
    args = parse_args(argv)
    transformers.utils.logging.disable_progress_bar()
    t_start = time.time()
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    out = args.out or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S") + f"-seed{args.seed}"
                                   + ("" if args.role == "both" else "-" + args.role))
    os.makedirs(out, exist_ok=True)
    names = ["main"] if args.mode == "single-agent" else {"both": ["main", "sub"], "main": ["main"],
                                                          "sub": ["sub"]}[args.role]
    if args.role != "both" and args.device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))  # the two roles share the cores
    store = None if args.role == "both" else FileStore(args.store, args.run_id, args.role, args.peer_timeout,
                                                       args.progress_timeout)
    try:
        agents, start, n_lines, search = prepare(args, out, names, store)
        train(args, agents, out, store, search, start, n_lines)
    finally:
        if store:
            store.close()
    return report(args, agents, out, store, t_start)


if __name__ == "__main__":
    parent = os.environ.pop("MGRPO_PARENT_PID", "")  # set by scripts/compare.py: end with it, even if killed
    if re.fullmatch(r"[1-9][0-9]*", parent):
        exit_with_parent(int(parent))
    main()
