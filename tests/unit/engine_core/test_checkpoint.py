"""Loading Hugging Face checkpoints written by the test: weights, shards, dtypes, tokenizer, errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from stack.engine.errors import CheckpointError
from stack.engine.kv_cache import KVCache
from stack.engine.model import Model, Segment, forward, load_model

from .hf_fixture import CHECKPOINT_CONFIG, write_checkpoint
from .reference import model_from_tensors, naive_logits, random_hf_tensors

CONFIG = CHECKPOINT_CONFIG
TOKENS = [0, 17, 42, 99, 250, 3, 120, 7, 299]


@pytest.fixture(scope="module")
def tensors() -> dict[str, np.ndarray]:
    return random_hf_tensors(CONFIG, seed=11)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, tensors: dict[str, np.ndarray]) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-llama", CONFIG, tensors)


def all_logits(model: Model, tokens: list[int]) -> np.ndarray:
    cache = KVCache(model.config, len(tokens))
    return forward(model, [Segment(np.array(tokens), cache, 0)], all_logits=True)[0]  # (T, vocab)


def test_checkpoint_loads_with_same_logits(checkpoint: Path, tensors: dict[str, np.ndarray]) -> None:
    """A float32 HF checkpoint gives the config, the in-memory model's logits (both on numpy's matmuls: the same
    weights give the same bits) and the reference's."""
    model = load_model(str(checkpoint), matmuls="numpy")
    assert model.config == CONFIG
    assert model.name == "tiny-llama"
    in_memory = model_from_tensors(CONFIG, tensors)
    assert model.fingerprint == in_memory.fingerprint
    np.testing.assert_array_equal(all_logits(model, TOKENS), all_logits(in_memory, TOKENS))
    np.testing.assert_allclose(all_logits(model, TOKENS), naive_logits(CONFIG, tensors, TOKENS), rtol=1e-4, atol=1e-4)


def test_sharded_checkpoint_equals_single_file(tmp_path: Path, tensors: dict[str, np.ndarray]) -> None:
    """A model.safetensors.index.json with 3 shards loads to the same model as one file."""
    sharded = load_model(str(write_checkpoint(tmp_path / "sharded", CONFIG, tensors, shards=3)))
    assert sharded.fingerprint == model_from_tensors(CONFIG, tensors).fingerprint


@pytest.mark.parametrize("dtype", ["F16", "BF16"])
def test_half_precision_checkpoints_convert_to_float32(tmp_path: Path, tensors: dict[str, np.ndarray], dtype: str) -> None:
    """F16 and BF16 tensors load as float32 equal to the rounded originals."""
    model = load_model(str(write_checkpoint(tmp_path / dtype, CONFIG, tensors, dtype=dtype)), matmuls="numpy")
    if dtype == "F16":
        rounded = {k: v.astype(np.float16).astype(np.float32) for k, v in tensors.items()}
    else:
        rounded = {k: (v.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32) for k, v in tensors.items()}
    assert model.weights.tok_embeddings.dtype == np.float32
    np.testing.assert_array_equal(all_logits(model, TOKENS), all_logits(model_from_tensors(CONFIG, rounded), TOKENS))
    assert model.fingerprint != model_from_tensors(CONFIG, tensors).fingerprint


def test_tied_embeddings_need_no_lm_head(tmp_path: Path) -> None:
    """tie_word_embeddings: no lm_head tensor in the file, logits use the embedding matrix."""
    config = CONFIG.__class__(**{**CONFIG.__dict__, "tie_embeddings": True})
    tensors = random_hf_tensors(config, seed=2)
    model = load_model(str(write_checkpoint(tmp_path / "tied", config, tensors)))
    np.testing.assert_allclose(all_logits(model, TOKENS), naive_logits(config, tensors, TOKENS), rtol=1e-4, atol=1e-4)


