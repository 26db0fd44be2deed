"""M-GRPO in one file: a main agent (planner) and a sub-agent (searcher), two LLMs with
two optimizers, trained with group-relative policy optimisation computed per agent.

Paper: "Multi-Agent Deep Research: Training Multi-Agent Systems with M-GRPO",
arXiv 2511.13288. The "spec" cited below (`# spec 4`, `# eq. 13`) is M-GRPO-SPEC.md,
which restates the paper's algorithm; tutorial.md walks through both.

What the algorithm really is, per training step:
  1. Rollout. For each of Q questions, K rollouts. In rollout k the main agent M thinks,
     delegates sub-tasks to the sub-agent S (d_k times, d_k varies) and answers; each
     delegation runs S's own multi-turn search loop, whose result is pasted into M's
     context. Every token carries a loss mask: 1 if the policy sampled it, 0 if it was
     inserted (prompt, search results, S's returned text in M's context).
  2. Rewards: R_M per rollout (eq. 4), R_S per sub-trajectory (eq. 5).
  3. A_M = z-score of R_M over the K rollouts of a question (eq. 9-10).
  4. Alignment: duplicate or drop each rollout's sub-trajectories to exactly D (eq. 11).
  5. A_S = z-score of R_S over the D*K aligned sub-trajectories of a question (eq. 12-13).
  6. Each agent takes its own clipped policy-gradient step (eq. 14-19): token-level
     ratio, asymmetric clip, no KL, no entropy bonus. With one epoch per batch (the
     default) the ratio is 1 and this is REINFORCE with a per-agent group baseline
     (except S under --unsync, whose batch is one update old).
  7. M's side passes S's side only a few statistics per rollout (spec 7); no gradient
     and no tensor crosses between the agents.

The default run needs no download: two tiny Llama/Qwen2-style models with a word-level
tokenizer, built in code. Random models never hit the answer format by RL alone, so a
short supervised cold start on noisy scripted demos stands in for the paper's stage 1
(format learning) before M-GRPO starts. `--main-model` / `--sub-model` take a Hugging
Face name or path instead.

The paper's baselines are modes of the same loop: `--mode main-only` freezes S, `--mode
single-agent` replaces M and S by one model that searches for itself; scripts/compare.py
runs them (and `--unsync`) in stage 2 of the paper's two-stage curriculum.

    python mgrpo.py              # CPU demo: cold start, then M-GRPO on the toy task
    python mgrpo.py --help
"""
import argparse
import ast
import dataclasses
import fcntl
import functools
import inspect
import itertools
import json
import math
import multiprocessing
import os
import random
import re
import secrets
import shutil
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

import toy_tools


@dataclass
class Args:
    seed: int = 1
    """seeds everything: model init, questions, sampling, alignment"""
    steps: int = 200
    """M-GRPO steps (each updates both agents once per epoch)"""
    questions_per_step: int = 8
    """questions (queries) per step"""
    group_size: int = 8
    """K: rollouts per question, the group of the main agent's advantage (eq. 9-10)"""
    max_sub: int = 2
    """D: aligned sub-trajectories per rollout (eq. 11); the paper picks P(d_k <= D) ~ 0.99"""
    level: int = 1
    """toy task level: 1 = 2 hops, 3 short clean snippets per search (stage 1); 2 = 3 hops,
    8 snippets per search, most of them noise (stage 2)"""
    mode: str = "co-train"
    """co-train: M-GRPO, both agents train; main-only: S stays frozen as loaded or cold-started,
    M trains (GRPO); single-agent: one model searches for itself and answers (GRPO), no S"""
    main_model: str = ""
    """main agent: a Hugging Face name or path (a chat model: its own chat template, tool calls
    as <tool_call> JSON); empty builds a tiny model in code"""
    sub_model: str = ""
    """sub-agent: a Hugging Face name or path; empty builds a tiny model in code"""
    model_size: str = "0.2M"
    """size of the models built in code: 0.1M, 0.2M, 1M, 4M or 30M parameters"""
    chat: bool = False
    """build the in-code models as Qwen2 chat models (byte-level BPE, Qwen-style chat template,
    JSON tool calls): the path real instruct models take, without a download"""
    device: str = "cpu"
    """torch device of this process's agents, e.g. cpu, cuda, cuda:1 (two GPUs: one per --role)"""
    dtype: str = "float32"
    """float32, or bfloat16: matmuls in bf16 (autocast) over fp32 weights and AdamW states; pure
    bf16 weights would round away updates at lr 1e-6"""
    cuda_graphs: bool = True
    """on a GPU, decode with CUDA graphs over a static KV cache (checked against the eager loop on
    first use, which it falls back to); --no-cuda-graphs for the eager loop"""
    grad_checkpointing: bool = False
    """recompute activations in the backward pass: less memory, slower (M: 31% fewer training
    tokens/s in the GPU check)"""
    kl_coef: float = 0.0
    """weight of a k3 KL term to a frozen copy of each agent as RL starts (spec 6: 0, as the paper)"""
    search: str = "toy"
    """search tool: 'toy' (in-process) or the URL of a server speaking SearXNG's JSON API, such as
    the toy server (python toy_tools.py serve)"""
    search_timeout: float = 10.0
    """seconds per search request"""
    search_retries: int = 2
    """retries of a search request that timed out, failed to connect or got a 5xx answer"""
    visit_hosts: str = ""
    """hosts (comma-separated) whose pages the agents may visit beyond the URLs of their own search
    results, which is all they may visit otherwise"""
    visit_max_chars: int = 2000
    """chat models' visit tool: page text is cut to this many characters"""
    out: str = ""
    """output folder; empty: runs/<time>-seed<seed>"""
    sft_steps: int = -1
    """cold-start steps on noisy scripted demos (stands in for stage 1); 0 skips it; -1: 600 for
    a model built in code, 0 for one given by --main-model / --sub-model"""
    sft_levels: str = ""
    """task levels of the cold-start demos, e.g. '1,2' (taken in turn); empty: --level"""
    sft_batch: int = 64
    """demos per cold-start step, per agent"""
    sft_lr: float = 1.5e-3
    """cold-start learning rate"""
    demo_noise: float = 0.1
    """probability that a demo replaces an entity by a random one (about half the demos end wrong)"""
    lr: float = 3e-4
    """M-GRPO learning rate, both agents (paper: 1e-6 for 30B models)"""
    weight_decay: float = 0.1
    """AdamW weight decay, betas (0.9, 0.98) as in the paper"""
    ppo_epochs: int = 1
    """passes over each batch; with 1 the ratio is 1 and the clip never acts"""
    micro_batch: int = 0
    """sequences per forward/backward; the loss is still normalised over the whole batch; 0 = all"""
    eps_low: float = 0.2
    """clip range below 1 (eq. 14-19)"""
    eps_high: float = 0.28
    """clip range above 1 ("clip-higher", as the authors ran it)"""
    loss_agg: str = "seq-mean"
    """'seq-mean': mean over each sequence's tokens, then over sequences (authors); 'token-mean'"""
    grad_clip: float = 1.0
    """max gradient norm per agent"""
    main_max_turns: int = 4
    """main agent turns per rollout (delegations + the answer)"""
    sub_max_turns: int = 3
    """sub-agent turns per sub-task (searches + the return)"""
    max_new_tokens: int = 0
    """tokens per turn; a turn that does not end by then is invalid; 0: 8 for the word-level
    models, 256 for chat models (raise it for models that think at length)"""
    w_main_format: float = 0.1
    """eq. 4: R_M = w * r_format + (1 - w) * r_correct when the format is valid, else 0"""
    w_sub: tuple = (0.1, 0.4, 0.5)
    """eq. 5: weights of r_format, r_correct_main, r_expert in R_S"""
    eval_questions: int = -1
    """held-out questions per evaluation (fixed seed, same for every run); -1: 256 for the
    word-level models built in code, 32 when a model is given or built with --chat (long turns)"""
    eval_every: int = 50
    """evaluate every N steps as well as before and after RL; 0 = before and after only"""
    role: str = "both"
    """both: one process holds both agents; main / sub: this process holds one agent and
    talks to the other role's process through --store (spec 7)"""
    store: str = ""
    """shared store for --role main / sub: a directory both processes can reach"""
    run_id: str = "run"
    """names this run's records inside the store"""
    unsync: bool = False
    """the sub-agent trains on the previous step's data (the paper's off-policy version)"""
    resume: bool = False
    """continue from the last checkpoint in --out (needs --out)"""
    save_every: int = 1
    """checkpoint every N steps (and after each evaluation); resume restarts from the last one"""
    peer_timeout: float = 60.0
    """seconds without a heartbeat from the other role before this one stops with an error"""
    progress_timeout: float = 0.0
    """seconds a role waits for one record from its live peer before it stops, naming the phase;
    0 waits as long as the peer is alive"""


