"""The agents as mgrpo.py sees them: a model with its own tokenizer and optimizer (`Agent`, `load_agent`),
the token ids of a conversation grown message by message through the model's chat template, and the
trajectory that records them (`Traj`). The models built in code, and their tokenizers, are in
tiny_models.py.

Contexts grow by appending ids, never by re-rendering and re-tokenising the conversation, so the ids
trained on are exactly the ids sampled. A message's ids are cut from a render in which an assistant
turn precedes it: templates render a message alone with a default system prompt (Qwen2.5), or render
the last assistant turn differently (Qwen3).
"""
import contextlib
import functools
import json
import os
import re
import warnings
from dataclasses import dataclass, field

import torch
import transformers
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

import smollm2
from tiny_models import WORD_TEMPLATE, build_model, chat_tokenizer, freeze_uniform, word_tokenizer
from tools import CHAT_TOOLS, TOOLS

# ---------------------------------------------------------------------------------------
# An agent: model, tokenizer, optimizer; nothing is shared with the other agent
# ---------------------------------------------------------------------------------------
def load_tokenizer(name):
    """A tokenizer by name or path, encoding as it was saved. transformers rebuilds the tokenizer of a
    known model type from its own class (a Qwen2 model's: Qwen's split of digits and spaces), not from
    the saved pipeline; a folder whose tokenizer.json says otherwise (a --chat model saved before these
    split as Qwen2's, say) is loaded as that file says, or the model would read other ids than it was
    trained on."""
    path = os.path.join(name, "tokenizer.json")
    try:
        tok = AutoTokenizer.from_pretrained(name)
        if os.path.isfile(path) and tok.backend_tokenizer.to_str() != Tokenizer.from_file(path).to_str():
            tok = transformers.PreTrainedTokenizerFast.from_pretrained(name)
    except Exception as e:  # the Rust tokenizer raises a bare Exception on a broken file
        if not os.path.isdir(name) or isinstance(e, OSError):  # a hub name: its own message says it all
            raise
        raise ValueError(f"{name}: its tokenizer files cannot be read ({type(e).__name__}: {str(e)[:200]})") from None
    return tok


@dataclass
class Agent:
    model: torch.nn.Module
    tok: object
    opt: torch.optim.Optimizer = None
    stop_ids: tuple = ()   # token ids that end a turn
    suppress: tuple = ()   # never sampled: pad and unk would look like padding
    pad_id: int = 0        # the tokenizer's pad, else its eos (padding is found by length anyway)
    end: tuple = (0, 0)    # (id, length of its text) of the stop token that closes an assistant turn
    max_new: int = 12      # new tokens per turn; a turn not ended by then is invalid
    max_context: int = 0   # tokens a conversation may hold (--max-context); 0: no limit
    chat: bool = False     # a chat model: tools in the system prompt, <tool_call> JSON (else word-level tags)
    system: dict = None    # chat models: the task's system prompt per agent kind (main, sub, single)
    tools: dict = None     # chat models: the tools' JSON schemas by name, the task's (TOOLS) or tools.TOOLS
    bf16: bool = False     # --dtype bfloat16: autocast over fp32 weights; sampling from a bf16 copy
    copy: list = None      # --dtype bfloat16: [weights version, the bf16 copy that samples] (sampling.sampler)
    ref: torch.nn.Module = None  # --kl-coef: the frozen reference
    pending: tuple = None  # --mode unsync: (batch, advantages) of the previous step, not yet trained on
    skipped: int = 0       # updates in a row with a step skipped for a non-finite loss or gradient
    graphs: dict = None    # on a GPU: (rows, cache slots) -> its CUDA graph's decoder (cuda_graphs.py)
    recompute: bool = False  # --grad-checkpointing: activations recomputed in the backward pass
    peft: object = None    # --lora-rank: the PeftModel around `model` (saves the adapter, switches it off)
    splits: dict = field(default_factory=dict)  # (template, kind of text) -> its (head, tail), or None
    prefixes: dict = field(default_factory=dict)  # a shared prompt's ids -> (weights version, its KV)

    def autocast(self, cache_enabled=True):  # a CUDA graph's capture needs cache_enabled=False
        return torch.autocast(self.model.device.type, dtype=torch.bfloat16, enabled=self.bf16,
                              cache_enabled=cache_enabled)

    @contextlib.contextmanager
    def training(self):
        """The model while it updates: in eval mode, as it samples, so that both see the same policy;
        in train mode only where activations are recomputed, which Hugging Face does in train mode
        alone (the model has no dropout: load_agent checks)."""
        self.model.train(self.recompute)
        try:
            yield
        finally:
            self.model.eval()


