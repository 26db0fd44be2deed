"""The agents as mgrpo.py sees them: a model with its own tokenizer and optimizer (`Agent`, `load_agent`),
the token ids of a conversation grown message by message through the model's chat template, and the
trajectory that records them (`Traj`). Also the tokenizers of the tiny models built in code: a
word-level one, and a byte-level BPE one with a Qwen-style template (`--chat`).

Contexts grow by appending ids, never by re-rendering and re-tokenising the conversation, so the ids
trained on are exactly the ids sampled. A message's ids are cut from a render in which an assistant
turn precedes it: templates render a message alone with a default system prompt (Qwen2.5), or render
the last assistant turn differently (Qwen3).
"""
import contextlib
import functools
import json
import os
import random
import re
import warnings
from dataclasses import dataclass, field

import torch
import transformers
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from tools import CHAT_TOOLS, TOOLS

# ---------------------------------------------------------------------------------------
# Tokenizers of the models built in code
# ---------------------------------------------------------------------------------------
SPECIAL = ["<pad>", "<eos>", "<unk>"]
STRUCTURE = ["<system>", "<user>", "<assistant>", "<tool>", "<think>", "</think>", "<call>", "</call>",
             "<answer>", "</answer>", "<search>", "</search>", "<return>", "</return>"]
# Renders each message on its own, so a context can be grown one message at a time and equal the
# render of the whole conversation (see tests).
WORD_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}"
                 "{% if m['role'] == 'assistant' %} <eos>{% endif %} {% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def word_tokenizer(words):
    """A word-level Hugging Face tokenizer over the tags and a task's words, with a chat template."""
    from tokenizers import models, pre_tokenizers
    words = list(words) + [w for w in (";", "none") if w not in words]  # search_observation's, rollout's
    vocab = {w: i for i, w in enumerate(SPECIAL + STRUCTURE + words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    t = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                             unk_token="<unk>", padding_side="left")
    t.chat_template = WORD_TEMPLATE
    return t


# A Qwen-style chat template (ChatML turns, tools listed in the system prompt, tool results as
# <tool_response> in a user turn, a default system prompt): the models that `--chat` builds use it.
QWEN_STYLE_TEMPLATE = (  # (the tokenizer's jinja drops a newline right after a tag: newlines are in {{ }})
    "{%- if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] %}"
    "{%- else %}{% set sys = 'You are a helpful assistant.' %}{% endif %}"
    "<|im_start|>system{{ '\\n' + sys }}"
    "{%- if tools %}{{ '\\n\\n# Tools\\n\\nYou may call one of these functions:\\n<tools>' }}"
    "{%- for t in tools %}{{ '\\n' + t | tojson }}{% endfor %}"
    "{{ '\\n</tools>\\n\\nCall one as:\\n<tool_call>\\n' }}"
    '{"name": <function-name>, "arguments": <args-json-object>}{{ "\\n</tool_call>" }}{% endif %}'
    "{{ '<|im_end|>\\n' }}"
    "{%- for m in messages if m['role'] != 'system' %}"
    "{%- if m['role'] == 'tool' %}"
    "{%- if loop.first or loop.previtem['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or loop.nextitem['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{%- else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CHAT_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<answer>", "</answer>",
              "<think>", "</think>"]


QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def chat_tokenizer(task, vocab_size=768):
    """A byte-level BPE tokenizer in Qwen's style (pad <|endoftext|>, eos <|im_end|>), its merges learned
    in a second from a task's conversations, with the Qwen-style template."""
    from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, trainers
    rng = random.Random(0)
    corpus = [task.SYSTEM[w] + json.dumps([TOOLS[n] for n in CHAT_TOOLS[w]]) for w in task.SYSTEM]
    corpus += 50 * [QWEN_STYLE_TEMPLATE, "system\nuser\nassistant\n"]
    for s in range(300):
        try:
            q = task.make_question(s, 1 + s % 2)
        except ValueError:  # a task with one level
            q = task.make_question(s, 1)
        corpus += [m["content"] for kind in ("main", "single", "sub") for m in task.demo(q, rng, 0.2, kind, True)]
    tok = Tokenizer(models.BPE())
    # Qwen2's own normalizer and split (each digit alone, newlines apart from words): what transformers
    # rebuilds when it loads a Qwen2 model, so that any loader reads the ids these models were trained on
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN_SPLIT), "isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=CHAT_SPECIAL, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_tokens([AddedToken(t, normalized=False) for t in CHAT_ADDED])
    t = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                                             padding_side="left")
    t.chat_template = QWEN_STYLE_TEMPLATE
    return t


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


