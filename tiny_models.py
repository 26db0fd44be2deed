"""The tiny models that a run builds in code when no model is given (no download): their tokenizers,
a word-level one and a byte-level BPE one with a Qwen-style template (`--chat`), and the models
themselves, Llama or Qwen2 with random weights at one of a few sizes.
"""
import json
import random

import torch
import transformers
from tokenizers import Tokenizer

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
    schemas = getattr(task, "TOOLS", TOOLS)  # the task's own descriptions of the tools, if it has them
    corpus = [task.SYSTEM[w] + json.dumps([schemas[n] for n in CHAT_TOOLS[w]]) for w in task.SYSTEM]
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


SIZES = {  # models built here: (hidden, layers, heads, kv heads, MLP)
    "0.1M": (64, 2, 8, 4, 192), "0.2M": (96, 2, 8, 4, 256),
    # 0.4M: the comparisons' stage 1 (experiments/compare.py), whose level-3 lists a 2-layer model learned
    # to read by some seeds and not others; heads of 24 dims, not 12, and 4 layers (experiments/README.md)
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
    others (experiments/stage1.md); with this layer, later layers do the copying. A stand-in for what
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
