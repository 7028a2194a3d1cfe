"""TokenizerWrapper: a nanochat tokenizer (tiktoken encoding trained with rustbpe, `tokenizer.pkl`)
first, a local Hugging Face tokenizer dir (`tokenizer.json`) as fallback.

The trainers need a prompt and a response as separate id lists (prompt-left / response-right
truncation, loss masks), so chat rendering is split in two: `render_prompt(messages)` ends with
whatever opens the assistant's turn, `render_response(text)` ends with the end-of-turn token.
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
from collections.abc import Iterable
from pathlib import Path

from nanochat_ext.errors import InputError, first_line, from_outside

# nanochat's special tokens, in nanochat's order (ids follow the mergeable ranks).
SPECIAL_TOKENS = [
    "<|bos|>",
    "<|user_start|>", "<|user_end|>",
    "<|assistant_start|>", "<|assistant_end|>",
    "<|python_start|>", "<|python_end|>",
    "<|output_start|>", "<|output_end|>",
]
# nanochat's split pattern (GPT-4's, with \p{N}{1,2}).
SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
)

Message = dict  # {"role": "user"|"assistant"|"system", "content": str}
# Beside a Hugging Face model: its `eos_token_id` lists every token that ends a turn (transformers' generate stops at
# each), which the tokenizer's own eos often is not (Gemma's <end_of_turn>, Qwen's <|im_end|>, Llama-3's <|eot_id|>).
GENERATION_CONFIG = "generation_config.json"
REPLY_MARK = "<<the assistant's reply>>"  # stands for a reply where only what a template writes around it matters


class _EncodingState:
    """What a tokenizer.pkl's tiktoken Encoding unpickles into here: its state, kept as data."""

    def __setstate__(self, state: object) -> None:
        self.state = state


