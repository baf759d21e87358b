"""Tokenizers: the dummy models' byte-level BPE, a plain byte one, Hugging Face `tokenizer.json` for checkpoints.

The dummy models (`dummy:tiny`, `dummy:small`) count tokens like a real model: a byte-level BPE of
16,384 tokens (+6 tool tags) trained on the Python standard library's docs, source and tool schemas
(scripts/train_dummy_tokenizer.py writes data/dummy_bpe.json), about 4 characters a token on a
coding agent's English and JSON, where one byte a token would put a 27k-character system prompt and
its tools over any window. All expose the same small interface (`encode`, `decode`, `bos_id`, `eos_id`, `stop_ids`,
`apply_chat_template`), and `IncrementalDecoder` turns a growing token list into text deltas for
streaming without ever emitting half a UTF-8 character.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from stack.engine.errors import ChatTemplateError

# The simple template used when a checkpoint has none (and always for the byte tokenizer):
#   {bos}<|system|>...{eos}<|user|>...{eos}<|assistant|>   (the last marker only with a generation prompt)
ROLE_MARKERS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>", "tool": "<|tool|>"}

# The dummy models' Jinja template: the simple one above when there are no tools (same tokens), and
# Hermes / Qwen2.5-style tool use otherwise (Qwen/Qwen2.5-7B-Instruct tokenizer_config.json): the tools
# as JSON lines in <tools></tools> in the system turn, calls as <tool_call>{json}</tool_call> in the
# assistant turn, results as <tool_response></tool_response> (vLLM's `hermes` parser reads these calls).
BYTE_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if tools %}"
    "{{ '<|system|>' }}{% if messages and messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\n' }}{{ tool | tojson }}{% endfor %}{{ '\n' }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
    "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>{{ eos_token }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}{% if not (tools and loop.first) %}<|system|>{{ message.content }}{{ eos_token }}{% endif %}"
    "{%- elif message.role == 'assistant' %}<|assistant|>{{ message.content }}"
    "{%- for call in message.tool_calls or [] %}{% if message.content or not loop.first %}{{ '\n' }}{% endif %}"
    "<tool_call>\n{\"name\": {{ call.function.name | tojson }}, \"arguments\": {{ call.function.arguments | tojson }}}\n</tool_call>"
    "{%- endfor %}{{ eos_token }}"
    "{%- elif message.role == 'tool' %}<|tool|><tool_response>\n{{ message.content }}\n</tool_response>{{ eos_token }}"
    "{%- else %}<|user|>{{ message.content }}{{ eos_token }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}"
)


DUMMY_BPE_PATH = Path(__file__).parent / "data" / "dummy_bpe.json"
DUMMY_BOS, DUMMY_EOS = "<|bos|>", "<|eos|>"
DUMMY_SPECIALS = [DUMMY_BOS, DUMMY_EOS, *ROLE_MARKERS.values()]
# Hermes tool tags: ordinary added tokens (one id each, kept by decode), as in Qwen2.5's tokenizer; vLLM's
# `hermes` tool parser refuses a tokenizer without <tool_call> and </tool_call>.
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<tools>", "</tools>"]


class Tokenizer:
    """Text <-> token ids, plus the chat template."""

    bos_id: int | None = None
    eos_id: int | None = None
    stop_ids: frozenset[int] = frozenset()  # ids that end generation (eos, end-of-turn)
    bos_token: str = ""
    eos_token: str = ""
    chat_template: str | None = None  # jinja2 source from the checkpoint, or None for the simple one

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, special tokens skipped; incomplete UTF-8 shows as U+FFFD."""
        raise NotImplementedError

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
        """The prompt text for chat `messages` ({role, content, tool_calls…}) and `tools` (HF's shape);
        includes the bos token itself, so encode the result with `add_special_tokens=False` (or use
        `encode_chat`). Raises `ChatTemplateError` when the checkpoint's template rejects the messages."""
        if self.chat_template is None:
            if tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
                raise ChatTemplateError("this checkpoint has no chat template, so it cannot be given tools or tool messages")
            return self._simple_template(messages, add_generation_prompt)
        return _render_jinja(self.chat_template, messages, add_generation_prompt, self.bos_token, self.eos_token, tools)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, tools), add_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes one token stands for (OpenAI logprobs' `bytes`)."""
        return self.decode([token_id]).encode("utf-8")

    def _simple_template(self, messages: list[dict], add_generation_prompt: bool) -> str:
        parts = [self.bos_token]
        for message in messages:
            marker = ROLE_MARKERS.get(message["role"], ROLE_MARKERS["user"])
            parts.append(f"{marker}{_content_text(message.get('content'))}{self.eos_token}")
        if add_generation_prompt:
            parts.append(ROLE_MARKERS["assistant"])
        return "".join(parts)


class ByteTokenizer(Tokenizer):
    """256 byte tokens followed by specials: <|bos|>, <|eos|>, then the role markers."""

    SPECIALS = ("<|bos|>", "<|eos|>", *ROLE_MARKERS.values())

    def __init__(self) -> None:
        self.special_ids = {tok: 256 + i for i, tok in enumerate(self.SPECIALS)}
        self.bos_token, self.eos_token = "<|bos|>", "<|eos|>"
        self.bos_id, self.eos_id = self.special_ids["<|bos|>"], self.special_ids["<|eos|>"]
        self.stop_ids = frozenset({self.eos_id})
        self.chat_template = BYTE_CHAT_TEMPLATE
        self._split = re.compile("(" + "|".join(re.escape(s) for s in self.SPECIALS) + ")")

    @property
    def vocab_size(self) -> int:
        return 256 + len(self.SPECIALS)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [self.bos_id] if add_special_tokens else []
        for piece in self._split.split(text):
            if piece in self.special_ids:
                ids.append(self.special_ids[piece])
            else:
                ids.extend(piece.encode("utf-8"))
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id]) if token_id < 256 else self.SPECIALS[token_id - 256].encode()


