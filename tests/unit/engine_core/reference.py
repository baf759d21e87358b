"""Test helpers for the engine core: a tiny config, HF-named random tensors and a naive reference model.

The reference is written independently of `stack.engine.model`: float64, plain loops over heads and
positions, no cache, HF tensor names and (out, in) layout, rotate-half RoPE, repeat_kv GQA.
"""

from __future__ import annotations

import numpy as np
from stack.engine.model import Model
from stack.engine.tokenizer import ByteTokenizer
from stack.engine.weights import ModelConfig, Weights, build_weights, fingerprint

TINY = ModelConfig(vocab_size=262, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=96,
                   norm_eps=1e-5, rope_theta=10000.0, max_seq_len=256)


def random_hf_tensors(config: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """HF-named float32 tensors in (out, in) layout, norms not all ones so their weights matter."""
    rng = np.random.default_rng(seed)
    d, hd, f = config.dim, config.head_dim, config.hidden_dim

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    def norm() -> np.ndarray:
        return (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)

    t = {"model.embed_tokens.weight": rng.standard_normal((config.vocab_size, d)).astype(np.float32),
         "model.norm.weight": norm()}
    for i in range(config.n_layers):
        p = f"model.layers.{i}."
        t |= {p + "self_attn.q_proj.weight": w(config.n_heads * hd, d),
              p + "self_attn.k_proj.weight": w(config.n_kv_heads * hd, d),
              p + "self_attn.v_proj.weight": w(config.n_kv_heads * hd, d),
              p + "self_attn.o_proj.weight": w(d, config.n_heads * hd),
              p + "mlp.gate_proj.weight": w(f, d), p + "mlp.up_proj.weight": w(f, d),
              p + "mlp.down_proj.weight": w(d, f),
              p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm()}
    if not config.tie_embeddings:
        t["lm_head.weight"] = w(config.vocab_size, d)
    return t


def model_from_tensors(config: ModelConfig, tensors: dict[str, np.ndarray]) -> Model:
    weights = build_weights(config, tensors.__getitem__)
    return Model("test", config, weights, ByteTokenizer(), fingerprint(config, weights))


def hf_tensors_from_weights(config: ModelConfig, weights: Weights) -> dict[str, np.ndarray]:
    """Undo the load-time fusion/transposition, to run the reference on a model built by the engine."""
    qd, kvd, f = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim, config.hidden_dim
    t = {"model.embed_tokens.weight": weights.tok_embeddings, "model.norm.weight": weights.norm,
         "lm_head.weight": weights.lm_head.T}
    for i, layer in enumerate(weights.layers):
        p = f"model.layers.{i}."
        qkv, gu = layer.wqkv.T, layer.w_gate_up.T
        q, k = deinterleave(qkv[:qd], config.head_dim), deinterleave(qkv[qd:qd + kvd], config.head_dim)
        t |= {p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
              p + "self_attn.v_proj.weight": qkv[qd + kvd:], p + "self_attn.o_proj.weight": layer.wo.T,
              p + "mlp.gate_proj.weight": gu[:f], p + "mlp.up_proj.weight": gu[f:],
              p + "mlp.down_proj.weight": layer.w_down.T, p + "input_layernorm.weight": layer.attn_norm,
              p + "post_attention_layernorm.weight": layer.mlp_norm}
    return t


def deinterleave(w: np.ndarray, head_dim: int) -> np.ndarray:
    """Engine Q/K rows (pairs adjacent within a head) -> HF rotate-half order (halves)."""
    per_head = w.reshape(-1, head_dim, w.shape[-1])
    return np.concatenate([per_head[:, 0::2], per_head[:, 1::2]], axis=1).reshape(w.shape)


def naive_logits(config: ModelConfig, t: dict[str, np.ndarray], tokens: list[int]) -> np.ndarray:
    """Reference forward without cache: (T,) tokens -> (T, vocab) float64 logits."""
    g = {k: v.astype(np.float64) for k, v in t.items()}
    H, KV, hd = config.n_heads, config.n_kv_heads, config.head_dim
    T = len(tokens)

    def rmsnorm(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + config.norm_eps) * weight

    def rotate(vec: np.ndarray, pos: int) -> np.ndarray:  # (hd,) one head at one position
        out = np.empty(hd)
        for j in range(hd // 2):
            angle = pos / config.rope_theta ** (2 * j / hd)
            a, b = vec[j], vec[j + hd // 2]
            out[j] = a * np.cos(angle) - b * np.sin(angle)
            out[j + hd // 2] = b * np.cos(angle) + a * np.sin(angle)
        return out

    x = g["model.embed_tokens.weight"][tokens]  # (T, dim)
    for i in range(config.n_layers):
        p = f"model.layers.{i}."
        h = rmsnorm(x, g[p + "input_layernorm.weight"])
        q = np.einsum("td,od->to", h, g[p + "self_attn.q_proj.weight"]).reshape(T, H, hd)
        k = np.einsum("td,od->to", h, g[p + "self_attn.k_proj.weight"]).reshape(T, KV, hd)
        v = np.einsum("td,od->to", h, g[p + "self_attn.v_proj.weight"]).reshape(T, KV, hd)
        q = np.array([[rotate(q[s, n], s) for n in range(H)] for s in range(T)])
        k = np.array([[rotate(k[s, n], s) for n in range(KV)] for s in range(T)])
        out = np.zeros((T, H, hd))
        for head in range(H):
            kv_head = head // (H // KV)
            for s in range(T):
                scores = np.array([q[s, head] @ k[j, kv_head] / np.sqrt(hd) for j in range(s + 1)])
                probs = np.exp(scores - scores.max())
                probs /= probs.sum()
                out[s, head] = sum(probs[j] * v[j, kv_head] for j in range(s + 1))
        x = x + np.einsum("ti,oi->to", out.reshape(T, H * hd), g[p + "self_attn.o_proj.weight"])
        h = rmsnorm(x, g[p + "post_attention_layernorm.weight"])
        gate = np.einsum("td,fd->tf", h, g[p + "mlp.gate_proj.weight"])
        up = np.einsum("td,fd->tf", h, g[p + "mlp.up_proj.weight"])
        x = x + np.einsum("tf,df->td", gate / (1 + np.exp(-gate)) * up, g[p + "mlp.down_proj.weight"])
    head_weight = g["model.embed_tokens.weight"] if config.tie_embeddings else g["lm_head.weight"]
    return rmsnorm(x, g["model.norm.weight"]) @ head_weight.T