class _TokenizerUnpickler(pickle.Unpickler):
    """Admits the one class a nanochat tokenizer.pkl names, tiktoken's Encoding, and builds a stand-in
    for it: unpickling then calls no function of the file's choosing (a pickle's __reduce__ can run any)."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("tiktoken.core", "Encoding"):
            return _EncodingState
        raise pickle.UnpicklingError(f"it names {module}.{name}, which a nanochat tokenizer does not hold; "
                                     f"refused before running anything")


ENCODING_FIELDS = {"name": str, "pat_str": str, "mergeable_ranks": dict, "special_tokens": dict}


def load_tiktoken_pickle(path: Path):
    """nanochat's tokenizer.pkl (a pickled tiktoken Encoding) without trusting the file: a restricted
    unpickler, then the Encoding is built from its checked fields by tiktoken itself. A registered
    encoding pickled by name (tiktoken would fetch it from the internet) is refused too."""
    import tiktoken

    def refuse(why: str) -> InputError:
        return InputError(f"cannot read the tokenizer: {why}", path=str(path))

    try:
        with open(path, "rb") as f:
            obj = _TokenizerUnpickler(f).load()
    except Exception as e:  # truncated, foreign or refused: unpickling raises many types
        raise refuse(first_line(e)) from None
    state = getattr(obj, "state", None)
    if not isinstance(obj, _EncodingState) or not isinstance(state, dict) or set(state) != set(ENCODING_FIELDS):
        raise refuse("not a pickled tiktoken Encoding with fields " + ", ".join(ENCODING_FIELDS))
    for field, kind in ENCODING_FIELDS.items():
        if not isinstance(state[field], kind):
            raise refuse(f"field {field!r} is {type(state[field]).__name__}, not {kind.__name__}")
    ranks, specials = state["mergeable_ranks"], state["special_tokens"]
    if not all(isinstance(k, bytes) and type(v) is int for k, v in ranks.items()) or \
            not all(isinstance(k, str) and type(v) is int for k, v in specials.items()):
        raise refuse("mergeable_ranks must map bytes to ints and special_tokens str to ints")
    try:
        return tiktoken.Encoding(**state)
    except Exception as e:  # tiktoken's own checks of the ranks and the pattern
        raise refuse(first_line(e)) from None


def generation_stops(path: Path) -> list[int]:
    """The `eos_token_id` of a generation_config.json or a model's config.json (a token id or a list of them;
    absent: none)."""
    try:
        ids = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError) as e:  # unreadable, not JSON, not an object
        raise InputError(f"cannot read the generation config: {first_line(e)}", path=str(path)) from None
    ids = [] if ids is None else [ids] if type(ids) is int else ids
    if not isinstance(ids, list) or not all(type(i) is int and i >= 0 for i in ids):
        raise InputError(f"must be a token id or a list of token ids, got {ids!r}", path=str(path),
                         field="eos_token_id")
    return ids


class TokenizerWrapper:
    """One interface over the two tokenizer kinds. `kind` is "rustbpe" or "hf".
    stop_ids: every token that ends a reply, so ends a sampled row (eos_id, which a rendered response ends with,
    first): nanochat's <|assistant_end|> and <|bos|> (as nanochat's Engine stops); a Hugging Face tokenizer's eos
    and the `eos_token_id` of the model's generation config (`generation_config`, kept when the tokenizer is saved, so
    the next stage stops where this one did), or where there is none, of the model's config.json, as transformers'
    generate takes it."""

    def __init__(self, kind: str, impl, source: str, generation_config: Path | None = None,
                 model_config: Path | None = None):
        self.kind, self._impl, self.source = kind, impl, source
        self.generation_config = generation_config
        # Where there is no generation config, transformers' generate stops at the model config's eos_token_id.
        self.stops_source = generation_config or model_config
        if kind == "rustbpe":
            self.vocab_size: int = impl.n_vocab
            special = {name: impl.encode_single_token(name) for name in SPECIAL_TOKENS}
            self.bos_id: int | None = special["<|bos|>"]
            self._special = special
            self.eos_id: int = special["<|assistant_end|>"]  # where an assistant turn stops
            self.pad_id: int = self.bos_id
            self.stop_ids: tuple[int, ...] = (self.eos_id, self.bos_id)
        else:
            self.vocab_size = len(impl)
            self.bos_id = impl.bos_token_id
            self.eos_id = impl.eos_token_id if impl.eos_token_id is not None else impl.pad_token_id
            if self.eos_id is None:
                raise InputError("Hugging Face tokenizer has neither an eos nor a pad token", path=source)
            self.pad_id = impl.pad_token_id if impl.pad_token_id is not None else self.eos_id
            self._special = {}
            listed = generation_stops(self.stops_source) if self.stops_source is not None else []
            if generation_config is None:  # a config's default eos (GPT-2's 50256 in a smaller vocabulary) is no stop
                listed = [i for i in listed if i < self.vocab_size]
            self.stop_ids = tuple(dict.fromkeys([self.eos_id, *listed]))

    # ---- loading / training ------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | os.PathLike, model_dir: str | os.PathLike | None = None) -> TokenizerWrapper:
        """A nanochat tokenizer dir (tokenizer.pkl) first, else a Hugging Face dir (tokenizer.json), whose stop ids
        take in the generation config of model_dir (the model's own, where the tokenizer comes from elsewhere),
        else the one beside the tokenizer, where there is one."""
        p = Path(path)
        pkl = p / "tokenizer.pkl" if p.is_dir() else p
        if pkl.name == "tokenizer.pkl" and pkl.is_file():
            return cls("rustbpe", load_tiktoken_pickle(pkl), str(pkl))
        hf_dir = p if p.is_dir() else p.parent
        if (hf_dir / "tokenizer.json").is_file():
            from transformers import AutoTokenizer

            with from_outside("Hugging Face tokenizer", hf_dir):
                tok = AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)
            dirs = [Path(model_dir)] if model_dir is not None and Path(model_dir).is_dir() else []
            found = [d / GENERATION_CONFIG for d in [*dirs, hf_dir] if (d / GENERATION_CONFIG).is_file()]
            configs = [d / "config.json" for d in [*dirs, hf_dir] if (d / "config.json").is_file()]
            return cls("hf", tok, str(hf_dir), found[0] if found else None, configs[0] if configs else None)
        raise InputError(f"no tokenizer found: tried {p / 'tokenizer.pkl'} (nanochat/RustBPE) "
                         f"and {hf_dir / 'tokenizer.json'} (Hugging Face)", path=str(p))

    @classmethod
    def train_rustbpe(cls, texts: Iterable[str], vocab_size: int) -> TokenizerWrapper:
        """Train a nanochat-style tokenizer: rustbpe merges, tiktoken encoding, nanochat special tokens."""
        import rustbpe
        import tiktoken

        n_merged = vocab_size - len(SPECIAL_TOKENS)
        if n_merged < 256:
            raise InputError(f"vocab_size must be at least {256 + len(SPECIAL_TOKENS)}, got {vocab_size}")
        trainer = rustbpe.Tokenizer()
        trainer.train_from_iterator(iter(texts), n_merged, pattern=SPLIT_PATTERN)
        ranks = {bytes(k): v for k, v in trainer.get_mergeable_ranks()}
        specials = {name: len(ranks) + i for i, name in enumerate(SPECIAL_TOKENS)}
        enc = tiktoken.Encoding(name="rustbpe", pat_str=trainer.get_pattern(),
                                mergeable_ranks=ranks, special_tokens=specials)
        return cls("rustbpe", enc, "trained")

    def save(self, directory: str | os.PathLike) -> Path:
        """Write tokenizer.pkl (nanochat's format) or the HF files into `directory`."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        if self.kind == "hf":
            self._impl.save_pretrained(str(d))
            keep_beside(self.generation_config, d)
            return d / "tokenizer.json"
        tmp = d / "tokenizer.pkl.tmp"
        with open(tmp, "wb") as f:
            pickle.dump(self._impl, f)
        os.replace(tmp, d / "tokenizer.pkl")
        # nanochat's evaluation (bits per byte) reads token_bytes.pt beside the tokenizer: keep it.
        keep_beside(Path(self.source).parent / "token_bytes.pt", d)
        return d / "tokenizer.pkl"

    # ---- encoding ------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        if self.kind == "rustbpe":
            return self._impl.encode_ordinary(text)
        return self._impl.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        if self.kind == "rustbpe":
            return self._impl.decode(ids)
        return self._impl.decode(ids, skip_special_tokens=True)

    def turn_text(self, ids: list[int]) -> str:
        """An assistant turn's text as the model wrote it, special tokens kept: where a tokenizer marks a template's
        `<tool_call>` special, the call must still be read."""
        if self.kind == "rustbpe":
            return self._impl.decode(ids)
        return self._impl.decode(ids, skip_special_tokens=False)

    def reply_text(self, completion: list[int]) -> str:
        """A sampled completion's text, without the stop token it ended with (whichever of stop_ids it was): what
        reward functions read."""
        return self.decode(completion[:-1] if completion and completion[-1] in self.stop_ids else completion)

    def reply_ids(self, completion: list[int]) -> list[int]:
        """A sampled completion as a rendered reply ends: the stop it ended with (whichever of stop_ids) as eos_id,
        so that a reward model, trained on rendered replies, scores every stop alike."""
        return completion[:-1] + [self.eos_id] if completion and completion[-1] in self.stop_ids else completion

    def describe_stops(self) -> str:
        """The log's line of stop ids: each with its token, and the generation config they were read from."""
        names = [self._impl.decode([i]) if self.kind == "rustbpe" else self._impl.convert_ids_to_tokens(i)
                 for i in self.stop_ids]
        where = f" (eos and {self.stops_source})" if self.stops_source is not None else ""
        return "stops: " + ", ".join(f"{name} ({i})" for name, i in zip(names, self.stop_ids)) + where

    def special(self, name: str) -> int:
        return self._special[name]

    @property
    def chat_template(self) -> str | None:
        """A Hugging Face tokenizer's chat template (None for nanochat's, which renders its own turns)."""
        return getattr(self._impl, "chat_template", None) if self.kind == "hf" else None

    def render_prompt(self, messages: list[Message], tools: list[dict] | None = None) -> list[int]:
        """Token ids of a conversation up to and including the opening of the assistant's reply; tools: the JSON
        schemas a chat template that renders tools is given."""
        if self.kind == "rustbpe":
            return self._render_nanochat_prompt(messages)
        if self.chat_template:
            text = self._apply_template(messages, tools, add_generation_prompt=True)
            return self._impl.encode(text, add_special_tokens=False)
        # No chat template: plain text, turns separated by blank lines.
        ids = [self.bos_id] if self.bos_id is not None else []
        return ids + self.encode("\n\n".join(m["content"] for m in messages))

    def render_followup(self, messages: list[Message], tools: list[dict] | None = None) -> list[int]:
        """Token ids that follow an assistant turn the model ended (its stop token taken) when `messages` (user or
        tool turns) come next, through the opening of the next assistant turn: what a multi-turn rollout forces.
        nanochat's turns: each as a user turn (nanochat has no tool turn). A chat template's: what it writes after
        that turn's end-of-turn token, then the turns as it renders them (the text a longer conversation adds)."""
        if self.kind == "rustbpe":
            ids = []
            for m in messages:
                ids += [self._special["<|user_start|>"], *self.encode(m["content"]), self._special["<|user_end|>"]]
            return ids + [self._special["<|assistant_start|>"]]
        if not self.chat_template:
            raise InputError("a multi-turn rollout needs a chat template to render the turns, and this tokenizer has "
                             "none", path=self.source)
        base = [{"role": "user", "content": "?"}, {"role": "assistant", "content": REPLY_MARK}]
        before = self._apply_template(base, tools, add_generation_prompt=False)
        after = self._apply_template(base + list(messages), tools, add_generation_prompt=True)
        if not after.startswith(before):
            raise InputError(f"the chat template renders the turns before a {messages[0]['role']} turn differently "
                             f"once one follows: a rollout cannot go on as the template writes it", path=self.source)
        end = before.index(REPLY_MARK) + len(REPLY_MARK)
        ends = [before.find(s, end) + len(s) for s in map(self._impl.convert_ids_to_tokens, self.stop_ids)
                if s and before.find(s, end) >= 0]
        return self._impl.encode(before[min(ends, default=len(before)):] + after[len(before):],
                                 add_special_tokens=False)

    def render_conversation(self, messages: list[Message], first: int, tools: list[dict] | None = None
                            ) -> tuple[list[int], list[int], list[int]]:
        """A conversation as the chat template renders it, split before messages[first] (the first turn to learn):
        (the prompt's ids, the rest's ids, the rest's mask), the mask 1 on each assistant turn from where the template
        opens it through its end-of-turn token (what generation stops at) and 0 elsewhere (tool and user turns, what
        the template writes between turns), up to the last learnt token: what transformers'
        return_assistant_tokens_mask marks in a template with {% generation %} blocks."""
        full = self._apply_template(messages, tools, add_generation_prompt=False)
        spans = []
        for i in range(first, len(messages)):
            if messages[i]["role"] == "assistant":
                opening = self._apply_template(messages[:i], tools, add_generation_prompt=True)
                turn = self._apply_template(messages[:i + 1], tools, add_generation_prompt=False)
                start = len(opening)
                if not (full.startswith(turn) and turn.startswith(opening)):  # e.g. Qwen3 dropping earlier thinking
                    raise InputError("the chat template renders a conversation's earlier turns differently once more "
                                     "follow: its turns cannot be told apart", path=self.source)
                ends = [turn.rfind(t, start) + len(t) for t in map(self._impl.convert_ids_to_tokens, self.stop_ids)
                        if t and turn.rfind(t, start) >= 0]
                spans.append((start, max(ends, default=len(turn))))
        opened = len(self._apply_template(messages[:first], tools, add_generation_prompt=True))
        enc = self._impl(full, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        cut = sum(1 for a, _ in offsets if a < opened)
        mask = [int(any(a <= s < b for a, b in spans)) for s, _ in offsets[cut:]]
        last = max((k + 1 for k, m in enumerate(mask) if m), default=0)  # what follows the last turn learns nothing
        return ids[:cut], ids[cut:cut + last], mask[:last]

    def _apply_template(self, messages: list[Message], tools: list[dict] | None, add_generation_prompt: bool) -> str:
        """The chat template's text; one line where the template refuses the conversation (a role it does not know,
        turns that do not alternate as it demands)."""
        try:
            return self._impl.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                                  tokenize=False)
        except Exception as e:  # jinja2's TemplateError, or raise_exception() in the template
            roles = "/".join(dict.fromkeys(m["role"] for m in messages))
            raise InputError(f"the chat template refuses a conversation of {roles} turns: {first_line(e)}",
                             path=self.source) from None

    def render_response(self, text: str) -> list[int]:
        """Token ids of an assistant reply, closed by the end-of-turn token."""
        return self.encode(text) + [self.eos_id]

    def render_reply(self, reply: str | list[dict]) -> tuple[list[int], list[int]]:
        """(ids, mask) of a reply to train on: a string, or nanochat's parts (text, python, python_output), each
        encoded on its own as nanochat's render_conversation does, a python part inside <|python_start|> ..
        <|python_end|>, its output inside <|output_start|> .. <|output_end|> with mask 0 (the calculator writes it
        at run time, so the model never learns to)."""
        if isinstance(reply, str):
            ids = self.render_response(reply)
            return ids, [1] * len(ids)
        if self.kind != "rustbpe":
            raise InputError("a reply with python parts (tool calls) needs nanochat's tokenizer and its python tokens")
        ids, mask = [], []
        for part in reply:
            body = self.encode(part["text"])
            if part["type"] == "text":
                ids, mask = ids + body, mask + [1] * len(body)
                continue
            kind = "python" if part["type"] == "python" else "output"
            ids += [self._special[f"<|{kind}_start|>"], *body, self._special[f"<|{kind}_end|>"]]
            mask += [int(kind == "python")] * (len(body) + 2)
        return ids + [self.eos_id], mask + [1]

    def _render_nanochat_prompt(self, messages: list[Message]) -> list[int]:
        msgs = list(messages)
        if msgs and msgs[0]["role"] == "system":
            # nanochat has no system turn: it is merged into the first user message.
            if len(msgs) < 2 or msgs[1]["role"] != "user":
                raise InputError("a system message must be followed by a user message")
            msgs = [{"role": "user", "content": msgs[0]["content"] + "\n\n" + msgs[1]["content"]}] + msgs[2:]
        ids = [self.bos_id]
        for m in msgs:
            role = m["role"]
            if role not in ("user", "assistant"):
                raise InputError(f"unknown role {role!r}")
            ids.append(self._special[f"<|{role}_start|>"])
            ids.extend(self.encode(m["content"]))
            ids.append(self._special[f"<|{role}_end|>"])
        ids.append(self._special["<|assistant_start|>"])
        return ids


def keep_beside(file: Path | None, directory: Path) -> None:
    """Copy a file the tokenizer was read with (nanochat's token_bytes.pt, a generation config) into the directory
    it is saved to, atomically; nothing where there is none or it is already there."""
    if file is None or not file.is_file() or file.parent.resolve() == directory.resolve():
        return
    tmp = directory / (file.name + ".tmp")
    shutil.copyfile(file, tmp)
    os.replace(tmp, directory / file.name)


PROBE = "Hello there! 12 + 30 = 42, isn't it?"
PROBE_TURNS = [{"role": "user", "content": "What is 12 + 30?"}, {"role": "assistant", "content": "42."}]


def same_ids(a: TokenizerWrapper, b: TokenizerWrapper) -> bool:
    """Whether two tokenizers give the same ids (a reward model or a teacher scores the policy's ids directly): their
    size, a probe's ids, the end id, and a conversation as each renders it (the chat template's special tokens, the
    turns' markers: what the scorer reads of every prompt)."""
    return (a.vocab_size, a.encode(PROBE), a.eos_id) == (b.vocab_size, b.encode(PROBE), b.eos_id) and \
        rendered_probe(a) == rendered_probe(b)


def rendered_probe(tok: TokenizerWrapper) -> list[int] | str:
    """A short conversation with a reply as the tokenizer renders it (a prompt and its generation prompt, then the
    reply's turn), or why it cannot render one (a tokenizer without a chat template: the same why is the same)."""
    try:
        return tok.render_prompt(PROBE_TURNS[:1]) + tok.render_response(PROBE_TURNS[1]["content"])
    except Exception as e:  # InputError, a template's own error: compared as what it is
        return f"no conversation: {type(e).__name__}"