class HFTokenizer(Tokenizer):
    """A `tokenizers.Tokenizer` from tokenizer.json, with specials from tokenizer_config.json."""

    def __init__(self, tokenizer_json: str, tokenizer_config: dict, extra_eos_ids: Sequence[int] = ()) -> None:
        from tokenizers import Tokenizer as _HF  # imported here: only checkpoints need it

        self._tok = _HF.from_file(tokenizer_json)
        self.bos_token = _token_text(tokenizer_config.get("bos_token"))
        self.eos_token = _token_text(tokenizer_config.get("eos_token"))
        self.bos_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.stop_ids = frozenset({i for i in (self.eos_id, *extra_eos_ids) if i is not None})
        self.chat_template = _pick_template(tokenizer_config.get("chat_template"))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def to_json(self) -> str:
        """The tokenizer.json text llguidance builds its token trie from.

        llguidance takes every added token for a special one, which no grammar literal can produce:
        a forced tool call's `"<tool_call>"` would then allow that token and break on it. Non-special
        added tokens (Qwen2.5's and the dummy models' tool tags) are text, so they go to it as ordinary
        vocabulary; only printable ASCII ones, whose byte-level spelling is themselves.
        """
        data = json.loads(self._tok.to_str())
        vocab = data.get("model", {}).get("vocab")
        if isinstance(vocab, dict):
            text = [a for a in data.get("added_tokens", []) if not a.get("special") and re.fullmatch(r"[!-~]+", a["content"])]
            vocab.update({a["content"]: a["id"] for a in text})
            data["added_tokens"] = [a for a in data.get("added_tokens", []) if a not in text]
        return json.dumps(data)