def checkpoint_activations(model, name):
    """--grad-checkpointing: Hugging Face recomputes only in train mode, which must then change nothing else."""
    dropout = getattr(model.config, "attention_dropout", 0.0)
    if dropout or any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()):
        raise ValueError(f"--grad-checkpointing trains in train mode, and {name or 'the model'} has dropout")
    if hasattr(model, "activation_checkpointing_enable"):  # the name from transformers 5.2x on
        model.activation_checkpointing_enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def turn_end(tok, stop, name):
    """(id, length of its text) of the stop token that closes an assistant turn in the template."""
    after = message_text(tok, "user", "?")
    for i in sorted(stop):
        text = tok.decode([i])
        m = re.match(r"\s*" + re.escape(text), after) if text else None
        if m:
            return i, m.end()
    raise ValueError(f"{name}: the chat template ends an assistant turn with {after[:30]!r}, which starts "
                     f"with none of the stop tokens {[tok.decode([i]) for i in sorted(stop)]}")


BF16_FLAGS = {"amx_bf16", "avx512_bf16"}  # a CPU's flags for bf16 matmuls in hardware
BF16_MIN_PARAMS = 10_000_000  # --dtype auto: bf16 from this size; a smaller model's forward is overhead, not FLOPs


def cpu_flags():
    """The CPU's feature flags (Linux), or an empty set where they cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line for line in f if line.startswith("flags")), ":").split(":", 1)[1].split())
    except OSError:
        return set()


def bf16_hardware(device):
    """What makes `device` multiply in bf16 much faster than in fp32, or [] where nothing does: a CPU's AMX or
    AVX512-BF16 flags, or a CUDA GPU with bf16. Without them torch runs a CPU's bf16 matmuls by a generic
    kernel, many times slower than fp32's."""
    if torch.device(device).type == "cuda":  # bf16 in the tensor cores from compute capability 8 (Ampere) on
        fast = torch.cuda.is_available() and torch.cuda.get_device_capability(torch.device(device)) >= (8, 0)
        return ["a GPU with bf16"] if fast else []
    return sorted(BF16_FLAGS & cpu_flags())


def use_bf16(dtype, model, device):
    """--dtype for one model: bfloat16, float32, or auto: bf16 for a model of BF16_MIN_PARAMS or more where the
    device multiplies bf16 fast (so fp32 for the tiny models built here, whose experiments ran in fp32, but
    for the largest of them, --model-size 30M)."""
    if dtype != "auto":
        return dtype == "bfloat16"
    return sum(p.numel() for p in model.parameters()) >= BF16_MIN_PARAMS and bool(bf16_hardware(device))