def parse_args(argv=None):
    """argparse from the Args dataclass; each field's docstring is its --help text."""
    tree = ast.parse(inspect.getsource(Args))
    body = tree.body[0].body
    docs = {a.target.id: b.value.value for a, b in zip(body, body[1:])
            if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr)}
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(Args):
        kw = dict(default=f.default, help=docs[f.name].replace("%", "%%"))
        if f.type is tuple:
            kw.update(type=float, nargs=len(f.default))
        elif f.type is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = type(f.default)
        p.add_argument("--" + f.name.replace("_", "-"), **kw)
    a = Args(**{k: tuple(v) if isinstance(v, list) else v for k, v in vars(p.parse_args(argv)).items()})
    errors = [msg for bad, msg in [
        (a.group_size < 2, "--group-size must be >= 2 (a group of one has no baseline)"),
        (a.max_sub < 1, "--max-sub must be >= 1"),
        (a.level not in (1, 2), "--level must be 1 or 2"),
        (a.mode not in ("co-train", "main-only", "single-agent"), "--mode must be co-train, main-only or single-agent"),
        (a.mode == "single-agent" and a.role != "both", "--mode single-agent runs in one process (--role both)"),
        (a.unsync and a.mode != "co-train", "--unsync changes how S trains: it needs --mode co-train"),
        (a.loss_agg not in ("seq-mean", "token-mean"), "--loss-agg must be seq-mean or token-mean"),
        (a.model_size not in SIZES, f"--model-size must be one of {list(SIZES)}"),
        (min(a.steps, a.micro_batch, a.max_new_tokens) < 0 or a.sft_steps < -1 or a.eval_questions < -1,
         "--steps, --micro-batch, --max-new-tokens must be >= 0, --sft-steps and --eval-questions >= -1"),
        (a.dtype not in ("float32", "bfloat16"), "--dtype must be float32 or bfloat16"),
        (a.kl_coef < 0 or a.visit_max_chars < 1, "--kl-coef must be >= 0 and --visit-max-chars >= 1"),
        (min(a.questions_per_step, a.ppo_epochs, a.eval_questions) == 0 or min(a.questions_per_step, a.ppo_epochs) < 0,
         "--questions-per-step, --ppo-epochs, --eval-questions must be >= 1"),
        (bool(a.sft_levels) and not set(a.sft_levels.split(",")) <= {"1", "2"},
         "--sft-levels must list levels 1 and/or 2, e.g. 1,2"),
        (a.main_max_turns < 2 or a.sub_max_turns < 2, "--main-max-turns and --sub-max-turns must be >= 2"),
        (a.role not in ("both", "main", "sub"), "--role must be both, main or sub"),
        (a.role != "both" and not a.store, "--role main / sub needs --store DIR"),
        (a.resume and not a.out, "--resume needs the --out of the run to continue"),
        (a.save_every < 1 or a.peer_timeout <= 0 or a.progress_timeout < 0,
         "--save-every must be >= 1, --peer-timeout > 0 and --progress-timeout >= 0"),
        (a.search_timeout <= 0 or a.search_retries < 0, "--search-timeout must be > 0, --search-retries >= 0"),
    ] if bad]
    if errors:
        p.error("; ".join(errors))
    if a.eval_questions == -1:
        a.eval_questions = 32 if a.main_model or a.sub_model or a.chat else 256
    return a


# =======================================================================================
# Spec 1. The system: two distinct LLMs, each with its own tokenizer and optimizer
# =======================================================================================
# Models built in code. Llama architecture (Qwen2's, less the qkv bias): a saved "qwen2"
# folder would make AutoTokenizer load Qwen2's BPE class over the word-level vocabulary.
SIZES = {
    "0.1M": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                 intermediate_size=192),
    # the default: at 0.1M the sub-agent's cold start sometimes never learns to copy a
    # country out of the search results in 1200 steps (2 of 4 seeds); at 0.2M it did in 6 of 6
    "0.2M": dict(hidden_size=96, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                 intermediate_size=256),
    "1M": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=512),
    "4M": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
               intermediate_size=1024),
    "30M": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                intermediate_size=1536),  # the GPU check's size
}


@dataclass
class Agent:
    model: torch.nn.Module
    tok: object
    opt: torch.optim.Optimizer = None
    stop_ids: tuple = ()   # token ids that end a turn
    suppress: tuple = ()   # never sampled: pad and unk look like padding in generate's output
    pad_id: int = 0        # the tokenizer's pad, else its eos (padding is found by length anyway)
    pending: tuple = None  # --unsync: (batch, advantages) of the previous step, not yet trained on
    chat: bool = False     # a chat model: system prompt with tools, <tool_call> JSON (else word-level tags)
    end: tuple = (0, 0)    # (id, length of its text) of the stop token that closes an assistant turn
    ref: torch.nn.Module = None  # frozen reference for --kl-coef
    bf16: bool = False     # --dtype bfloat16: autocast over fp32 weights
    splits: dict = field(default_factory=dict)  # render_ids: (template, key) -> (head, tail) or None
    graphs: dict = None    # --cuda-graphs on a GPU: (rows, cache slots) -> GraphDecoder

    def autocast(self, cache_enabled=True):  # a CUDA graph's capture needs cache_enabled=False
        return torch.autocast(self.model.device.type, dtype=torch.bfloat16, enabled=self.bf16,
                              cache_enabled=cache_enabled)


def tiny_model(tok, size, seed, chat=False):
    torch.manual_seed(seed)
    cfg = dict(vocab_size=len(tok), tie_word_embeddings=False, pad_token_id=tok.pad_token_id,
               eos_token_id=tok.eos_token_id, bos_token_id=None, **SIZES[size])
    if chat:  # Qwen2 itself: chat contexts (system prompt, tool schemas, results) are long
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(max_position_embeddings=4096, **cfg))
    return LlamaForCausalLM(LlamaConfig(max_position_embeddings=256, **cfg))


def load_agent(name, args, seed):
    """A real model by Hugging Face name or path, or (name empty) a tiny one built in code."""
    if name:
        tok = AutoTokenizer.from_pretrained(name)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32)  # fp32 master weights
    else:
        tok = toy_tools.chat_tokenizer() if args.chat else toy_tools.toy_tokenizer()
        model = tiny_model(tok, args.model_size, seed, args.chat)
    if not tok.chat_template:
        raise ValueError(f"{name}: the tokenizer has no chat template; the agents need one (an instruct model)")
    model.to(args.device).eval()  # eval: no dropout, so sampling and training log-probs agree
    eos = model.generation_config.eos_token_id
    stop = {tok.eos_token_id, *(eos if isinstance(eos, list) else [eos])} - {None}
    suppress = {tok.pad_token_id, tok.unk_token_id} - stop - {None}
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98),
                            weight_decay=args.weight_decay)
    pad = tok.pad_token_id if tok.pad_token_id is not None else min(stop)
    if args.grad_checkpointing:
        # HF recomputes only in train mode, which must then change nothing else: no dropout
        drop = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
        if drop or getattr(model.config, "attention_dropout", 0.0):
            raise ValueError(f"--grad-checkpointing trains in train mode, and {name or 'the model'} has dropout")
        if hasattr(model, "activation_checkpointing_enable"):  # its name from transformers 5.2x on
            model.activation_checkpointing_enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # Which stop token closes an assistant turn in the template, and how much text it takes
    after = chat_suffix(tok, "user", "?")
    texts = {i: tok.decode([i]) for i in sorted(stop)}
    end = next(((i, m.end()) for i, t in texts.items() if t for m in [re.match(r"\s*" + re.escape(t), after)] if m),
               None)
    if end is None:
        raise ValueError(f"{name}: the chat template ends an assistant turn with {after[:30]!r}, which starts "
                         f"with none of the stop tokens {list(texts.values())}")
    return Agent(model, tok, opt, tuple(sorted(stop)), tuple(sorted(suppress)), pad,
                 chat=tok.chat_template != toy_tools.CHAT_TEMPLATE, end=end, bf16=args.dtype == "bfloat16",
                 graphs={} if args.cuda_graphs and model.device.type == "cuda" else None)


# =======================================================================================
# Contexts as token ids, grown one message at a time
# =======================================================================================
# Contexts grow by appending ids, never by re-rendering and re-tokenising the conversation,
# so the ids trained on are exactly the ids sampled. A message's ids are cut from a render
# in which an assistant turn precedes it: chat templates render a message alone with a
# default system prompt (Qwen2.5) or render the last assistant turn differently (Qwen3).
MARK = "@@MARK@@"


def chat_suffix(tok, role, content):
    """The template's text after an assistant turn's content: the turn's end, then `role`'s
    message, then the prompt for the next assistant turn."""
    text = tok.apply_chat_template([{"role": "user", "content": "?"}, {"role": "assistant", "content": MARK},
                                    {"role": role, "content": content}], add_generation_prompt=True, tokenize=False)
    return text[text.index(MARK) + len(MARK):]