def build_dummy_bpe(corpus: Iterable[str], vocab_size: int) -> Any:
    """A `tokenizers.Tokenizer`: byte-level BPE (every UTF-8 string encodes) trained on `corpus`, the
    dummy specials first (ids 0..5), the tool tags added, and `<|bos|>` prepended by add_special_tokens."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors, trainers
    from tokenizers import Tokenizer as _HF

    tok = _HF(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=DUMMY_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    tok.post_processor = processors.TemplateProcessing(single=f"{DUMMY_BOS} $A", special_tokens=[(DUMMY_BOS, tok.token_to_id(DUMMY_BOS))])
    return tok


@lru_cache(maxsize=1)
def dummy_tokenizer() -> HFTokenizer:
    """The dummy models' tokenizer (one instance: it is immutable and every dummy model shares it)."""
    return HFTokenizer(str(DUMMY_BPE_PATH), dummy_tokenizer_config())


def dummy_tokenizer_config() -> dict[str, Any]:
    """tokenizer_config.json of the dummy tokenizer (tiny_llama writes it next to the checkpoint for vLLM)."""
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": DUMMY_BOS, "eos_token": DUMMY_EOS,
            "chat_template": BYTE_CHAT_TEMPLATE}


class IncrementalDecoder:
    """Streaming detokenizer: `push(id)` returns the new text (possibly "") since the last push.

    It re-decodes a short window (`prefix` .. end) and holds text back while it ends in U+FFFD
    (an incomplete UTF-8 sequence or byte-fallback piece), the scheme vLLM and TGI use. Prompt tail
    ids passed as `context` give tokenizers that drop a leading space the right left context.
    """

    def __init__(self, tokenizer: Tokenizer, context: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.ids = [int(i) for i in context[-4:]]
        self.prefix_offset = 0  # start of the window re-decoded each push
        self.read_offset = len(self.ids)  # ids before this have been emitted

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        prefix_text = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return new_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back at the end of the stream (replacement chars included)."""
        prefix_text = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self.tokenizer.decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return new_text[len(prefix_text) :]


def _content_text(content: object) -> str:
    """OpenAI content may be a string or a list of parts; keep the text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict))


def _token_text(token: object) -> str:
    """tokenizer_config.json writes specials as a string or as {"content": ...}."""
    if isinstance(token, dict):
        return str(token.get("content", ""))
    return token or ""


def _pick_template(template: object) -> str | None:
    """A template string, or the "default" entry of a list of named templates."""
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


@lru_cache(maxsize=8)
def _compiled(template: str) -> Any:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ChatTemplateError(f"chat template refused the messages: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)  # Llama 3.x templates call it
    # transformers' own tojson: no HTML escaping of <, >, & (Jinja's default would garble tool JSON)
    env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False, ensure_ascii=False: json.dumps(
        x, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii)
    return env.from_string(template)


def _template_message(m: dict) -> dict:
    """A message as HF templates expect it: text content, tool-call arguments as objects (vLLM parses them too)."""
    out = {**m, "content": _content_text(m.get("content"))}
    if m.get("tool_calls"):
        calls = []
        for call in m["tool_calls"]:
            args: Any = call["function"]["arguments"]
            try:
                args = json.loads(args) if isinstance(args, str) else args
            except json.JSONDecodeError:
                pass  # not JSON: the template gets the text
            calls.append({**call, "function": {**call["function"], "arguments": args}})
        out["tool_calls"] = calls
    return out


def _render_jinja(template: str, messages: list[dict], add_generation_prompt: bool, bos: str, eos: str,
                  tools: list[dict] | None = None) -> str:
    """Render an HF chat template the way transformers does (sandboxed, trim/lstrip blocks, `tools`)."""
    from jinja2.exceptions import TemplateError

    try:
        return _compiled(template).render(messages=[_template_message(m) for m in messages], tools=tools,
                                          add_generation_prompt=add_generation_prompt, bos_token=bos, eos_token=eos)
    except TemplateError as exc:
        raise ChatTemplateError(f"chat template failed: {exc}") from exc