def load_agent(name, args, task, seed=0, lr=None):
    """A model by Hugging Face name or path ("smollm2": SmolLM2-135M-Instruct, smollm2.py), or (name
    empty) a tiny one built in code from `seed`, with
    its tokenizer, its own AdamW (lr: default M's --lr), and what sampling needs to know of its tokens.
    args: the run's settings it reads (chat, model_size, cold_start, device, dtype, lr, weight_decay,
    max_new_tokens, grad_checkpointing); task: the task, whose words and prompts it uses. On a GPU it
    decodes with CUDA graphs (sampling.generate falls back to eager decoding if they fail)."""
    peft, name = None, smollm2.resolve(name)
    if name and os.path.isfile(os.path.join(name, "adapter_config.json")):  # a LoRA adapter over its base
        tok, (model, peft) = load_tokenizer(name), load_adapter(name, args)
    elif name:
        tok = load_tokenizer(name)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32)  # fp32 master weights
        freeze_uniform(model)  # one built here and saved: its first layer is frozen anew
    else:
        tok = chat_tokenizer(task) if args.chat else word_tokenizer(task.WORDS)
        model = build_model(tok, args.model_size, args.chat, seed, args.cold_start.uniform_first_layer)
    if not tok.chat_template:
        raise ValueError(f"{name}: the tokenizer has no chat template; the agents need one (an instruct model)")
    for key in ("final_logit_softcapping", "logit_scale"):  # training runs the head itself (token_logprobs)
        if getattr(model.config, key, None) not in (None, 1, 1.0):
            raise ValueError(f"{name}: a model whose {key} changes its logits after the head is not supported")
    model.to(args.device).eval()  # eval: no dropout, so sampling and training log-probs agree
    if args.grad_checkpointing:
        checkpoint_activations(model, name)
    eos = model.generation_config.eos_token_id
    stop = {tok.eos_token_id, *(eos if isinstance(eos, list) else [eos])} - {None}
    chat = tok.chat_template != WORD_TEMPLATE
    opt = adamw(model, lr or args.lr[0], args.weight_decay)
    return Agent(model, tok, opt, peft=peft, stop_ids=tuple(sorted(stop)),
                 suppress=tuple(sorted({tok.pad_token_id, tok.unk_token_id} - stop - {None})),
                 pad_id=tok.pad_token_id if tok.pad_token_id is not None else min(stop),
                 end=turn_end(tok, stop, name), max_new=args.max_new_tokens or (256 if chat else 12), chat=chat,
                 max_context=args.max_context, system=task.SYSTEM if chat else None,
                 tools=getattr(task, "TOOLS", TOOLS), bf16=use_bf16(args.dtype, model, args.device),
                 graphs={} if model.device.type == "cuda" else None, recompute=args.grad_checkpointing)


# ---------------------------------------------------------------------------------------
# LoRA (--lora-rank): a frozen base and an adapter of each agent's own, through peft
# ---------------------------------------------------------------------------------------
def add_adapter(agent, rank, base):
    """Freeze the agent's model (in bf16 where agent.bf16, else as loaded) and put a LoRA adapter of
    this rank on all its linear layers but the head (alpha 2 x rank), trained in fp32 by a new AdamW with
    the old one's settings. base: where the frozen base loads from (a name or a folder), kept in the
    adapter's config, so that a saved adapter loads with peft alone (AutoPeftModelForCausalLM)."""
    from peft import LoraConfig, get_peft_model
    agent.model.zero_grad(set_to_none=True)  # a stale gradient on the base would count in every clip
    if agent.bf16:
        agent.model.to(torch.bfloat16)
    with quiet_peft():
        agent.peft = get_peft_model(agent.model, LoraConfig(  # adapters in fp32: peft's autocast_adapter_dtype
            r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules="all-linear"))
    agent.peft.peft_config["default"].base_model_name_or_path = base
    agent.model = agent.peft.get_base_model()  # the model itself, its linear layers now with adapters
    agent.opt = adamw(agent.model, agent.opt.defaults["lr"], agent.opt.defaults["weight_decay"])
    agent.copy, agent.prefixes = None, {}  # what sampled the model without adapters: its bf16 copy, prompt KV
    agent.graphs = None if agent.graphs is None else {}  # and its CUDA graphs


def adamw(model, lr, weight_decay):
    """An agent's own AdamW, over the parameters it trains (with LoRA: the adapter's)."""
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, betas=(0.9, 0.98),
                             weight_decay=weight_decay)


def optimizer_state(opt):
    """A copy of the optimizer's per-weight state (AdamW: step, moments), for restore_state."""
    return {p: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()} for p, s in opt.state.items()}


def restore_state(opt, state):
    for p in list(opt.state):
        if p in state:
            opt.state[p] = state[p]
        else:  # no state before: the step was the first
            del opt.state[p]