def render_ids(agent, key, render, content):
    """Token ids of render(content). A template that pastes the content in unchanged is
    rendered once per key, as head + content + tail (checked on two probes); one that
    transforms the content (trims it, say) is rendered for every call."""
    content = content.encode("utf-8", "replace").decode("utf-8")  # no lone surrogate reaches a tokenizer
    k = (agent.tok.chat_template, key)
    if k not in agent.splits:
        a, b = "\x01A\x01", " \n\x02B \x02\n "
        ra, rb = render(a), render(b)
        head, _, tail = ra.partition(a)
        agent.splits[k] = (head, tail) if a in ra and rb == head + b + tail else None
    split = agent.splits[k]
    text = split[0] + content + split[1] if split else render(content)
    return agent.tok(text, add_special_tokens=False).input_ids


def message_ids(agent, role, content):
    """Ids of one message (a tool result) and the next assistant prompt, to append after an
    assistant turn, which ends with the stop token the model sampled (`agent.end`)."""
    return render_ids(agent, role, lambda c: chat_suffix(agent.tok, role, c)[agent.end[1]:], content)


def prompt_ids(agent, who, content):
    """Ids of a new conversation: the user message (for chat models after a system prompt that
    describes the agent's tools) and the assistant prompt. who: main, sub or single."""
    kw, system = {}, []
    if agent.chat:
        tools = [toy_tools.TOOLS[n] for n in toy_tools.CHAT_TOOLS[who]]
        text = toy_tools.SYSTEM[who]
        if "tools" in agent.tok.chat_template:
            kw["tools"] = tools
        else:  # a template that cannot list tools: they go into the system prompt as JSON
            text += "\nTools:\n" + "\n".join(json.dumps(t) for t in tools)
        system = [{"role": "system", "content": text}]
    return render_ids(agent, "prompt-" + who, lambda c: agent.tok.apply_chat_template(
        system + [{"role": "user", "content": c}], add_generation_prompt=True, tokenize=False, **kw), content)


# =======================================================================================
# Spec 1. Rollout: M's turns with nested S tool loops, batched in lockstep
# =======================================================================================
@dataclass
class Traj:
    """One agent's trajectory: the exact token ids, which of them the policy sampled
    (mask 1), and the sampling log-prob of each sampled token (0 elsewhere)."""
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


def new_traj(agent, who, content, **kw):
    ids = prompt_ids(agent, who, content)
    return Traj(ids, [0] * len(ids), [0.0] * len(ids), **kw)


def max_new(agent, args):
    return args.max_new_tokens or (256 if agent.chat else 8)


def sample_token(logits, suppress, generator, greedy=False):
    """Draw one token per row from the raw logits [B, V]: (tokens, their log-probs).

    The log-prob kept is the token's under the raw distribution, log_softmax(logits) in fp32:
    the policy that `token_logprobs` recomputes in training. Suppressed ids (pad, unk: they
    would look like padding) are removed before the draw, which is at temperature 1 (argmax
    when greedy); no top-k, top-p or repetition penalty.
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


class GraphDecoder:
    """Decoding over a static KV cache whose steps replay a CUDA graph (--cuda-graphs).

    A small model's decode step is many tiny kernels; a graph launches them as one. Shapes
    are fixed per decoder: `rows` (batches are padded to a power of two) and `length` cache
    slots. The prefill runs eagerly. The first replay is checked against the eager forward
    run before the capture; on a mismatch `generate` falls back to the eager loop for good.
    Without CUDA (the tests) the steps run eagerly over the same static buffers.
    """

    def __init__(self, agent, rows, length):
        self.agent, dev = agent, agent.model.device
        self.cache = transformers.StaticCache(config=agent.model.config, max_cache_len=length)
        self.x, self.pos = (torch.zeros(rows, 1, dtype=torch.long, device=dev) for _ in range(2))
        self.attn = torch.zeros(rows, length, dtype=torch.long, device=dev)
        self.graph = self.logits = None

    def forward(self, ids, attn, pos, cache_enabled=True):
        with self.agent.autocast(cache_enabled):
            return forward_last(self.agent.model, ids, attn, pos, self.cache)

    def prefill(self, ids, attn, pos):
        self.cache.reset()
        self.attn.zero_()
        self.attn[:, :ids.shape[1]] = attn
        logits = self.forward(ids, self.attn, pos)
        if any(type(layer) is not transformers.cache_utils.StaticLayer for layer in self.cache.layers):
            raise RuntimeError("the model's cache layers are not plain static layers (sliding windows?)")
        return logits

    def step(self, tok, pos, slot):
        """One token per row, written to cache slot `slot`, at rope position `pos`."""
        self.x.copy_(tok[:, None])
        self.pos.copy_(pos)
        self.attn[:, slot] = 1
        if self.x.device.type != "cuda":
            return self.forward(self.x, self.attn, self.pos)
        if self.graph is None:  # warm up on a side stream, capture, then replay this very step
            counts = [layer.cumulative_length.clone() for layer in self.cache.layers]
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                want = self.forward(self.x, self.attn, self.pos).clone()
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.logits = self.forward(self.x, self.attn, self.pos, cache_enabled=False)
            for layer, n in zip(self.cache.layers, counts):  # the warm-up wrote this slot: write it again
                layer.cumulative_length.copy_(n)
            self.graph.replay()
            if not torch.allclose(self.logits.float(), want.float(), rtol=1e-3, atol=1e-3):
                raise RuntimeError("the graph's logits differ from the eager forward's")
        else:
            self.graph.replay()
        return self.logits.clone()


@torch.no_grad()
def generate(agent, contexts, max_new_tokens, seed, greedy=False):
    """Sample one turn for a batch of contexts: per context (new ids, their log-probs, ended?).

    The left-padded contexts go through the model once (prefill, into a KV cache, keeping the
    last position's logits); then one token per forward. Each token is drawn by `sample_token`
    with a torch.Generator seeded from `seed`, so a call does not depend on what ran before.
    A row ends at its first stop token and leaves the batch (its rows of the cache go too).
    Nothing in the model's `generation_config` (temperature, top_k, top_p, repetition
    penalty, ...) is read: what is sampled is exactly the policy that training scores.
    With `agent.graphs` (a dict: --cuda-graphs on a GPU) the steps replay a CUDA graph over a
    static cache instead (`GraphDecoder`), and finished rows stay in the batch, masked.
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
                agent.graphs[R, T] = GraphDecoder(agent, R, T)
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


def turn_action(agent, new, ended, who):
    """Parse one turn's output: (tag, argument), or None for invalid format."""
    if not ended:  # overlong: never closed its turn
        return None
    text = agent.tok.decode(new[:-1], skip_special_tokens=False)
    if agent.chat:
        return toy_tools.parse_chat_action(text, who)
    return toy_tools.parse_action(text, toy_tools.TAGS[who])


def tool_loop(agent, prompts, questions, args, search, seed, greedy, who, max_turns):
    """A multi-turn search loop for a batch of prompts, in lockstep: one generate per turn.
    Each turn searches (or, chat models, visits a result's page; what comes back is a tool
    message, mask 0) or gives the final result, which ends the loop. who: sub or single."""
    trajs = [new_traj(agent, who, p, task=p) for p in prompts]
    seen = [set() for _ in prompts]  # the URLs of each trajectory's own results: all it may visit
    active = list(range(len(prompts)))
    for turn in range(max_turns):
        if not active:
            break
        outs = generate(agent, [trajs[j].ids for j in active], max_new(agent, args),
                        toy_tools.stable_seed(seed, who, turn), greedy)
        still = []
        for j, (new, lp, ended) in zip(active, outs):
            t = trajs[j]
            t.add(new, lp)
            act = turn_action(agent, new, ended, who)
            if act is None or (act[0] != toy_tools.TAGS[who][1] and turn == max_turns - 1):
                continue  # invalid format, or out of turns: t.ok stays False
            if act[0] == toy_tools.TAGS[who][1]:
                t.result, t.ok = act[1], True
                continue
            q = questions[j]
            try:  # the argument is model output: a tool that fails on it answers with the error
                if act[0] == "visit":
                    obs = search.visit(act[1], args.visit_max_chars, allowed=seen[j])
                else:
                    results = search.search(act[1], q.seed, q.level)
                    seen[j].update(r["url"] for r in results)
                    obs = toy_tools.search_observation(results, agent.chat)
            except toy_tools.SearchError as e:
                obs = f"error: {e}"
            except Exception as e:  # noqa: BLE001  (a bug in a tool, shown, but no reason to stop a long run)
                print(f"warning: the {act[0]} tool raised {type(e).__name__}: {e}", flush=True)
                obs = f"error: {type(e).__name__}"
            t.add(message_ids(agent, "tool", obs))  # tool output: mask 0
            still.append(j)
        active = still
    return trajs


