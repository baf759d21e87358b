"""Writes a tiny Llama checkpoint in Hugging Face format, the way `save_pretrained` lays it out."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from stack.engine.tiny_llama import hf_config_json
from stack.engine.weights import ModelConfig

CHECKPOINT_CONFIG = ModelConfig(vocab_size=300, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64,
                                norm_eps=1e-6, rope_theta=50000.0, max_seq_len=128)

# A ChatML-style template, as many HF checkpoints ship.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CORPUS = ["hello world", "the quick brown fox jumps over the lazy dog", "héllo wörld 世界 🌍",
          "numpy engines prefill and decode", "key value cache transfer"] * 4


def train_tokenizer(path: Path, vocab_size: int) -> Tokenizer:
    """A byte-level BPE trained on a few sentences, with <s> prepended like Llama's post-processor."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    tok.save(str(path))
    return tok


def write_bf16_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """safetensors.numpy cannot write bfloat16, so write the format by hand (truncating float32)."""
    header, blobs, offset = {}, [], 0
    for name, array in tensors.items():
        blob = (np.ascontiguousarray(array, np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
        header[name] = {"dtype": "BF16", "shape": list(array.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


def write_checkpoint(root: Path, config: ModelConfig, tensors: dict[str, np.ndarray], shards: int = 1,
                     dtype: str = "F32") -> Path:
    """config.json, model.safetensors (or `shards` files + index), tokenizer.json, tokenizer_config.json."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(hf_config_json(config)))
    names = sorted(tensors)
    if shards == 1:
        files = {"model.safetensors": names}
    else:
        files = {f"model-{i + 1:05d}-of-{shards:05d}.safetensors": names[i::shards] for i in range(shards)}
        weight_map = {name: file for file, part in files.items() for name in part}
        (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for file, part in files.items():
        subset = {name: np.ascontiguousarray(tensors[name]) for name in part}
        if dtype == "BF16":
            write_bf16_safetensors(root / file, subset)
        else:
            save_file({k: v.astype(np.float16 if dtype == "F16" else np.float32) for k, v in subset.items()},
                      str(root / file))
    train_tokenizer(root / "tokenizer.json", config.vocab_size)
    (root / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}, "chat_template": CHAT_TEMPLATE}))
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 3]}))
    return root
