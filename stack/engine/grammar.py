"""Grammar-constrained decoding with llguidance on numpy logits.

One `LLTokenizer` per model (`grammar_tokenizer`: the byte tokenizer's 256 bytes + specials, or a
Hugging Face tokenizer.json); one `LLMatcher` per sequence. Each step the matcher fills a bitmask of
the tokens the grammar allows next (EOS only where the grammar accepts), the sampler sends every
other logit to -inf, and the sampled token is consumed. The grammar sources follow vLLM's guidance
backend (vllm-project/vllm:vllm/v1/structured_output/backend_guidance.py `serialize_guidance_grammar`):
json_object is the schema {"type": "object"}, a JSON Schema goes through
`grammar_from_json_schema`, regex/choice/grammar (Lark; llguidance also reads GBNF-converted Lark)
through `llguidance.grammar_from`.

Forced tool calls (tool_choice "required" or a named function) are a Lark grammar over the hermes
format the chat template teaches: `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>`, the
arguments constrained by the tool's JSON Schema (vLLM constrains to the tools' schemas too:
vllm/tool_parsers/utils.py `get_json_schema_from_tools`; here the shape is hermes, so one parser
reads auto and forced calls alike).
"""

from __future__ import annotations

import json
from typing import Any

import llguidance
import llguidance.numpy as llg_np
import numpy as np

from stack.engine.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from stack.protocol.types import Tool

_TOKENIZERS: dict[int, llguidance.LLTokenizer] = {}
_JSON_OPTIONS = {"whitespace_flexible": False}  # compact JSON: fewer tokens, and what the model sees in tool calls


class GrammarError(ValueError):
    """The grammar (schema, regex, Lark) does not compile; the message says why."""


class _ByteWrapper:
    """What llguidance's TokenizerWrapper reads from a tokenizer, for the byte tokenizer."""

    def __init__(self, tok: ByteTokenizer) -> None:
        self._tok = tok
        self.eos_token_id = tok.eos_id
        self.bos_token_id = tok.bos_id
        self.tokens = [bytes([i]) for i in range(256)] + [s.encode() for s in tok.SPECIALS]
        self.special_token_ids = list(range(256, tok.vocab_size))

    def __call__(self, text: bytes | str) -> list[int]:
        s = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
        return self._tok.encode(s, add_special_tokens=False)


def grammar_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    """The llguidance tokenizer for `tokenizer` (built once per tokenizer object)."""
    cached = _TOKENIZERS.get(id(tokenizer))
    if cached is not None:
        return cached
    eos = sorted(tokenizer.stop_ids) or None
    if isinstance(tokenizer, ByteTokenizer):
        ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteWrapper(tokenizer)), n_vocab=tokenizer.vocab_size, eos_token=eos)
    elif isinstance(tokenizer, HFTokenizer):
        ll = llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=tokenizer.vocab_size, eos_token=eos)
    else:
        raise TypeError(f"no grammar tokenizer for {type(tokenizer).__name__}")
    _TOKENIZERS[id(tokenizer)] = ll
    return ll


def closed(schema: Any) -> Any:
    """A copy of `schema` whose objects with `properties` and no `additionalProperties` get `false`:
    vLLM's `disable_additional_properties` (backend_guidance.py `process_for_additional_properties`).
    Outputs still validate against the original; a random-weight model stops adding keys and ends."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) for k, v in schema.items()}
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


def json_schema_grammar(schema: dict[str, Any] | str) -> str:
    try:
        schema = closed(json.loads(schema) if isinstance(schema, str) else schema)
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise GrammarError(str(exc)) from None


def grammar_of(kind: str, spec: Any) -> str:
    """vLLM's structured-output kinds: json (schema), json_object, regex, choice, grammar (Lark)."""
    if kind == "json":
        return json_schema_grammar(spec)
    if kind == "json_object":
        return json_schema_grammar({"type": "object"})
    return llguidance.grammar_from(kind, list(spec) if kind == "choice" else spec)


def tool_call_grammar(tools: tuple[Tool, ...], name: str | None, parallel: bool) -> str:
    """Lark: one (or, with `parallel`, several) hermes tool calls to `name` or any of `tools`."""
    chosen = [t for t in tools if name is None or t.name == name]
    calls = []
    for tool in chosen:
        schema = {"type": "object", "properties": {"name": {"const": tool.name}, "arguments": closed(tool.parameters or {"type": "object"})},
                  "required": ["name", "arguments"], "additionalProperties": False, "x-guidance": _JSON_OPTIONS}
        calls.append(f"%json {json.dumps(schema)}")
    body = "call: " + " | ".join(f"c{i}" for i in range(len(calls))) + "\n" + "\n".join(f"c{i}: {c}" for i, c in enumerate(calls))
    start = 'start: tc ("\\n" tc)*' if parallel else "start: tc"
    return f'{start}\ntc: "<tool_call>\\n" call "\\n</tool_call>"\n{body}\n'


def validate(grammar: str, tokenizer: Tokenizer) -> None:
    """Raise GrammarError if `grammar` does not compile for this tokenizer."""
    message = llguidance.LLMatcher.validate_grammar(grammar, grammar_tokenizer(tokenizer))
    if message:
        raise GrammarError(message)


class Constraint:
    """One sequence's matcher: `allowed()` is the (vocab,) mask for the next token, `consume` advances it."""

    def __init__(self, grammar: str, tokenizer: Tokenizer, vocab_size: int) -> None:
        ll = grammar_tokenizer(tokenizer)
        self.matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(self.matcher.get_error())
        self.vocab_size = vocab_size
        self._bits = llg_np.allocate_token_bitmask(1, ll.vocab_size)  # (1, ceil(vocab/32)) int32

    def allowed(self) -> np.ndarray:
        """(vocab,) bool: the tokens the grammar allows now (only EOS once it is complete or broken)."""
        llg_np.fill_next_token_bitmask(self.matcher, self._bits, 0)
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")  # (32 * words,)
        return bits[: self.vocab_size].astype(bool)

    def consume(self, token: int) -> bool:
        """Advance by `token` (False once the matcher is in an error state or already stopped)."""
        if self.matcher.is_stopped():
            return False
        return bool(self.matcher.consume_token(int(token)))

    @property
    def accepting(self) -> bool:
        return bool(self.matcher.is_accepting())