def run_sub_agents(sub, tasks, questions, args, search, seed, greedy=False):
    """S's multi-turn tool loop for a batch of sub-tasks; it returns one entity each."""
    return tool_loop(sub, tasks, questions, args, search, seed, greedy, "sub", args.sub_max_turns)


def rollout(main, delegate, questions, K, args, seed, greedy=False):
    """K rollouts per question of the whole system; returns (main trajs, sub trajs).

    At every main turn, one generate call for all active main rollouts, then S's loops
    for all delegations of that turn together, through `delegate(tasks, questions, seed,
    greedy) -> sub trajs`: S in this process (`local_delegate`) or in the other role's
    process, through the store (`remote_delegate`).
    """
    mains = [new_traj(main, "main", q.text, q=qi, k=k) for qi, q in enumerate(questions) for k in range(K)]
    subs = []
    active = list(range(len(mains)))
    for turn in range(args.main_max_turns):
        if not active:
            break
        outs = generate(main, [mains[j].ids for j in active], max_new(main, args),
                        toy_tools.stable_seed(seed, "main", turn), greedy)
        calls = []
        for j, (new, lp, ended) in zip(active, outs):
            m = mains[j]
            m.add(new, lp)
            act = turn_action(main, new, ended, "main")
            if act is None or (act[0] == "call" and turn == args.main_max_turns - 1):
                continue  # invalid format, or no turn left to answer: m.ok stays False
            if act[0] == "answer":
                m.result, m.ok = act[1], True
            else:
                calls.append((j, act[1]))
        if calls:
            st = delegate([c[1] for c in calls], [questions[mains[j].q] for j, _ in calls],
                          toy_tools.stable_seed(seed, "turn", turn), greedy)
            for (j, _), s in zip(calls, st):
                s.q, s.k = mains[j].q, mains[j].k
                mains[j].calls.append(len(subs))
                subs.append(s)
                # S's returned text enters M's context as a tool message: mask 0
                mains[j].add(message_ids(main, "tool", s.result if s.ok else "none"))
        active = [j for j, _ in calls]
    return mains, subs


def single_rollout(agent, questions, K, args, search, seed, greedy=False):
    """The single-agent baseline (spec 8c): one model, one trajectory per rollout, searching
    itself with S's tool and answering; every search result stays in its own context."""
    qs = [q for q in questions for _ in range(K)]
    trajs = tool_loop(agent, [q.text for q in qs], qs, args, search, seed, greedy, "single", args.main_max_turns)
    for j, t in enumerate(trajs):
        t.q, t.k = divmod(j, K)
    return trajs, []


def system(main, delegate, args, search):
    """play(questions, K, seed, greedy) -> (main trajs, sub trajs) for --mode: M with S
    behind `delegate`, or the single agent alone."""
    if args.mode == "single-agent":
        return lambda qs, K, seed, greedy=False: single_rollout(main, qs, K, args, search, seed, greedy)
    return lambda qs, K, seed, greedy=False: rollout(main, delegate, qs, K, args, seed, greedy)


# =======================================================================================
# Spec 2. Rewards (eq. 4-5)
# =======================================================================================
def main_reward(format_ok, correct, w_format=0.1):
    """eq. 4: R_M = 0.1 r_format + 0.9 r_correct if M's format is valid, else 0."""
    return w_format + (1 - w_format) * float(correct) if format_ok else 0.0


def sub_reward(format_ok, main_correct, expert, w=(0.1, 0.4, 0.5)):
    """eq. 5: R_S = 0.1 r_format + 0.4 r_correct_main + 0.5 r_expert if S's format is valid, else 0."""
    return w[0] + w[1] * float(main_correct) + w[2] * float(expert) if format_ok else 0.0


# =======================================================================================
# Spec 3 and 5. Group-relative advantages (eq. 9-10 for M, eq. 12-13 for S)
# =======================================================================================
def group_advantages(rewards, eps=1e-6):
    """z-score over the last dimension with the population std (eq. 10, eq. 13).

    One function serves both agents; the hierarchy lies in which rewards form a group:
    M's K rollouts of a query, or S's D*K aligned sub-trajectories of that query.
    A group whose rewards are all equal gets advantage 0 (no signal, no NaN).
    """
    r = torch.as_tensor(rewards, dtype=torch.float32)
    mu = r.mean(-1, keepdim=True)                       # eq. 9 / eq. 12
    sigma = r.std(-1, unbiased=False, keepdim=True)     # population std
    adv = (r - mu) / (sigma + eps)                      # eq. 10 / eq. 13
    return torch.where(sigma > eps, adv, torch.zeros_like(adv))


# =======================================================================================
# Spec 4. Trajectory alignment (eq. 11): exactly D sub-trajectories per rollout
# =======================================================================================
def align_sub_trajectories(counts, D, rng):
    """counts[k] = d_k, the sub-trajectories of rollout k of one query. Returns D*K pairs
    (k', i): slot j belongs to rollout j // D and holds sub-trajectory i of rollout k'.

    d_k >= D: D distinct ones of its own, chosen uniformly (drop d_k - D).
    0 < d_k < D: all its own, plus D - d_k duplicates chosen uniformly from its own.
    d_k = 0 [choice, spec 4]: D drawn uniformly (with replacement) from the siblings'.
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


# =======================================================================================
# Spec 6. The objectives (eq. 14-19): one clipped surrogate per agent
# =======================================================================================
def token_logprobs(model, ids, attn):
    """logp[b, t] = log p(ids[b, t] | ids[b, :t]), and 0 at padding and at each row's
    first token (nothing predicts it). Any padding side.

    Position ids come from the attention mask, so a left-padded row is scored as if it
    were unpadded; logits at t-1 predict the token at t (the shift).
    """
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False).logits
    lp = logits[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
    lp = lp * (attn[:, 1:] * attn[:, :-1])
    return torch.cat([torch.zeros_like(lp[:, :1]), lp], 1)


def policy_loss(logp, old_logp, advantages, mask, eps_low=0.2, eps_high=0.28, agg="seq-mean",
                ref_logp=None, kl_coef=0.0):
    """Negated clipped surrogate, eq. 14-19, for one agent. Returns (loss, stats).

    The spec gives M's objective and S's as one block, eq. 14-19 (eq. 14, eq. 15, eq. 16,
    eq. 17, eq. 18, eq. 19): they differ only in the batch, M's K rollouts per query or
    S's D*K aligned sub-trajectories, so this one function computes each of them.

    logp, old_logp, mask: [B, T]; advantages: [B], one per sequence, broadcast to its tokens.
    Token-level ratio exp(logp - old_logp) with the clip range [1 - eps_low, 1 + eps_high],
    as the authors ran it (the paper writes a sequence-level ratio). Only mask-1 tokens count.
    agg="seq-mean": mean over each sequence's tokens, then over the B sequences (a row
    without tokens counts as 0); "token-mean": mean over all tokens of the batch.
    ref_logp, kl_coef: the optional KL penalty to a frozen reference (spec 6, off by default),
    kl_coef * k3 per token with k3 = exp(ref - logp) - (ref - logp) - 1 >= 0.
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

    Micro-batches weight their loss so that the sum equals the whole batch's loss
    (normalised over the whole batch, not per micro-batch).
    """
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
            loss, st = policy_loss(logp, old[sl], adv[sl], mask[sl], args.eps_low, args.eps_high, args.loss_agg,
                                   None if ref is None else ref[sl], args.kl_coef)
            w = (min(mb, B - s) / B) if args.loss_agg == "seq-mean" else mask[sl].sum() / n_tok
            if not torch.isfinite(loss):
                raise FloatingPointError(f"non-finite loss {loss.item()} in the policy update; stopping")
            t1 = time.perf_counter()
            (loss * w).backward()
            acc["t_fwd"] += t1 - t0
            acc["t_bwd"] += time.perf_counter() - t1
            for key in ("clip_frac", "approx_kl", "kl_ref"):
                acc[key] += st.get(key, 0.0) * st["tokens"] / float(n_tok) / args.ppo_epochs
        t1 = time.perf_counter()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        if not torch.isfinite(gn):
            raise FloatingPointError(f"non-finite gradient norm {gn.item()}; stopping")
        agent.opt.step()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)  # so that the time split is the GPU's, not the launch queue's
        acc["t_bwd"] += time.perf_counter() - t1
    model.eval()
    acc["grad_norm"] = float(gn)
    acc["tokens"] = float(n_tok) * args.ppo_epochs
    acc["tokens_in"] = float(attn.sum()) * args.ppo_epochs  # every token through the model (for MFU)
    acc["sequences"] = B * args.ppo_epochs
    return acc


# =======================================================================================
# Spec 7. One M-GRPO step. M's side and S's side share only `exchange`, a list of plain
# dicts, so that they can run in two processes around a file-based store.
# =======================================================================================
def main_side(mains, questions, K, args):
    """M: rewards (eq. 4), advantages over the K rollouts of each query (eq. 9-10), and
    the statistics S needs: per rollout its ids, M's correctness, its sub-trajectories."""
    correct = [m.ok and toy_tools.answer_correct(questions[m.q], m.result) for m in mains]
    r_main = torch.tensor([main_reward(m.ok, c, args.w_main_format) for m, c in zip(mains, correct)])
    adv = group_advantages(r_main.view(-1, K)).view(-1)
    exchange = [{"query": m.q, "rollout": m.k, "correct": bool(c), "subs": list(m.calls)}
                for m, c in zip(mains, correct)]
    zero_var = float((r_main.view(-1, K).std(-1, unbiased=False) <= 1e-6).float().mean())
    return r_main, adv, exchange, {"success": float(np.mean(correct)), "zero_var_main": zero_var}