def test_checkpoint_tokenizer_and_chat_template(checkpoint: Path) -> None:
    """tokenizer.json round-trips text, bos/eos come from tokenizer_config.json, the jinja chat
    template renders, and generation_config.json adds stop ids."""
    tok = load_model(str(checkpoint)).tokenizer
    ids = tok.encode("hello wörld 🌍")
    assert ids[0] == tok.bos_id == 0
    assert tok.decode(ids) == "hello wörld 🌍"
    assert tok.eos_id == 1 and tok.stop_ids == {1, 3}
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages) == (
        "<s><|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    chat_ids = tok.encode_chat(messages)
    assert chat_ids.count(tok.bos_id) == 1 and chat_ids[1] == 2  # <|im_start|> as one special token


def copy_checkpoint(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: (d / "config.json").unlink(), r"config\.json: missing"),
        (lambda d: (d / "config.json").write_text("{oops"), r"config\.json: invalid JSON"),
        (lambda d: (d / "config.json").write_text(json.dumps({"hidden_size": 32})), r"config\.json: missing required key 'vocab_size'"),
        (lambda d: (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()),
                                                               "num_attention_heads": "4"})),
         r"config\.json: num_attention_heads must be a positive int, got '4'"),
        (lambda d: (d / "model.safetensors").unlink(), r"neither model\.safetensors nor"),
        (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:-100]), r"model\.safetensors: truncated"),
        (lambda d: (d / "model.safetensors").write_bytes(b"garbage"), r"model\.safetensors: not a safetensors file"),
        (lambda d: (d / "tokenizer.json").unlink(), r"tokenizer\.json: missing"),
        (lambda d: (d / "tokenizer.json").write_text("{}"), r"tokenizer\.json: cannot load tokenizer"),
    ],
    ids=["no-config", "bad-json", "missing-key", "wrong-type", "no-weights", "truncated", "garbage", "no-tokenizer", "bad-tokenizer"],
)
def test_broken_checkpoint_names_file_and_problem(checkpoint: Path, tmp_path: Path, damage, message: str) -> None:
    """Each damaged file raises CheckpointError whose message names the file and what is wrong."""
    broken = copy_checkpoint(checkpoint, tmp_path / "broken")
    damage(broken)
    with pytest.raises(CheckpointError, match=message):
        load_model(str(broken))


def test_missing_or_misshapen_tensor_is_named(tmp_path: Path, tensors: dict[str, np.ndarray]) -> None:
    """A tensor absent from the file, or with the wrong shape, is named in the error."""
    missing = {k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight' not found"):
        load_model(str(write_checkpoint(tmp_path / "missing", CONFIG, missing)))
    wrong = {**tensors, "model.layers.0.self_attn.k_proj.weight": np.zeros((8, 32), np.float32)}
    with pytest.raises(CheckpointError, match=r"k_proj\.weight has shape \(8, 32\), config\.json implies \(16, 32\)"):
        load_model(str(write_checkpoint(tmp_path / "wrong", CONFIG, wrong)))


def test_rope_scaling_is_read_or_refused(checkpoint: Path, tmp_path: Path) -> None:
    """A llama3 rope_scaling block lands in the config; other scaling types are refused by name."""
    scaled = copy_checkpoint(checkpoint, tmp_path / "scaled")
    raw = json.loads((scaled / "config.json").read_text())
    raw["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 64}
    (scaled / "config.json").write_text(json.dumps(raw))
    assert load_model(str(scaled)).config.rope_scaling == (8.0, 1.0, 4.0, 64)
    raw["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (scaled / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"config\.json: rope_scaling .*yarn.* is not supported"):
        load_model(str(scaled))


def test_unknown_sources_are_refused(tmp_path: Path) -> None:
    """Unknown dummy sizes and non-directories give a CheckpointError, not a stack of numpy errors."""
    with pytest.raises(CheckpointError, match="unknown dummy size"):
        load_model("dummy:huge")
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        load_model(str(tmp_path / "nowhere"))
