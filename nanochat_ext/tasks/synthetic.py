"""A small, deterministic synthetic chat domain and tiny models for the demo and the tests.

Ground truth: a good reply is courteous (words from a helpful vocabulary, none dismissive) and on
topic (it names something from the prompt's topic); `judge` checks exactly that. Preference pairs
put a good reply against a dismissive one or, as a harder negative, a courteous reply about another
topic. SFT conversations are deliberately imperfect, so the SFT policy leaves headroom for RL.
Topics are skewed on purpose, a few dense and several rare, so density weighting has something to
act on. Nothing here is downloaded; everything follows from `seed`.
"""
from __future__ import annotations

import json
import operator
import random
import re
from pathlib import Path

import torch

from nanochat_ext.models.gpt import GPT, GPTConfig, padded
from nanochat_ext.models.vintages import VINTAGES
from nanochat_ext.runtime.checkpoint import save_checkpoint
from nanochat_ext.tokenizer import TokenizerWrapper

# (topic, share of prompts): three dense topics, five rare ones.
TOPICS = [("weather", 0.34), ("cooking", 0.26), ("travel", 0.2), ("astronomy", 0.05), ("chess", 0.05),
          ("gardening", 0.04), ("music", 0.03), ("pottery", 0.03)]
TOPIC_WORDS = {
    "weather": ["rain", "sunny", "cloud", "wind", "storm", "forecast"],
    "cooking": ["soup", "bread", "oven", "spice", "recipe", "pan"],
    "travel": ["train", "ticket", "hotel", "map", "border", "flight"],
    "astronomy": ["star", "planet", "comet", "orbit", "galaxy", "moon"],
    "chess": ["knight", "bishop", "castle", "pawn", "opening", "endgame"],
    "gardening": ["seed", "soil", "tulip", "compost", "hedge", "bloom"],
    "music": ["chord", "melody", "violin", "rhythm", "tempo", "choir"],
    "pottery": ["clay", "kiln", "glaze", "wheel", "vase", "bowl"],
}
HELPFUL = ["sure", "glad", "happy", "gladly", "certainly", "welcome", "thanks", "great", "kindly", "gently"]
DISMISSIVE = ["no", "whatever", "boring", "ugh", "nope", "meh", "stop", "never", "pointless", "annoying"]
QUESTIONS = ["Can you tell me about the {a} {w}?", "What should I know about the {a} {w}?",
             "Any advice on the {a} {w} today?", "How does the {a} {w} work?", "Explain the {a} {w} to me."]
# 12 x 6 x 5 = 360 distinct prompts per topic: dense topics fill many of them, rare ones few.
ADJECTIVES = ["old", "new", "big", "small", "red", "blue", "quiet", "loud", "odd", "fine", "long", "short"]


def _topic(rng: random.Random) -> str:
    return rng.choices([t for t, _ in TOPICS], weights=[w for _, w in TOPICS])[0]


def _reply(rng: random.Random, tone: list[str], topic_words: list[str]) -> str:
    words = [rng.choice(tone) for _ in range(rng.randint(3, 5))] + rng.sample(topic_words, 2)
    rng.shuffle(words)
    return " ".join(words).capitalize() + "."


def _prompt(rng: random.Random) -> tuple[str, str]:
    topic = _topic(rng)
    question = rng.choice(QUESTIONS).format(a=rng.choice(ADJECTIVES), w=rng.choice(TOPIC_WORDS[topic]))
    return question + f" ({topic})", topic


def _other_topic(rng: random.Random, topic: str) -> str:
    return rng.choice([t for t, _ in TOPICS if t != topic])


def make_pairs(n: int, seed: int = 0, p_off_topic: float = 0.0) -> list[dict]:
    """`n` preference pairs {prompt, chosen, rejected, topic}; prompts repeat, as real prompts do.
    The rejected reply is dismissive, or with probability p_off_topic courteous but off topic."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        prompt, topic = _prompt(rng)
        words = TOPIC_WORDS[topic]
        chosen = _reply(rng, HELPFUL, words)
        if rng.random() < p_off_topic:
            rejected = _reply(rng, HELPFUL, TOPIC_WORDS[_other_topic(rng, topic)])
        else:
            rejected = _reply(rng, DISMISSIVE, words)
        rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected, "topic": topic})
    return rows


def make_conversations(n: int, seed: int = 0, p_good: float = 0.5) -> list[dict]:
    """SFT conversations {messages, topic}: the reply is good with probability p_good, else
    dismissive or off topic, so a model trained on them is right only part of the time."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        prompt, topic = _prompt(rng)
        r = rng.random()
        if r < p_good:
            reply = _reply(rng, HELPFUL, TOPIC_WORDS[topic])
        elif r < p_good + (1 - p_good) / 2:
            reply = _reply(rng, DISMISSIVE, TOPIC_WORDS[topic])
        else:
            reply = _reply(rng, HELPFUL, TOPIC_WORDS[_other_topic(rng, topic)])
        rows.append({"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}],
                     "topic": topic})
    return rows


