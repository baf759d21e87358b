"""Write a small random-weight Llama checkpoint in Hugging Face layout, served by vLLM and by this engine.

    python -m stack.engine.tiny_llama OUT_DIR [--layers 2] [--hidden 256] [--heads 4] [--kv-heads 2]
                                              [--ffn 512] [--max-len 2048] [--seed 0]

It lives next to the engine's loader because it is the engine's own dummy model written out: the
tensors are `dummy_tensors` (the same seeded draw as `--model tiny`), the tokenizer and chat
template are the dummy models' own (stack/engine/data/dummy_bpe.json, its Hermes / Qwen2.5 tool
template), so the numpy engine and a real vLLM read the SAME files (the vllm test tier and
benchmarks/vllm_anchor.py compare them). Files, as `save_pretrained` lays them out: config.json
(LlamaForCausalLM), model.safetensors (float32), tokenizer.json, tokenizer_config.json,
generation_config.json. head_dim is 64, a size vLLM's CPU attention supports.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from stack.engine.checkpoint import dummy_tensors
from stack.engine.tokenizer import DUMMY_BPE_PATH, dummy_tokenizer, dummy_tokenizer_config
from stack.engine.weights import ModelConfig

# Sentences benchmarks/vllm_anchor.py draws its prompts' words from.
CORPUS = ["hello world", "the quick brown fox jumps over the lazy dog", "explain the key value cache in one sentence",
          "numpy engines prefill and decode", "key value cache transfer", "disaggregated prefill and decode",
          '{"name": "get_weather", "arguments": {"city": "Paris"}}', "héllo wörld 世界"] * 8


def hf_config_json(config: ModelConfig, bos_id: int | None = None, eos_id: int | None = None) -> dict:
    """config.json for `config` (LlamaForCausalLM, float32)."""
    out = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": config.vocab_size,
           "hidden_size": config.dim, "intermediate_size": config.hidden_dim,
           "num_hidden_layers": config.n_layers, "num_attention_heads": config.n_heads,
           "num_key_value_heads": config.n_kv_heads, "head_dim": config.head_dim, "rms_norm_eps": config.norm_eps,
           "rope_theta": config.rope_theta, "max_position_embeddings": config.max_seq_len,
           "tie_word_embeddings": config.tie_embeddings, "torch_dtype": "float32", "rope_scaling": None,
           "hidden_act": "silu"}
    if bos_id is not None:
        out |= {"bos_token_id": bos_id, "eos_token_id": eos_id}
    return out


def write(root: Path, layers: int = 2, hidden: int = 256, heads: int = 4, kv_heads: int = 2, ffn: int = 512,
          max_len: int = 2048, seed: int = 0) -> ModelConfig:
    """Write the checkpoint into `root`; returns its config. Same arguments, same bytes."""
    root.mkdir(parents=True, exist_ok=True)
    tok = dummy_tokenizer()
    (root / "tokenizer.json").write_bytes(DUMMY_BPE_PATH.read_bytes())
    config = ModelConfig(vocab_size=tok.vocab_size, dim=hidden, n_layers=layers,
                         n_heads=heads, n_kv_heads=kv_heads, hidden_dim=ffn, norm_eps=1e-6, max_seq_len=max_len)
    tensors = dummy_tensors(config, seed)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(root / "model.safetensors"),
              metadata={"format": "pt"})
    bos, eos = tok.bos_id, tok.eos_id
    (root / "config.json").write_text(json.dumps(hf_config_json(config, bos, eos), indent=1))
    (root / "tokenizer_config.json").write_text(json.dumps(dummy_tokenizer_config() | {"model_max_length": max_len}, indent=1))
    (root / "generation_config.json").write_text(json.dumps({"bos_token_id": bos, "eos_token_id": eos}))
    return config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    for flag, default in (("layers", 2), ("hidden", 256), ("heads", 4), ("kv-heads", 2), ("ffn", 512),
                          ("max-len", 2048), ("seed", 0)):
        ap.add_argument(f"--{flag}", type=int, default=default)
    a = ap.parse_args()
    config = write(a.out, a.layers, a.hidden, a.heads, a.kv_heads, a.ffn, a.max_len, a.seed)
    print(f"wrote {a.out}: {config.n_layers} layers, hidden {config.dim}, heads {config.n_heads}/{config.n_kv_heads} "
          f"(head_dim {config.head_dim}), vocab {config.vocab_size}")


if __name__ == "__main__":
    main()