def sub_side(subs, exchange, questions, K, args, rng):
    """S: rewards (eq. 5), alignment to D per rollout (eq. 11), advantages over the D*K
    aligned sub-trajectories of each query (eq. 12-13). Returns (batch, R_S, A_S, stats)."""
    D = args.max_sub
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
        group = [subs[rows[k]["subs"][i]] for k, i in pairs]
        r = [sub_reward(s.ok, rows[k]["correct"], toy_tools.expert_score(questions[q], s.task, s.result),
                        args.w_sub) for s, (k, _) in zip(group, pairs)]
        batch += group
        rewards += r
        adv.append(group_advantages(r))
        n_groups += 1
        n_zero += int(np.std(r) <= 1e-6)
    stats = {"n_dup": n_dup, "n_drop": n_drop, "zero_var_sub": n_zero / max(1, n_groups)}
    return batch, torch.tensor(rewards), (torch.cat(adv) if adv else torch.zeros(0)), stats


def sub_step(sub, subs, exchange, questions, step, args):
    """S's side of a step: R_S, alignment, A_S and S's update. With --unsync, S updates on
    the previous step's batch (kept in `sub.pending`), one step behind its rollouts."""
    rng = random.Random(toy_tools.stable_seed(args.seed, "align", step))
    batch, r_sub, adv, stats = sub_side(subs, exchange, questions, args.group_size, args, rng)
    if args.unsync:
        (batch, adv), sub.pending = sub.pending or ([], None), (batch, adv)
    if args.mode == "main-only":
        batch = []  # S frozen (spec 8b): its rewards are still computed, to be logged
    up = update_agent(sub, batch, adv, args) if batch else {}
    rec = {"sub_reward": float(r_sub.mean()) if len(r_sub) else 0.0, **stats,
           **{f"{k}_sub": up[k] for k in ("clip_frac", "approx_kl", "kl_ref", "grad_norm", "tokens_in", "sequences")
              if k in up},
           "t_train_sub": up.get("t_fwd", 0.0) + up.get("t_bwd", 0.0)}
    return rec, up


def train_step(main, play, step, args, sub=None, store=None, phase=""):
    """Rollout (`play`, from `system`), M's side, and (when S lives in this process) S's
    side; the step's metrics. In single-agent mode M's side is all there is: plain GRPO.

    With S in another process, M writes `exchange` to the store and S's process does the
    rest; M writes it before its own update so that both updates can run at once.
    """
    t0 = time.perf_counter()
    rng = random.Random(toy_tools.stable_seed(args.seed, "questions", step))
    questions = [toy_tools.make_question(rng.randrange(2 ** 31), args.level)
                 for _ in range(args.questions_per_step)]
    K = args.group_size
    seed = toy_tools.stable_seed(args.seed, "rollout", step)
    mains, subs = play(questions, K, seed)
    t_gen = time.perf_counter() - t0

    r_main, adv_main, exchange, m_stats = main_side(mains, questions, K, args)
    if store:
        store.put(f"{phase}-done", {"exchange": exchange, "questions": [[q.seed, q.level] for q in questions]})
    up = update_agent(main, mains, adv_main, args)
    rec = {"step": step, "main_reward": float(r_main.mean()), **m_stats, "d_k": [len(m.calls) for m in mains],
           "sub_calls": len(subs), "t_train_main": up["t_fwd"] + up["t_bwd"],
           **{f"{k}_main": up[k] for k in ("clip_frac", "approx_kl", "kl_ref", "grad_norm", "tokens_in", "sequences")}}
    ups = [up]
    if sub:
        rs, up_s = sub_step(sub, subs, exchange, questions, step, args)
        rec.update(rs)
        ups.append(up_s)
    dt = time.perf_counter() - t0
    rec.update({k: sum(u.get(k, 0.0) for u in ups) for k in ("t_fwd", "t_bwd")}, t_gen=t_gen, t_step=dt,
               gen_tokens=sum(sum(t.mask) for t in mains + subs),
               gen_tokens_per_s=sum(sum(t.mask) for t in mains + subs) / t_gen,
               train_tokens_per_s=sum(u.get("tokens", 0.0) for u in ups) / (dt - t_gen))
    return rec


# =======================================================================================
# Spec 7. Decoupled training: two processes, one directory of small JSON records
# =======================================================================================
PEER = {"main": "sub", "sub": "main"}


class StoreError(RuntimeError):
    """The store or the peer failed; the message names the store, the record and what to do."""