def make_prompts(n: int, seed: int = 0) -> list[dict]:
    """GRPO / evaluation prompts {prompt, topic}."""
    rng = random.Random(seed)
    return [dict(zip(("prompt", "topic"), _prompt(rng))) for _ in range(n)]


def judge(topic: str, completion: str, answer: str | None = None) -> bool:
    """Ground truth: courteous (a helpful word, no dismissive one) and on topic (a word of `topic`); for an
    arithmetic prompt, its answer stated after the tool block (what the model wrote, not what the tool forced)."""
    if topic == ARITHMETIC:
        stated = completion.rsplit("<|output_end|>", 1)[-1]
        return answer is not None and re.search(rf"(?<![0-9]){re.escape(answer)}(?![0-9])", stated) is not None
    words = set(re.findall(r"[a-z]+", completion.lower()))
    return bool(words & set(HELPFUL)) and not words & set(DISMISSIVE) and bool(words & set(TOPIC_WORDS[topic]))


def task_reward(prompt: str, completion: str, row: dict) -> float:
    """`judge` as a rule-based GRPO reward: --reward_fn nanochat_ext.tasks.synthetic:task_reward."""
    return float(judge(row["topic"], completion, row.get("answer")))


# Arithmetic: a question the calculator answers. The SFT reply calls it in nanochat's format (a python part, its
# output part, which SFT leaves out of the loss), then states the result; judged on that statement.
ARITHMETIC = "arithmetic"
OPERATIONS = {"plus": ("+", operator.add), "minus": ("-", operator.sub), "times": ("*", operator.mul)}


def _arithmetic(rng: random.Random) -> tuple[str, str, str]:
    """(question, expression, answer)."""
    a, b, word = rng.randint(2, 99), rng.randint(2, 99), rng.choice(list(OPERATIONS))
    sign, op = OPERATIONS[word]
    return f"What is {a} {word} {b}? ({ARITHMETIC})", f"{a}{sign}{b}", str(op(a, b))


def make_arithmetic_conversations(n: int, seed: int = 0) -> list[dict]:
    """SFT conversations whose replies call the calculator: {messages (the reply as nanochat's parts), topic}."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        question, expr, answer = _arithmetic(rng)
        reply = [{"type": "text", "text": f"{rng.choice(HELPFUL).capitalize()}, let me compute. "},
                 {"type": "python", "text": expr}, {"type": "python_output", "text": answer},
                 {"type": "text", "text": f" The answer is {answer}."}]
        rows.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": reply}],
                     "topic": ARITHMETIC})
    return rows


def make_arithmetic_prompts(n: int, seed: int = 0) -> list[dict]:
    """Evaluation prompts for tool use: {prompt, topic, answer}."""
    rng = random.Random(seed)
    return [{"prompt": q, "topic": ARITHMETIC, "answer": a} for q, _, a in (_arithmetic(rng) for _ in range(n))]


def corpus(seed: int = 0, n: int = 2000) -> list[str]:
    """Text the tokenizer is trained on: the domain's prompts and replies."""
    out = []
    for r in make_pairs(n, seed + 1):
        out += [r["prompt"], r["chosen"], r["rejected"]]
    return out


def write_jsonl(path: str | Path, rows: list[dict]) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return p


def make_tokenizer(directory: str | Path, vocab_size: int = 512, seed: int = 0) -> TokenizerWrapper:
    tok = TokenizerWrapper.train_rustbpe(corpus(seed), vocab_size)
    tok.save(directory)
    return tok


def make_tiny_gpt(directory: str | Path, vocab_size: int, seed: int = 0, vintage: str = "oct2025",
                  n_layer: int = 2, n_embd: int = 64, n_head: int = 4, n_kv_head: int = 2,
                  sequence_len: int = 256, step: int = 0) -> Path:
    """A randomly initialised nanochat GPT of that vintage, saved as nanochat saves one
    (model_<step>.pt + meta with model_config)."""
    v = VINTAGES[vintage]
    cfg = GPTConfig(sequence_len=sequence_len, vocab_size=vocab_size, n_layer=n_layer, n_head=n_head,
                    n_kv_head=n_kv_head, n_embd=n_embd, vintage=vintage, window_pattern="SL" if v.windows else "L",
                    padded_vocab_size=padded(vocab_size) if v.pads_vocab else vocab_size)
    model = GPT(cfg)
    model.init_weights(seed)
    meta = {"step": step, "model_config": cfg.nanochat_dict(), "nanochat_vintage": vintage}
    return save_checkpoint(directory, step, model.state_dict(), meta)