# ---------------------------------------------------------------------------------------
# An agent: model, tokenizer, optimizer; nothing is shared with the other agent
# ---------------------------------------------------------------------------------------
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
    chat: bool = False     # a chat model: tools in the system prompt, <tool_call> JSON (else word-level tags)
    system: dict = None    # chat models: the task's system prompt per agent kind (main, sub, single)
    bf16: bool = False     # --dtype bfloat16: autocast over fp32 weights
    ref: torch.nn.Module = None  # --kl-coef: the frozen reference
    pending: tuple = None  # --unsync: (batch, advantages) of the previous step, not yet trained on
    skipped: int = 0       # updates in a row with a step skipped for a non-finite loss or gradient
    graphs: dict = None    # --cuda-graphs on a GPU: (rows, cache slots) -> GraphDecoder
    peft: object = None    # --lora-rank: the PeftModel around `model` (saves the adapter, switches it off)
    splits: dict = field(default_factory=dict)  # (template, kind of text) -> its (head, tail), or None
    prefixes: dict = field(default_factory=dict)  # a shared prompt's ids -> (weights version, its KV)

    def autocast(self, cache_enabled=True):  # a CUDA graph's capture needs cache_enabled=False
        return torch.autocast(self.model.device.type, dtype=torch.bfloat16, enabled=self.bf16,
                              cache_enabled=cache_enabled)


SIZES = {  # models built here: (hidden, layers, heads, kv heads, MLP)
    "0.1M": (64, 2, 8, 4, 192), "0.2M": (96, 2, 8, 4, 256),
    # 0.4M: the comparisons' stage 1 (scripts/compare.py), whose level-3 lists a 2-layer model learned
    # to read by some seeds and not others; heads of 24 dims, not 12, and 4 layers (docs/experiments.md)
    "0.4M": (96, 4, 4, 2, 256), "1M": (128, 4, 4, 2, 512), "4M": (256, 4, 8, 4, 1024), "30M": (512, 8, 8, 4, 1536)}


def build_model(tok, size, chat, seed, uniform=False):
    """A tiny model with random weights: Qwen2 for chat models, else Llama (a saved "qwen2" folder
    would load Qwen2's BPE tokenizer over the word-level vocabulary). uniform: its first layer's
    attention held uniform (freeze_uniform)."""
    torch.manual_seed(seed)
    shape = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size")
    cfg = dict(zip(shape, SIZES[size]), vocab_size=len(tok), tie_word_embeddings=False, bos_token_id=None,
               pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    if chat:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(max_position_embeddings=4096, **cfg))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(max_position_embeddings=256, **cfg))
    model.config.uniform_first_layer = uniform  # saved in config.json: a reload freezes the layer again
    return freeze_uniform(model)


def freeze_uniform(model):
    """A model built with a uniform first layer: that layer's query and key projections held at 0 and
    trained by no optimizer, so each of its heads takes the mean of the values of every token up to its
    own, whatever the tokens. Why: tiny models trained on the toy task's result lists copied a fact with
    first-layer heads that found it by its kind of word at a few distances back, and were blind at the
    others (docs/stage1.md); with this layer, later layers do the copying. A stand-in for what
    pretraining gives a real model; not part of M-GRPO. (Frozen for clarity: with queries and keys
    both 0, neither would get a gradient anyway.)"""
    flag = getattr(model.config, "uniform_first_layer", None)
    if flag is None or flag is False:
        return model
    try:  # config.json of a folder given by path: anything
        attn = model.model.layers[0].self_attn
        projs = [p for p in (attn.q_proj, attn.k_proj) if isinstance(p, torch.nn.Linear)]
    except (AttributeError, IndexError, TypeError):
        projs = []
    if flag is not True or len(projs) != 2:
        raise ValueError(f"config.json's uniform_first_layer is {flag!r}: it must be true or false, and true only "
                         "for a model whose first layer has query and key projections (a Llama or Qwen2 built here)")
    for p in (*projs[0].parameters(), *projs[1].parameters()):  # Qwen2's biases too
        with torch.no_grad():
            p.zero_()
        p.requires_grad_(False)
    return model


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


def load_agent(name, args, task, seed=0, lr=None):
    """A model by Hugging Face name or path, or (name empty) a tiny one built in code from `seed`, with
    its tokenizer, its own AdamW (lr: default args.lr), and what sampling needs to know of its tokens.
    args: the run's settings it reads (chat, model_size, device, dtype, lr, weight_decay,
    max_new_tokens, grad_checkpointing, cuda_graphs); task: the task, whose words and prompts it uses."""
    peft = None
    if name and os.path.isfile(os.path.join(name, "adapter_config.json")):  # a LoRA adapter over its base
        tok, (model, peft) = load_tokenizer(name), load_adapter(name, args)
    elif name:
        tok = load_tokenizer(name)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32)  # fp32 master weights
        freeze_uniform(model)  # one built here and saved: its first layer is frozen anew
    else:
        tok = chat_tokenizer(task) if args.chat else word_tokenizer(task.WORDS)
        model = build_model(tok, args.model_size, args.chat, seed, args.uniform_first_layer)
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
    opt = adamw(model, lr or args.lr, args.weight_decay)
    return Agent(model, tok, opt, peft=peft, stop_ids=tuple(sorted(stop)),
                 suppress=tuple(sorted({tok.pad_token_id, tok.unk_token_id} - stop - {None})),
                 pad_id=tok.pad_token_id if tok.pad_token_id is not None else min(stop),
                 end=turn_end(tok, stop, name), max_new=args.max_new_tokens or (256 if chat else 12), chat=chat,
                 system=task.SYSTEM if chat else None, bf16=args.dtype == "bfloat16",
                 graphs={} if args.cuda_graphs and model.device.type == "cuda" else None)


