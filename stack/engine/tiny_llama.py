"""Write a small random-weight Llama checkpoint in Hugging Face layout, served by vLLM and by this engine.

    python -m stack.engine.tiny_llama OUT_DIR [--layers 2] [--hidden 256] [--heads 4] [--kv-heads 2]
                                              [--ffn 512] [--vocab 512] [--max-len 2048] [--seed 0]

It lives next to the engine's loader because it is the engine's own dummy model written out: the
tensors are `dummy_tensors` (the same seeded draw as `--model tiny`), the chat template is the
byte tokenizer's Hermes / Qwen2.5 tool template, so the numpy engine and a real vLLM read the SAME
files (the vllm test tier and benchmarks/vllm_anchor.py compare them). Files, as `save_pretrained`
lays them out: config.json (LlamaForCausalLM), model.safetensors (float32), tokenizer.json
(byte-level BPE trained on a few sentences, `<s>` prepended), tokenizer_config.json,
generation_config.json.

`<tool_call>` and `</tool_call>` are added (non-special, as in Qwen2.5's tokenizer) because vLLM's
`hermes` tool parser refuses a tokenizer without them; head_dim is 64, a size vLLM's CPU attention
supports.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from stack.engine.checkpoint import dummy_tensors
from stack.engine.tokenizer import BYTE_CHAT_TEMPLATE, ROLE_MARKERS
from stack.engine.weights import ModelConfig

BOS, EOS = "<s>", "</s>"
SPECIALS = [BOS, EOS, *ROLE_MARKERS.values()]
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<tools>", "</tools>"]
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


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """Byte-level BPE (every UTF-8 string encodes) with Llama's `<s>` post-processor and the tool tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, tok.token_to_id(BOS))])
    return tok


def write(root: Path, layers: int = 2, hidden: int = 256, heads: int = 4, kv_heads: int = 2, ffn: int = 512,
          vocab: int = 512, max_len: int = 2048, seed: int = 0) -> ModelConfig:
    """Write the checkpoint into `root`; returns its config. Same arguments, same bytes."""
    root.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(vocab)
    tok.save(str(root / "tokenizer.json"))
    # embedding rows = what the tokenizer can produce (training may stop short of `vocab`)
    config = ModelConfig(vocab_size=tok.get_vocab_size(with_added_tokens=True), dim=hidden, n_layers=layers,
                         n_heads=heads, n_kv_heads=kv_heads, hidden_dim=ffn, norm_eps=1e-6, max_seq_len=max_len)
    tensors = dummy_tensors(config, seed)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(root / "model.safetensors"),
              metadata={"format": "pt"})
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    (root / "config.json").write_text(json.dumps(hf_config_json(config, bos, eos), indent=1))
    (root / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
        "model_max_length": max_len, "chat_template": BYTE_CHAT_TEMPLATE}, indent=1))
    (root / "generation_config.json").write_text(json.dumps({"bos_token_id": bos, "eos_token_id": eos}))
    return config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    for flag, default in (("layers", 2), ("hidden", 256), ("heads", 4), ("kv-heads", 2), ("ffn", 512),
                          ("vocab", 512), ("max-len", 2048), ("seed", 0)):
        ap.add_argument(f"--{flag}", type=int, default=default)
    a = ap.parse_args()
    config = write(a.out, a.layers, a.hidden, a.heads, a.kv_heads, a.ffn, a.vocab, a.max_len, a.seed)
    print(f"wrote {a.out}: {config.n_layers} layers, hidden {config.dim}, heads {config.n_heads}/{config.n_kv_heads} "
          f"(head_dim {config.head_dim}), vocab {config.vocab_size}")


if __name__ == "__main__":
    main()