# The tiny Hugging Face models' chat templates (ours, in the forms real templates take): their special tokens
# (bos, eos, pad, the rest) and the template. transformers compiles templates with trim_blocks, so every literal is
# an expression. chatml: ChatML that knows no tools (as SmolLM2's); chatml_tools: ChatML that renders tools and
# writes tool calls in the hermes format (as Qwen's); llama3_tools: Llama 3.1's headers and JSON tool calls, tool
# results as ipython turns. Assistant turns sit in {% generation %} blocks, for return_assistant_tokens_mask.
CHATML = ("{%- for m in messages -%}{%- if m.role == 'assistant' -%}{{- '<|im_start|>assistant\\n' -}}"
          "{%- generation -%}{{- m.content + '<|im_end|>' -}}{%- endgeneration -%}{{- '\\n' -}}"
          "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}{%- endif -%}{%- endfor -%}"
          "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
CHATML_TOOLS = (
    "{%- if tools -%}{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0].role == 'system' -%}{{- messages[0].content + '\\n\\n' -}}{%- endif -%}"
    "{{- 'You can call these functions:\\n<tools>\\n' -}}"
    "{%- for t in tools -%}{{- (t | tojson) + '\\n' -}}{%- endfor -%}"
    "{{- '</tools>\\nTo call one: <tool_call>\\n{\"name\": ..., \"arguments\": {...}}\\n</tool_call><|im_end|>\\n' -}}"
    "{%- elif messages[0].role == 'system' -%}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for m in messages -%}{%- if m.role == 'assistant' -%}{{- '<|im_start|>assistant\\n' -}}{%- generation -%}"
    "{{- m.content -}}{%- for c in (m.tool_calls or []) -%}{{- '<tool_call>\\n' + ({'name': c.function.name, "
    "'arguments': c.function.arguments} | tojson) + '\\n</tool_call>' -}}{%- endfor -%}{{- '<|im_end|>' -}}"
    "{%- endgeneration -%}{{- '\\n' -}}"
    "{%- elif m.role == 'tool' -%}{{- '<|im_start|>tool\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- elif not (loop.first and m.role == 'system') -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
LLAMA3_TOOLS = (
    "{{- '<|begin_of_text|>' -}}{%- if tools is not none -%}"  # as Llama 3.1's own: [] still renders the block
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\nTo call a "
    "function, answer with only {\"name\": function name, \"parameters\": its arguments}.\\n' -}}"
    "{%- for t in tools -%}{{- (t | tojson) + '\\n' -}}{%- endfor -%}{{- '<|eot_id|>' -}}{%- endif -%}"
    "{%- for m in messages -%}{%- if m.role == 'assistant' -%}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- generation -%}{%- if m.tool_calls -%}"
    "{{- {'name': m.tool_calls[0].function.name, 'parameters': m.tool_calls[0].function.arguments} | tojson -}}"
    "{%- else -%}{{- m.content -}}{%- endif -%}{{- '<|eot_id|>' -}}{%- endgeneration -%}"
    "{%- elif m.role == 'tool' -%}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' -}}"
    "{%- else -%}{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' -}}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}")
# name -> (bos, eos, pad, other special tokens, the token that ends a turn where it is not eos, template). Such a
# turn end is listed in the generation config's eos_token_id beside eos, as Llama 3's <|eot_id|> and Gemma's
# <end_of_turn> are.
TEMPLATES = {
    "plain": ("<|endoftext|>", "<|endoftext|>", "<|pad|>", ["<|user|>", "<|assistant|>", "<|system|>"], None,
              "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|endoftext|>{% endfor %}"
              "{% if add_generation_prompt %}<|assistant|>{% endif %}"),
    "chatml": ("<|im_start|>", "<|im_end|>", "<|endoftext|>", [], None, CHATML),
    "chatml_tools": ("<|im_start|>", "<|im_end|>", "<|endoftext|>", [], None, CHATML_TOOLS),
    "llama3_tools": ("<|begin_of_text|>", "<|end_of_text|>", "<|end_of_text|>",
                     ["<|start_header_id|>", "<|end_header_id|>"], "<|eot_id|>", LLAMA3_TOOLS),
}


def make_tiny_hf_llama(directory: str | Path, seed: int = 0, vocab_size: int = 512, *, texts: list[str] | None = None,
                       hidden_size: int = 64, n_layer: int = 2, intermediate_size: int = 128,
                       max_positions: int = 256, template: str = "plain") -> Path:
    """A tiny Hugging Face Llama + byte-level BPE tokenizer with a chat template (TEMPLATES), saved locally; the
    tokenizer learnt from `texts` (default: the demo's corpus)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bos, eos, pad, others, turn_end, chat_template = TEMPLATES[template]
    specials = list(dict.fromkeys([bos, eos, pad, *others, *([turn_end] if turn_end else [])]))
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts if texts is not None else corpus(seed), trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=bos, eos_token=eos, pad_token=pad)
    tok.chat_template = chat_template
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden_size, num_hidden_layers=n_layer, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=intermediate_size,
                      max_position_embeddings=max_positions, tie_word_embeddings=False,
                      bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id,
                      eos_token_id=[tok.eos_token_id, tok.convert_tokens_to_ids(turn_end)] if turn_end else
                      tok.eos_token_id)
    d = Path(directory)
    LlamaForCausalLM(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return d