class FileStore:
    """The shared store (the paper's Fig. 3): one small JSON file per record under <root>/<run_id>/.

    Writes are atomic: a temporary file created exclusively and without following symlinks,
    flushed, fsynced and renamed, so a reader sees a whole record or none. Keys are checked,
    so no record lands outside the directory; reads follow no symlink, and a record that is
    not a JSON object is an error that names it. A lock keeps a second process of the same
    role off the store. Each role writes a heartbeat with a counter every second, and the
    reader times the counter on its own clock (the two machines' clocks need not agree): a
    peer whose counter stood still for `timeout` seconds is gone. With `progress_timeout`, a
    wait for one record from a live peer ends after that long. Both raise StoreError.
    """
    KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
    MAX_BYTES = 64 * 2 ** 20

    def __init__(self, root, run_id, role, timeout=60.0, progress_timeout=0.0):
        self.dir = os.path.join(root, self.check(run_id))
        os.makedirs(self.dir, exist_ok=True)
        self.role, self.peer, self.timeout, self.progress_timeout = role, PEER.get(role), timeout, progress_timeout
        self.io_time = 0.0      # seconds spent reading and writing records, not waiting
        self.phase = self.saved = 0  # published in the heartbeat: the schedule index worked on, checkpointed
        self.beat_error = None  # set by the heartbeat thread when its writes keep failing
        self.seen = (None, time.monotonic())  # the peer's last heartbeat counter, and when it last changed
        self._stop = threading.Event()
        if self.peer:
            self._lock = os.open(os.path.join(self.dir, f"lock-{role}"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            try:
                fcntl.lockf(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                raise StoreError(f"another {role} role is running on the store {self.dir}; stop it, or use another "
                                 f"--run-id or --store") from None
            threading.Thread(target=self._beat, daemon=True).start()

    def check(self, key):
        if not isinstance(key, str) or not self.KEY.fullmatch(key) or ".." in key:
            raise ValueError(f"bad store key {key!r}")
        return key

    def path(self, key):
        return os.path.join(self.dir, self.check(key) + ".json")

    def put(self, key, obj):
        if self.beat_error:
            raise StoreError(self.beat_error)
        t0 = time.perf_counter()
        self._write(key, obj)
        self.io_time += time.perf_counter() - t0

    def _write(self, key, obj):
        path = self.path(key)
        tmp = f"{path}.{os.getpid()}.{secrets.token_hex(6)}.tmp"  # never ends in .json: never read
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def read(self, key):
        """The record, a JSON object, or None if it is not there (yet)."""
        t0 = time.perf_counter()
        try:
            fd = os.open(self.path(key), os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd, "rb") as f:
                data = f.read(self.MAX_BYTES + 1)
            rec = json.loads(data) if len(data) <= self.MAX_BYTES else None
        except FileNotFoundError:
            return None
        except (OSError, ValueError, RecursionError) as e:  # a directory, a symlink, not JSON, nested too deep
            raise StoreError(f"store {self.dir}: record {key} cannot be read ({type(e).__name__}: {e})") from None
        finally:
            self.io_time += time.perf_counter() - t0
        if not isinstance(rec, dict):
            raise StoreError(f"store {self.dir}: record {key} is not a JSON object of at most {self.MAX_BYTES} bytes")
        return rec

    def wait(self, *keys):
        """(key, record) of the first of `keys` present; polls, watching the peer's heartbeat."""
        delay, t_start, last_check = 0.0005, time.monotonic(), time.monotonic()
        while True:
            for key in keys:
                rec = self.read(key)
                if rec is not None:
                    return key, rec
            if time.monotonic() - last_check > 1.0:
                beat = self.check_peer()
                last_check = time.monotonic()
                if self.progress_timeout and last_check - t_start > self.progress_timeout:
                    raise StoreError(f"waited {last_check - t_start:.0f}s for {' or '.join(keys)} in {self.dir}; the "
                                     f"{self.peer} role is alive but stays in phase {beat.get('phase')} "
                                     f"(--progress-timeout)")
            time.sleep(delay)
            delay = min(2 * delay, 0.02)

    def check_peer(self):
        """The peer's heartbeat ({} if unreadable); StoreError if its counter has not moved for
        `timeout` seconds of this process's clock, or if this role's own heartbeat failed."""
        if self.beat_error:
            raise StoreError(self.beat_error)
        try:
            beat = self.read(f"heartbeat-{self.peer}") or {}
        except StoreError:
            beat = {}  # malformed: it counts as a heartbeat that did not move
        count = beat.get("count") if type(beat.get("count")) is int else None
        now = time.monotonic()
        if count != self.seen[0]:
            self.seen = (count, now)
        elif now - self.seen[1] > self.timeout:
            what = "has sent no heartbeat" if count is None else "has been silent"
            raise StoreError(f"the {self.peer} role {what} for {now - self.seen[1]:.0f}s (store {self.dir}); start "
                             f"it (python mgrpo.py --role {self.peer} --store ...), or restart it with --resume")
        return beat

    def wait_peer(self):
        """Block until the peer's heartbeat counter moves: it runs now, it is no earlier run's record."""
        first = self.check_peer().get("count", -1)
        while self.check_peer().get("count", -1) == first:
            time.sleep(0.1)

    def _beat(self):
        count, failing = 0, None
        while True:
            count += 1
            try:
                self._write(f"heartbeat-{self.role}", {"count": count, "pid": os.getpid(), "phase": self.phase,
                                                       "saved": self.saved})
                failing = None
            except OSError as e:
                if failing is None:
                    failing = time.monotonic()
                    print(f"warning: heartbeat write to {self.dir} failed ({e}); retrying", flush=True)
                elif time.monotonic() - failing > self.timeout / 2:  # before the peer gives up on this role
                    self.beat_error = f"heartbeat writes to {self.dir} kept failing for {self.timeout / 2:.0f}s: {e}"
                    return
            if self._stop.wait(1.0):
                return

    def close(self):
        self._stop.set()

    def prune(self, before):
        """Delete the records of phases before schedule index `before`, and temporary files
        that a writer killed mid-write left behind."""
        for name in os.listdir(self.dir):
            path = os.path.join(self.dir, name)
            m = re.fullmatch(r"p(\d+)-.*\.json", name)
            try:
                if (m and int(m.group(1)) < before) or (
                        name.endswith(".tmp") and time.time() - os.lstat(path).st_mtime > self.timeout):
                    os.remove(path)
            except OSError:  # the other role's rename got there first, or a planted directory
                pass


def schedule(args):
    """The phases both roles walk through in the same order: (kind, step, greedy)."""
    ph = [("eval", 0, False), ("eval", 0, True)]
    for s in range(1, args.steps + 1):
        ph.append(("step", s, False))
        if args.eval_every and s % args.eval_every == 0 and s < args.steps:
            ph.append(("eval", s, False))
    return ph + ([("eval", args.steps, False), ("eval", args.steps, True)] if args.steps else [])


def local_delegate(sub, args, search):
    """S in this process."""
    return lambda tasks, questions, seed, greedy: run_sub_agents(sub, tasks, questions, args, search, seed, greedy)


def conforms(x, schema):
    """Does a JSON value have this shape? schema: a type, a predicate, [item schema], (schema
    per item of a fixed-length list) or {key: schema}. bool is no int here."""
    if isinstance(schema, dict):
        return isinstance(x, dict) and all(k in x and conforms(x[k], s) for k, s in schema.items())
    if isinstance(schema, list):
        return isinstance(x, list) and all(conforms(v, schema[0]) for v in x)
    if isinstance(schema, tuple):
        return isinstance(x, list) and len(x) == len(schema) and all(conforms(v, s) for v, s in zip(x, schema))
    if isinstance(schema, type):
        return type(x) is int if schema is int else isinstance(x, schema)
    return schema(x)


QUESTIONS = [(int, lambda level: level in (1, 2))]  # (seed, level) of each question
TASKS = {"tasks": [str], "questions": QUESTIONS, "seed": int, "greedy": bool}
RESULTS = {"tasks": [str], "results": [(lambda r: r is None or isinstance(r, str), bool)]}
DONE = {"questions": QUESTIONS, "exchange": [{"query": int, "rollout": int, "correct": bool, "subs": [int]}]}


def store_record(store, key, rec, schema, ok=lambda rec: True):
    """rec if it has the shape that the peer writes (and ok(rec)); a store is untrusted input."""
    if not (conforms(rec, schema) and ok(rec)):
        raise StoreError(f"store {store.dir}: record {key} is not what the {store.peer} role writes; "
                         f"start both roles on an empty store (or another --run-id)")
    return rec


def remote_delegate(store, phase):
    """S in the other process: each turn's sub-tasks go to the store, S's results come back."""
    turns = itertools.count()

    def delegate(tasks, questions, seed, greedy):
        key = f"{phase}-t{next(turns)}"
        store.put(key + "-tasks", {"tasks": tasks, "questions": [[q.seed, q.level] for q in questions],
                                   "seed": seed, "greedy": greedy})
        key, rec = store.wait(key + "-results")
        rec = store_record(store, key, rec, RESULTS, lambda r: len(r["results"]) == len(tasks))
        if rec["tasks"] != tasks:  # a replay after a crash that did not sample the same tasks
            raise StoreError(f"store record {key} answers other sub-tasks than this run asked; "
                             f"restart both roles with --resume")
        return [Traj([], [], [], task=t, result=r, ok=ok) for t, (r, ok) in zip(tasks, rec["results"])]
    return delegate


def serve_sub(sub, store, args, search, start, on_step):
    """The sub role: answer every turn of every phase from schedule index `start` on, and
    take S's side of each training step when M's side has written its statistics."""
    for idx, (kind, step, greedy) in enumerate(schedule(args)):
        if idx < start:
            continue
        store.phase = idx
        phase, subs, t_gen = f"p{idx:06d}", [], 0.0
        t0, io0 = time.perf_counter(), store.io_time
        for turn in itertools.count():
            key, rec = store.wait(f"{phase}-t{turn}-tasks", f"{phase}-done")
            if key.endswith("-done"):
                break
            rec = store_record(store, key, rec, TASKS, lambda r: len(r["tasks"]) == len(r["questions"]))
            qs = [toy_tools.make_question(seed, level) for seed, level in rec["questions"]]
            t1 = time.perf_counter()
            trajs = run_sub_agents(sub, rec["tasks"], qs, args, search, rec["seed"], rec["greedy"])
            t_gen += time.perf_counter() - t1
            subs += trajs
            store.put(f"{phase}-t{turn}-results", {"tasks": rec["tasks"], "results": [[s.result, s.ok] for s in trajs]})
        out = None
        if kind == "step":
            rec = store_record(store, key, rec, DONE, lambda r: all(
                0 <= e["query"] < len(r["questions"]) and all(0 <= i < len(subs) for i in e["subs"])
                for e in r["exchange"]))
            qs = [toy_tools.make_question(seed, level) for seed, level in rec["questions"]]
            rs, _ = sub_step(sub, subs, rec["exchange"], qs, step, args)
            out = {"step": step, **rs, "t_step": time.perf_counter() - t0, "t_store": store.io_time - io0,
                   "t_gen_sub": t_gen, "gen_tokens_sub": sum(sum(s.mask) for s in subs)}
        on_step(idx, out)


# =======================================================================================
# Cold start: supervised warm-up on noisy scripted demos (stands in for stage 1)
# =======================================================================================
def encode_demo(agent, msgs, who):
    """A demo conversation as a Traj, built exactly as rollouts build contexts."""
    t = new_traj(agent, who, msgs[0]["content"])
    for msg in msgs[1:]:
        if msg["role"] == "assistant":
            ids = agent.tok(msg["content"], add_special_tokens=False).input_ids + [agent.end[0]]
            t.add(ids, [0.0] * len(ids))  # log-probs unused: the mask alone picks trained tokens
        else:
            t.add(message_ids(agent, msg["role"], msg["content"]))
    return t


def cold_start(agent, who, args, seed, steps=None):
    """Teacher-forced cross-entropy on mask-1 tokens of freshly generated demos; `steps`
    defaults to --sft-steps (its -1 to 600). Prints the loss and the time left now and then."""
    steps = steps if steps is not None else args.sft_steps if args.sft_steps >= 0 else 600
    demo_fn = {"main": toy_tools.main_demo, "sub": toy_tools.sub_demo, "single": toy_tools.single_demo}[who]
    opt = torch.optim.AdamW(agent.model.parameters(), lr=args.sft_lr, betas=(0.9, 0.98), weight_decay=0.0)
    rng = random.Random(seed)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.5 * (1 + math.cos(math.pi * i / steps)))
    levels = [int(x) for x in args.sft_levels.split(",")] if args.sft_levels else [args.level]
    t0, loss = time.time(), torch.tensor(0.0)
    for i in range(steps):
        demos = [demo_fn(toy_tools.make_question(rng.randrange(2 ** 31), levels[j % len(levels)]), rng,
                         args.demo_noise, chat=agent.chat) for j in range(args.sft_batch)]
        ids, attn, mask, _ = collate([encode_demo(agent, d, who) for d in demos], agent.pad_id, agent.model.device)
        agent.model.train(args.grad_checkpointing)
        with agent.autocast():
            loss = -(token_logprobs(agent.model, ids, attn) * mask).sum() / mask.sum()
        if not torch.isfinite(loss):  # before any checkpoint holds the broken weights
            raise FloatingPointError(f"non-finite loss {loss.item()} in the cold start of {who}, step {i + 1}")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(agent.model.parameters(), args.grad_clip)
        opt.step()
        sched.step()
        if (i + 1) % max(1, steps // 4) == 0 and i + 1 < steps:
            left = (time.time() - t0) / (i + 1) * (steps - i - 1)
            print(f"  cold start {who}: step {i + 1}/{steps}, loss {loss.item():.3f}, about {left:.0f}s left",
                  flush=True)
    agent.model.eval()
    return loss.item()


def cold_start_job(path, who, args, seed, steps):
    """A cold start in a process of its own (see `cold_start_all`): the agent saved at `path`,
    trained with one thread, saved back."""
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    agent = load_agent(path, args, seed=0)
    loss = cold_start(agent, who, args, seed, steps)
    agent.model.save_pretrained(path)
    return loss


def cold_start_all(agents, who, steps, args):
    """Every agent's cold start ({name: steps}); final losses. On a CPU with cores to spare
    they run at once, each in a process of its own with one thread: a tiny model uses a
    second thread poorly, and the agents share nothing. (Short ones do not pay a process start.)"""
    jobs = {n: s for n, s in steps.items() if s}
    seeds = {n: toy_tools.stable_seed(args.seed, "sft-" + n) for n in jobs}
    if len(jobs) < 2 or args.device != "cpu" or (os.cpu_count() or 1) < 2 or min(jobs.values()) < 100:
        return {n: cold_start(agents[n], who[n], args, seeds[n], s) for n, s in jobs.items()}
    with tempfile.TemporaryDirectory() as tmp, ProcessPoolExecutor(
            len(jobs), mp_context=multiprocessing.get_context("spawn")) as pool:
        for n in jobs:
            agents[n].model.save_pretrained(os.path.join(tmp, n))
            agents[n].tok.save_pretrained(os.path.join(tmp, n))
        futures = {n: pool.submit(cold_start_job, os.path.join(tmp, n), who[n], args, seeds[n], s)
                   for n, s in jobs.items()}
        losses = {n: f.result() for n, f in futures.items()}
        for n in jobs:
            trained = AutoModelForCausalLM.from_pretrained(os.path.join(tmp, n), dtype=torch.float32)
            agents[n].model.load_state_dict(trained.state_dict())
    return losses


# =======================================================================================
# Evaluation: sampled (temperature 1, as in training) and greedy success
# =======================================================================================
EVAL_SEED = 2 ** 40  # question seeds at or above this are never used for training


def evaluate(play, args, greedy=False, chunk=256):
    questions = [toy_tools.make_question(EVAL_SEED + i, args.level) for i in range(args.eval_questions)]
    ok = []
    for s in range(0, len(questions), chunk):
        qs = questions[s:s + chunk]
        mains, _ = play(qs, 1, toy_tools.stable_seed("eval", s), greedy)
        ok += [m.ok and toy_tools.answer_correct(q, m.result) for m, q in zip(mains, qs)]
    return float(np.mean(ok))


def paper_D(d_values, p=0.99):
    """The paper's rule: the smallest D with P(d_k <= D) >= p."""
    d = np.sort(np.asarray(d_values))
    return int(d[int(np.ceil(p * len(d))) - 1]) if len(d) else 0


# =======================================================================================
# Checkpoints: weights, optimizer, RNG, the unsync batch and the place in the schedule
# =======================================================================================
def checkpoints(out):
    """The checkpoint folders in <out>, oldest first."""
    names = os.listdir(out) if os.path.isdir(out) else []
    return [os.path.join(out, n) for n in sorted(n for n in names if re.fullmatch(r"ckpt-\d{8}", n))]


def save_checkpoint(out, agents, index, n_metrics):
    """<out>/ckpt-<index>: weights, tokenizers, optimizer and RNG states, the unsync batch and
    the place in the schedule, in a state.pt that loads with weights_only=True. Written to a
    temporary folder, then renamed: a kill at any moment leaves the earlier ones whole. The
    last two are kept, so an unreadable latest one has a fallback."""
    tmp = os.path.join(out, f"ckpt-tmp-{os.getpid()}-{secrets.token_hex(4)}")
    for name, a in agents.items():
        a.model.save_pretrained(os.path.join(tmp, name))
        a.tok.save_pretrained(os.path.join(tmp, name))
    np_state = np.random.get_state()
    torch.save({"index": index, "metrics_lines": n_metrics,
                "opt": {name: a.opt.state_dict() for name, a in agents.items()},
                "pending": {name: ([dataclasses.asdict(t) for t in a.pending[0]], a.pending[1].tolist())
                            for name, a in agents.items() if a.pending},
                "rng": {"python": random.getstate(), "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
                        "torch": torch.get_rng_state(),
                        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}},
               os.path.join(tmp, "state.pt"))
    final = os.path.join(out, f"ckpt-{index:08d}")
    shutil.rmtree(final, ignore_errors=True)  # one of the same index, from before a crash and --resume
    os.replace(tmp, final)
    for path in checkpoints(out)[:-2] + [os.path.join(out, n) for n in os.listdir(out) if n.startswith("ckpt-tmp-")]:
        shutil.rmtree(path, ignore_errors=True)  # older ones, and what saves killed midway left


def load_checkpoint(out, names, args):
    """(agents, schedule index, metrics lines) from the newest readable checkpoint in <out>,
    or None if there is none."""
    for path in reversed(checkpoints(out)):
        try:
            st = torch.load(os.path.join(path, "state.pt"), weights_only=True)  # never unpickles code
            agents = {}
            for name in names:
                a = agents[name] = load_agent(os.path.join(path, name), args, seed=0)
                a.opt.load_state_dict(st["opt"][name])
                if name in st["pending"]:
                    trajs, adv = st["pending"][name]
                    a.pending = ([Traj(**t) for t in trajs], torch.tensor(adv))
            rng = st["rng"]
            random.setstate((rng["python"][0], tuple(rng["python"][1]), rng["python"][2]))
            np.random.set_state((rng["numpy"][0], np.array(rng["numpy"][1], dtype=np.uint32), *rng["numpy"][2:]))
            torch.set_rng_state(rng["torch"])
            if rng["cuda"] and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])
            return agents, int(st["index"]), int(st["metrics_lines"])
        except Exception as e:  # noqa: BLE001  (a broken checkpoint of any kind: try the one before)
            print(f"checkpoint {path} cannot be loaded ({type(e).__name__}: {e}); trying the one before", flush=True)
    return None


# =======================================================================================
# The run: one process with both agents, or one role of two
# =======================================================================================
SHARED_ARGS = ("seed", "steps", "mode", "questions_per_step", "group_size", "max_sub", "level", "eval_every",
               "eval_questions", "unsync", "w_sub")  # what the two roles must agree on


def memory_estimate(agent, who, args):
    """A rough estimate of one agent's training memory in GiB, printed at start-up: (fp32
    weights, grads and AdamW states at 16 bytes a parameter, plus the frozen reference;
    activations and logits of one micro-batch of the longest contexts the limits allow)."""
    cfg = getattr(agent.model.config, "text_config", agent.model.config)
    n = sum(p.numel() for p in agent.model.parameters())
    turns = args.sub_max_turns if who == "sub" else args.main_max_turns
    obs = 30 if who == "main" else (args.visit_max_chars // 3 if agent.chat else 60)  # tokens per tool result
    T = len(prompt_ids(agent, who, "x" * 40)) + turns * (max_new(agent, args) + obs)
    B = args.questions_per_step * args.group_size * (args.max_sub if who == "sub" else 1)
    mb = min(args.micro_batch or B, B)
    # per token: activations (~34 h bytes a layer in 16 bits, ~2 h kept with checkpointing),
    # and logits in bf16 or fp32 + their fp32 log-softmax + its gradient (~10-12 bytes a vocab entry)
    act = cfg.num_hidden_layers * cfg.hidden_size * (2 if args.grad_checkpointing else 34) * (1 if agent.bf16 else 2)
    per_tok = act + (10 if agent.bf16 else 12) * cfg.vocab_size
    static = n * (16 + (2 if agent.bf16 else 4) * (args.kl_coef > 0))
    return static / 2 ** 30, mb * T * per_tok / 2 ** 30, mb, T


def progress_line(rec, steps):
    if "eval" in rec:
        return f"eval after step {rec['step']}: {rec['eval']} success {rec['eval_success']:.3f}"
    parts = [f"step {rec['step']:4d}/{steps}"]
    if "main_reward" in rec:
        parts.append(f"R_M {rec['main_reward']:.3f} success {rec['success']:.3f} "
                     f"zero-var M {rec['zero_var_main']:.2f}")
    if "sub_reward" in rec:
        parts.append(f"R_S {rec['sub_reward']:.3f} zero-var S {rec['zero_var_sub']:.2f} "
                     f"dup {rec['n_dup']} drop {rec['n_drop']}")
    if "approx_kl_main" in rec:
        parts.append(f"kl {rec['approx_kl_main']:.1e} gn {rec['grad_norm_main']:.2f}")
    if "t_step" in rec:
        parts.append(f"{rec['t_step']:.2f}s")
    if "t_store" in rec and rec.get("t_step"):
        parts.append(f"store {100 * rec['t_store'] / rec['t_step']:.1f}%")
    return " | ".join(parts)


def main(argv=None):
    args = parse_args(argv)
    transformers.utils.logging.disable_progress_bar()
    t_start = time.time()
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    tag = "" if args.role == "both" else "-" + args.role
    out = args.out or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S") + f"-seed{args.seed}{tag}")
    os.makedirs(out, exist_ok=True)
    names = {"both": ["main", "sub"], "main": ["main"], "sub": ["sub"]}[args.role]
    if args.mode == "single-agent":
        names = ["main"]  # the single agent takes the main agent's place (and folder)
    if args.role != "both" and args.device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))  # two roles share the cores
    store = FileStore(args.store, args.run_id, args.role, args.peer_timeout,
                      args.progress_timeout) if args.role != "both" else None
    try:
        return run(args, out, names, store, t_start)
    finally:
        if store:
            store.close()