# ---------------------------------------------------------------------------------------
# LoRA (--lora-rank): a frozen base and an adapter of each agent's own, through peft
# ---------------------------------------------------------------------------------------
def add_adapter(agent, args, base):
    """Freeze the agent's model (in bf16 with --dtype bfloat16, else as loaded) and put a LoRA adapter
    on its --lora-targets, trained in fp32 by a new AdamW with the old one's settings. base: where the
    frozen base loads from (a name or a folder), kept in the adapter's config, so that a saved
    adapter loads with peft alone (AutoPeftModelForCausalLM)."""
    from peft import LoraConfig, get_peft_model
    agent.model.zero_grad(set_to_none=True)  # a stale gradient on the base would count in every clip
    if args.dtype == "bfloat16":
        agent.model.to(torch.bfloat16)
    targets = args.lora_targets if args.lora_targets == "all-linear" else args.lora_targets.split(",")
    with quiet_peft():
        agent.peft = get_peft_model(agent.model, LoraConfig(  # adapters in fp32: peft's autocast_adapter_dtype
            r=args.lora_rank, lora_alpha=args.lora_alpha or 2 * args.lora_rank, lora_dropout=0.0,
            target_modules=targets))
    agent.peft.peft_config["default"].base_model_name_or_path = base
    agent.model = agent.peft.get_base_model()  # the model itself, its linear layers now with adapters
    agent.opt = adamw(agent.model, agent.opt.defaults["lr"], agent.opt.defaults["weight_decay"])


def adamw(model, lr, weight_decay):
    """An agent's own AdamW, over the parameters it trains (with LoRA: the adapter's)."""
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, betas=(0.9, 0.98),
                             weight_decay=weight_decay)


@contextlib.contextmanager
def quiet_peft():
    """peft reads a transformers attribute deprecated in 5.x: its FutureWarning is not the user's."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield


def load_adapter(path, args):
    """(model with the adapter in it, its PeftModel) of a saved LoRA adapter: the base named in its
    config, frozen in bf16 with --dtype bfloat16 (else fp32), the adapter trainable, in fp32."""
    from peft import PeftConfig, PeftModel
    base = PeftConfig.from_pretrained(path).base_model_name_or_path
    if not isinstance(base, str) or not base:
        raise ValueError(f"{path}: the adapter's config names no base model")
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    with quiet_peft():
        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=dtype), path,
                                         is_trainable=True)
    return peft.get_base_model(), peft


def share_base(agents):
    """--share-base: the sub-agent's frozen weights become the main agent's (the same tensors, held once);
    each keeps its adapter. The two bases must be equal, parameter by parameter."""
    main, sub = agents["main"].model, agents["sub"].model
    mods = dict(main.named_modules())
    for name, m in sub.named_modules():
        for key, p in list(m.named_parameters(recurse=False)):
            if not p.requires_grad:
                q = getattr(mods.get(name), key, None)
                if q is None or q.shape != p.shape or q.requires_grad or not torch.equal(q, p):
                    raise ValueError(f"--share-base: the agents' bases differ at {name}.{key}")
                m._parameters[key] = q


# ---------------------------------------------------------------------------------------
# Contexts as ids, through the chat template
# ---------------------------------------------------------------------------------------
MARK = "@@MARK@@"


def prompt_text(tok, kind, content, system=None):
    """The template's text of a new conversation of agent `kind` (main, sub, single): the system prompt
    with the agent's tools (chat models), the user's `content`, the assistant prompt."""
    msgs, kw = [{"role": "user", "content": content}], {}
    if system:
        tools = [TOOLS[n] for n in CHAT_TOOLS[kind]]
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
    text = split[0] + content + split[1] if split else render(content)
    return agent.tok(text, add_special_tokens=False).input_ids


def prompt_ids(agent, kind, content):
    """Ids of a new conversation of agent `kind` (main, sub, single) whose user message is `content`."""
    render = functools.partial(prompt_text, agent.tok, kind, system=agent.system)
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

    def add(self, ids, logp=None):
        """Append ids: sampled ones with their log-probs (mask 1), or inserted ones (mask 0)."""
        self.ids += ids
        self.mask += [0 if logp is None else 1] * len(ids)
        self.logp += [0.0] * len(ids) if logp is None else logp


def new_traj(agent, kind, content, **kw):
    ids = prompt_ids(agent, kind, content)
    return Traj(ids, [0] * len(ids), [0.0] * len(ids), **kw)
