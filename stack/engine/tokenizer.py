"""Tokenizers: a byte-level one for dummy models, Hugging Face `tokenizer.json` for checkpoints.

Both expose the same small interface (`encode`, `decode`, `bos_id`, `eos_id`, `stop_ids`,
`apply_chat_template`), and `IncrementalDecoder` turns a growing token list into text deltas for
streaming without ever emitting half a UTF-8 character.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from datetime import datetime

from stack.engine.errors import ChatTemplateError

# The simple template used when a checkpoint has none (and always for the byte tokenizer):
#   {bos}<|system|>...{eos}<|user|>...{eos}<|assistant|>   (the last marker only with a generation prompt)
ROLE_MARKERS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>", "tool": "<|tool|>"}


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

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text for chat `messages` ({role, content}); includes the bos token itself,
        so encode the result with `add_special_tokens=False` (or use `encode_chat`).
        Raises `ChatTemplateError` when the checkpoint's template rejects the messages."""
        if self.chat_template is None:
            return self._simple_template(messages, add_generation_prompt)
        return _render_jinja(self.chat_template, messages, add_generation_prompt, self.bos_token, self.eos_token)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)

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


def _render_jinja(template: str, messages: list[dict], add_generation_prompt: bool, bos: str, eos: str) -> str:
    """Render an HF chat template the way transformers does (sandboxed, trim/lstrip blocks)."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ChatTemplateError(f"chat template refused the messages: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)  # Llama 3.x templates call it
    messages = [{**m, "content": _content_text(m.get("content"))} for m in messages]
    try:
        return env.from_string(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos, eos_token=eos
        )
    except TemplateError as exc:
        raise ChatTemplateError(f"chat template failed: {exc}") from exc