def run(args, out, names, store, t_start):
    search = toy_tools.ToySearch() if args.search == "toy" else toy_tools.HttpSearch(
        args.search, args.search_timeout, args.search_retries, visit_hosts=[h for h in args.visit_hosts.split(",") if h])
    if "sub" in names or args.mode == "single-agent":
        try:  # a server that is down fails here, clearly, before any training
            search.search("ada", 0, 1)
        except toy_tools.SearchError as e:
            raise toy_tools.SearchError(f"{e}; the toy server starts with: python toy_tools.py serve --port PORT")
    shared = json.loads(json.dumps({k: getattr(args, k) for k in SHARED_ARGS}))  # as the store holds it
    if store and args.role == "main":
        run_rec = store.read("run")
        if not args.resume and run_rec is not None:
            raise StoreError(f"the store {store.dir} holds an earlier run; use --resume, another --run-id "
                               f"or an empty store")
        if run_rec is not None and run_rec != shared:
            raise StoreError(f"--resume with other settings than the run in {store.dir}: {run_rec}")
        store.put("run", shared)
    if store and args.role == "sub":
        if not args.resume:
            store.wait_peer()  # a live main role, not the records of an earlier run
        _, run_rec = store.wait("run")
        if run_rec != shared:
            diff = {k: (v, shared.get(k)) for k, v in run_rec.items() if shared.get(k) != v}
            raise StoreError(f"the sub role's settings differ from the main role's (main, sub): {diff}")

    ckpt = load_checkpoint(out, names, args) if args.resume else None
    if ckpt:
        agents, start, n_lines = ckpt
        path = os.path.join(out, "metrics.jsonl")
        with open(path) as f:
            kept = f.readlines()[:n_lines]  # drop lines of steps after the checkpoint
        with open(path + ".tmp", "w") as f:
            f.writelines(kept)
        os.replace(path + ".tmp", path)  # atomically: a kill now leaves one whole file
        print(f"resumed from {out} at schedule position {start}", flush=True)
    else:
        if args.resume:
            print(f"no checkpoint in {out}: starting afresh", flush=True)
        start, n_lines = 0, 0
        model_names = {"main": args.main_model, "sub": args.sub_model}
        agents = {n: load_agent(model_names[n], args, seed=args.seed + (n == "sub")) for n in names}
        with open(os.path.join(out, "args.json"), "w") as f:
            json.dump(dataclasses.asdict(args), f, indent=1)
        open(os.path.join(out, "metrics.jsonl"), "w").close()
    n_params = {n: sum(p.numel() for p in a.model.parameters()) / 1e6 for n, a in agents.items()}
    print(f"M-GRPO | role {args.role} | " + ", ".join(f"{n} {p:.2f}M params" for n, p in n_params.items())
          + f" | {args.mode} K={args.group_size} D={args.max_sub} level={args.level} device={args.device}"
          + f" {args.dtype}" + (" unsync" if args.unsync else "") + f" | out: {out}", flush=True)
    who = {"main": "single" if args.mode == "single-agent" else "main", "sub": "sub"}
    for n, a in agents.items():
        static, act, mb, T = memory_estimate(a, who[n], args)
        print(f"memory estimate, {n}: {static + act:.2f} GiB = {static:.2f} weights, grads, AdamW"
              + (", reference" if args.kl_coef else "") + f" + {act:.2f} one micro-batch ({mb} x up to {T} tokens;"
              " --micro-batch and --grad-checkpointing lower it)", flush=True)

    given = {"main": args.main_model, "sub": args.sub_model}
    if any(given[n] for n in names):
        print("a model given by name or path: " + ("no cold start" if args.sft_steps == -1 else
              f"{args.sft_steps} cold-start steps") + f" for it, {args.eval_questions} questions per evaluation, "
              f"{max_new(agents[names[0]], args)} new tokens per turn (--sft-steps, --eval-questions, "
              "--max-new-tokens change them)", flush=True)
    sft = {n: args.sft_steps if args.sft_steps >= 0 else 0 if given[n] else 600 for n in names}
    if not ckpt and any(sft.values()):
        t0 = time.time()
        losses = cold_start_all(agents, who, sft, args)
        print("cold start on noisy demos, final loss " + " ".join(f"{n} {v:.3f} ({sft[n]} steps)" for n, v in
                                                                  losses.items()) + f" ({time.time() - t0:.0f}s)",
              flush=True)
    if not ckpt:
        save_checkpoint(out, agents, 0, 0)
    if args.kl_coef:  # the frozen reference: each agent as RL starts (after the cold start)
        for n, a in agents.items():
            path = os.path.join(out, "ref", n)
            if not ckpt:
                a.model.save_pretrained(path)
            a.ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16 if a.bf16 else torch.float32)
            a.ref.to(args.device).eval().requires_grad_(False)

    metrics = open(os.path.join(out, "metrics.jsonl"), "a")
    plan = schedule(args)

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
            serve_sub(agents["sub"], store, args, search, start, finish_phase)
        else:
            main_agent, sub_agent = agents["main"], agents.get("sub")
            for idx, (kind, step, greedy) in enumerate(plan):
                if idx < start:
                    continue
                phase = f"p{idx:06d}"
                if store:
                    store.phase = idx
                delegate = remote_delegate(store, phase) if store else local_delegate(sub_agent, args, search)
                play = system(main_agent, delegate, args, search)
                io0 = store.io_time if store else 0.0
                if kind == "eval":
                    rec = {"step": step, "eval": "greedy" if greedy else "sampled",
                           "eval_success": evaluate(play, args, greedy)}
                    if store:
                        store.put(f"{phase}-done", {})
                else:
                    rec = train_step(main_agent, play, step, args, sub_agent, store, phase)
                if store:
                    rec["t_store"] = store.io_time - io0
                finish_phase(idx, rec)
    finally:
        metrics.close()

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
    if store:
        t_step = sum(r["t_step"] for r in steps)
        summary["store_share_of_step_time"] = sum(r.get("t_store", 0.0) for r in steps) / max(t_step, 1e-9)
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
    if store:
        print(f"store: {100 * summary['store_share_of_step_time']:.1f}% of step time in reads and writes")
    if torch.device(args.device).type == "cuda":
        summary["peak_gpu_mem_gib"] = torch.cuda.max_memory_allocated(args.device) / 2 ** 30
        print(f"peak GPU memory of this process: {summary['peak_gpu_mem_gib']:.2f} GiB")
    print(f"{summary['wall_time_s']:.0f}s in all | {out}", flush=True)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary


if __name__ == "__main__":
    main()
