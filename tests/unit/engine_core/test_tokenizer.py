"""Byte tokenizer, the simple chat template and streaming detokenization."""

from __future__ import annotations

from pathlib import Path

import pytest

from stack.engine.errors import ChatTemplateError
from stack.engine.checkpoint import DUMMY_CONFIGS
from stack.engine.tokenizer import DUMMY_BPE_PATH, ByteTokenizer, HFTokenizer, IncrementalDecoder, dummy_tokenizer

from .hf_fixture import train_tokenizer

TEXTS = ["plain ascii", "héllo wörld", "世界 你好", "emoji 🌍🚀 and ZWJ 👩‍👩‍👧", "combining é e\u0301", "\x00\ttabs\n", ""]


@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokenizer_round_trips_unicode(text: str) -> None:
    """encode/decode returns the text exactly; one token per UTF-8 byte after <|bos|>."""
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id and len(ids) == 1 + len(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_byte_tokenizer_specials() -> None:
    """Special markers in text become single ids, decode drops them, and eos stops generation."""
    tok = ByteTokenizer()
    ids = tok.encode("<|user|>hi<|eos|>", add_special_tokens=False)
    assert ids == [tok.special_ids["<|user|>"], ord("h"), ord("i"), tok.eos_id]
    assert tok.decode(ids) == "hi"
    assert tok.vocab_size == 256 + len(ByteTokenizer.SPECIALS)
    assert tok.stop_ids == {tok.eos_id}


def test_simple_chat_template() -> None:
    """Without a checkpoint template, chats render as the documented marker format."""
    tok = ByteTokenizer()
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "u"}]}]
    assert tok.apply_chat_template(messages) == "<|bos|><|system|>s<|eos|><|user|>u<|eos|><|assistant|>"
    assert tok.apply_chat_template(messages, add_generation_prompt=False).endswith("u<|eos|>")
    assert tok.encode_chat(messages)[0] == tok.bos_id and tok.encode_chat(messages).count(tok.bos_id) == 1


def stream(decoder: IncrementalDecoder, ids: list[int]) -> list[str]:
    return [decoder.push(i) for i in ids] + [decoder.flush()]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_decoder_never_splits_a_character(text: str) -> None:
    """Byte-by-byte streaming emits only whole characters and the deltas add up to the text."""
    tok = ByteTokenizer()
    deltas = stream(IncrementalDecoder(tok), tok.encode(text, add_special_tokens=False))
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    emoji = "🌍".encode()
    held = [IncrementalDecoder(tok).push(b) for b in emoji[:1]]
    assert held == [""]


def test_incremental_decoder_with_hf_tokenizer(tmp_path: Path) -> None:
    """With a byte-level BPE, streamed deltas concatenate to the full decode, with no U+FFFD."""
    train_tokenizer(tmp_path / "tokenizer.json", 300)
    tok = HFTokenizer(str(tmp_path / "tokenizer.json"), {"bos_token": "<s>", "eos_token": "</s>"})
    text = "the quick brown fox 🌍 héllo 世界"
    ids = tok.encode(text, add_special_tokens=False)
    deltas = stream(IncrementalDecoder(tok, context=tok.encode("prompt")), ids)
    assert "".join(deltas) == tok.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)


def test_flush_releases_an_incomplete_tail() -> None:
    """A stream cut mid-character gives the replacement character at flush, not silence."""
    tok = ByteTokenizer()
    decoder = IncrementalDecoder(tok)
    assert [decoder.push(i) for i in b"ok\xe4\xb8"] == ["o", "k", "", ""]
    assert decoder.flush() == "\ufffd"


def test_chat_template_errors_are_typed(tmp_path: Path) -> None:
    """A template's raise_exception and broken template syntax both surface as ChatTemplateError."""
    train_tokenizer(tmp_path / "tokenizer.json", 300)
    strict = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}ok"
    tok = HFTokenizer(str(tmp_path / "tokenizer.json"), {"chat_template": strict})
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ChatTemplateError, match="refused the messages: first message must be user"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])
    broken = HFTokenizer(str(tmp_path / "tokenizer.json"), {"chat_template": "{% if %}"})
    with pytest.raises(ChatTemplateError, match="chat template failed"):
        broken.apply_chat_template([{"role": "user", "content": "x"}])


# -- the dummy models' BPE (issue 19) ----------------------------------------------------------------


def test_dummy_bpe_counts_agent_text_like_a_real_model() -> None:
    """A coding agent's system prompt and JSON tool list: 3.5-4.5 characters a token (measured 4.19; was 1 byte a
    token), as a real model's BPE counts it, so Claude-Code-sized requests fit the window."""
    from .agent_prompt import agent_text

    text = agent_text()
    ratio = len(text) / len(dummy_tokenizer().encode(text, add_special_tokens=False))
    assert 3.5 <= ratio <= 4.5, f"{ratio:.2f} characters a token"


@pytest.mark.parametrize("text", TEXTS)
def test_dummy_bpe_round_trips_unicode(text: str) -> None:
    """Byte-level BPE: every string encodes and decodes back exactly, <|bos|> first."""
    tok = dummy_tokenizer()
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id and tok.decode(ids) == text


def test_dummy_bpe_keeps_the_engines_specials_and_tool_tags() -> None:
    """Role markers and <|eos|> are one id each and skipped by decode; the Hermes tool tags are one id each and kept;
    the dummy models' embedding rows follow the tokenizer."""
    tok = dummy_tokenizer()
    ids = tok.encode("<|user|>hi<tool_call>{}</tool_call><|eos|>", add_special_tokens=False)
    assert ids[0] == tok.encode("<|user|>", add_special_tokens=False)[0] and ids[-1] == tok.eos_id
    assert len(tok.encode("<tool_call>", add_special_tokens=False)) == 1
    assert tok.decode(ids) == "hi<tool_call>{}</tool_call>" and tok.stop_ids == {tok.eos_id}
    assert all(config.vocab_size == tok.vocab_size for config in DUMMY_CONFIGS.values())
    assert DUMMY_BPE_PATH.stat().st_size <= 2 * 2**20
    chat = tok.apply_chat_template([{"role": "user", "content": "u"}])
    assert chat == "<|bos|><|user|>u<|eos|><|assistant|>" and tok.encode_chat([{"role": "user", "content": "u"}]).count(tok.bos_id) == 1