@contextlib.contextmanager
def quiet_peft():
    """peft reads a transformers attribute deprecated in 5.x: its FutureWarning is not the user's."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield


def load_adapter(path, args):
    """(model with the adapter in it, its PeftModel) of a saved LoRA adapter: the base named in its
    config, frozen in bf16 where --dtype asks for it (use_bf16), else fp32, the adapter trainable, in fp32."""
    from peft import PeftConfig, PeftModel
    base = PeftConfig.from_pretrained(path).base_model_name_or_path
    if not isinstance(base, str) or not base:
        raise ValueError(f"{path}: the adapter's config names no base model")
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32  # auto: decided once loaded
    model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
    if use_bf16(args.dtype, model, args.device):
        model.to(torch.bfloat16)
    with quiet_peft():
        peft = PeftModel.from_pretrained(model, path, is_trainable=True)
    return peft.get_base_model(), peft


def share_base(agents):
    """LoRA on one given base for both agents in one process: the sub-agent's frozen weights become the
    main agent's (the same tensors, held once); each keeps its adapter. The two bases must be equal,
    parameter by parameter."""
    main, sub = agents["main"].model, agents["sub"].model
    mods = dict(main.named_modules())
    for name, m in sub.named_modules():
        for key, p in list(m.named_parameters(recurse=False)):
            if not p.requires_grad:
                q = getattr(mods.get(name), key, None)
                if q is None or q.shape != p.shape or q.requires_grad or not torch.equal(q, p):
                    raise ValueError(f"one base for two adapters: the agents' bases differ at {name}.{key}")
                m._parameters[key] = q


# ---------------------------------------------------------------------------------------
# Contexts as ids, through the chat template
# ---------------------------------------------------------------------------------------
MARK = "@@MARK@@"


def prompt_text(tok, kind, content, system=None, schemas=TOOLS):
    """The template's text of a new conversation of agent `kind` (main, sub, single): the system prompt
    with the agent's tools (chat models; schemas: each tool's by name), the user's `content`, the
    assistant prompt."""
    msgs, kw = [{"role": "user", "content": content}], {}
    if system:
        tools = [schemas[n] for n in CHAT_TOOLS[kind]]
        text = system[kind]
        if "tools" in tok.chat_template:
            kw["tools"] = tools
        else:  # a template that cannot list tools: they go into the system prompt as JSON
            text += "\nTools:\n" + "\n".join(json.dumps(t) for t in tools)
        msgs.insert(0, {"role": "system", "content": text})
    return tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, **kw)


def message_text(tok, role, content, end=0):
    """The template's text after an assistant turn's content, less the `end` characters of its closing
    token (which the model sampled): a `role` message (tool, user) and the next assistant prompt."""
    text = tok.apply_chat_template([{"role": "user", "content": "?"}, {"role": "assistant", "content": MARK},
                                    {"role": role, "content": content}], add_generation_prompt=True, tokenize=False)
    return text[text.index(MARK) + len(MARK) + end:]


def template_ids(agent, key, render, content):
    """Token ids of render(content). A template that pastes the content in unchanged is rendered once
    per key, as head + content + tail (checked on two probes); one that transforms it (trims it, say)
    is rendered for every call."""
    content = content.encode("utf-8", "replace").decode("utf-8")  # no lone surrogate reaches a tokenizer
    if (agent.tok.chat_template, key) not in agent.splits:
        a, b = "\x01A\x01", " \n\x02B \x02\n "
        ra, rb = render(a), render(b)
        head, _, tail = ra.partition(a)
        agent.splits[agent.tok.chat_template, key] = (head, tail) if a in ra and rb == head + b + tail else None
    split = agent.splits[agent.tok.chat_template, key]
    marks = marks_in(agent, content)
    if marks and not (split and pieces_ok(agent)):  # the spellings broken by an invisible joiner instead
        content, marks = joined(content, marks), []
    text = split[0] + content + split[1] if split else render(content)
    if not marks:
        return agent.tok(text, add_special_tokens=False).input_ids
    return plain_ids(agent.tok, text, len(split[0]), len(split[0]) + len(content), marks)


FORMAT_TAGS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<answer>", "</answer>",
               "<think>", "</think>")


def marks_in(agent, text, tags=True):
    """The spellings, in outside `text`, of the tokenizer's special tokens ('<|im_end|>', '<eos>') and (tags) of
    the format's tags where they are added tokens ('<tool_call>'): the tokenizer would read each as its token,
    and a passage could end the turn and write the model's next one. The spellings are found once per
    tokenizer (a tool result's ids are made at every turn)."""
    key = (agent.tok.chat_template, "marks", tags)
    if key not in agent.splits:
        added = agent.tok.added_tokens_decoder.values()
        agent.splits[key] = [t.content for t in added if t.content and (t.special or tags and t.content in FORMAT_TAGS)]
    return [m for m in agent.splits[key] if m in text]


def joined(text, marks):
    """text with a word joiner (U+2060, invisible) after the first character of each spelling of a mark."""
    spelled = "|".join(map(re.escape, sorted(marks, key=len, reverse=True)))
    return re.sub(spelled, lambda m: m.group(0)[0] + "\u2060" + m.group(0)[1:], text)


def pieces_ok(agent):
    """Does the tokenizer give back text tokenized in pieces exactly (byte-level BPE does; SentencePiece's
    Metaspace puts a space before each piece)? Then plain_ids spells marks exactly, else they are joined."""
    key = (agent.tok.chat_template, "pieces")
    if key not in agent.splits:
        ids = lambda t: agent.tok(t, add_special_tokens=False).input_ids  # noqa: E731
        agent.splits[key] = agent.tok.decode(ids("x <") + ids("|y\n z")) == "x <|y\n z"
    return agent.splits[key]


def outside_ids(agent, text, tags=True):
    """Ids of `text` whose spellings of structural tokens (marks_in) enter as text; tags=False: the format's own
    tags stay tokens (an assistant turn that the model writes, as a cold-start demo shows it)."""
    marks = marks_in(agent, text, tags)
    if marks and pieces_ok(agent):
        return plain_ids(agent.tok, text, 0, len(text), marks)
    return agent.tok(joined(text, marks) if marks else text, add_special_tokens=False).input_ids


def plain_ids(tok, text, start, end, marks):
    """Ids of `text` in which outside text, text[start:end], enters as text: each spelling of a mark in it is
    tokenized apart, as its first character and the rest; the template's own tokens, outside [start, end),
    stay tokens."""
    ids, i = (lambda t: tok(t, add_special_tokens=False).input_ids), 0
    if not marks:
        return ids(text)
    out, spelled = [], re.compile("|".join(map(re.escape, sorted(marks, key=len, reverse=True))))
    for m in spelled.finditer(text, start, end):
        rest = m.group(0)[1:]  # at worst itself an added token's text: spelled apart in turn
        out += ids(text[i:m.start()]) + ids(m.group(0)[0])
        out += plain_ids(tok, rest, 0, len(rest), [x for x in marks if x in rest])
        i = m.end()
    return out + ids(text[i:])


def prompt_ids(agent, kind, content):
    """Ids of a new conversation of agent `kind` (main, sub, single) whose user message is `content`."""
    render = functools.partial(prompt_text, agent.tok, kind, system=agent.system, schemas=agent.tools or TOOLS)
    return template_ids(agent, ("prompt", kind), render, content)


def message_ids(agent, role, content):
    """Ids of one message (a tool result) and the next assistant prompt, to append after an assistant
    turn, which ends with the stop token the model sampled (`agent.end`)."""
    render = functools.partial(message_text, agent.tok, role, end=agent.end[1])
    return template_ids(agent, ("message", role), render, content)


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
    reads: list = field(default_factory=list)  # the tool results it read, as text (S's: r_expert's evidence)

    def add(self, ids, logp=None):
        """Append ids: sampled ones with their log-probs (mask 1), or inserted ones (mask 0)."""
        self.ids += ids
        self.mask += [0 if logp is None else 1] * len(ids)
        self.logp += [0.0] * len(ids) if logp is None else logp


def new_traj(agent, kind, content, **kw):
    ids = prompt_ids(agent, kind, content)
    return Traj(ids, [0] * len(ids), [0.0] * len(ids), **kw)
