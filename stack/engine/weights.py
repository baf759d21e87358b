"""The blueprint (`ModelConfig`) and the tensors (`Weights`) of a Llama-family decoder: data only.

Matmul weights are stored in the layout the forward pass multiplies with, `(in, out)` and
C-contiguous, with Q/K/V fused into one matrix and gate/up fused into another, so one BLAS call
covers each (fewer, bigger GEMMs). Within each Q and K head the output features are reordered from
HF's rotate-half order (j, j + hd/2 as the two halves) to interleaved pairs (j, j + hd/2 adjacent):
rotate-half RoPE then becomes one complex64 multiply, and q.k dot products are unchanged because Q
and K get the same reordering (V and the output projection are untouched). Every array is float32 and read-only: a `Model` is shared by all
requests and must never change under them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class ModelConfig:
    """The hyperparameters of the architecture (the blueprint)."""

    vocab_size: int  # rows of the embedding table and columns of the logits
    dim: int  # width of the residual stream (HF hidden_size)
    n_layers: int  # transformer blocks (HF num_hidden_layers)
    n_heads: int  # query heads (HF num_attention_heads)
    n_kv_heads: int  # key/value heads; n_heads % n_kv_heads == 0 (grouped-query attention)
    hidden_dim: int  # width of the SwiGLU MLP (HF intermediate_size)
    norm_eps: float = 1e-5  # RMSNorm epsilon (HF rms_norm_eps)
    rope_theta: float = 10000.0  # RoPE base frequency
    max_seq_len: int = 2048  # longest sequence the model accepts (HF max_position_embeddings)
    tie_embeddings: bool = False  # lm_head shares the embedding matrix
    # Llama 3.x "llama3" RoPE scaling: (factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings); None = plain RoPE
    rope_scaling: tuple[float, float, float, int] | None = None

    def __post_init__(self) -> None:
        assert self.dim % self.n_heads == 0, f"dim {self.dim} not divisible by n_heads {self.n_heads}"
        assert self.n_heads % self.n_kv_heads == 0, (
            f"n_heads {self.n_heads} not divisible by n_kv_heads {self.n_kv_heads}"
        )
        assert self.head_dim % 2 == 0, f"head_dim {self.head_dim} must be even for RoPE"

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token across all layers, float32."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * np.dtype(np.float32).itemsize

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


@dataclass(frozen=True)
class LayerWeights:
    """One transformer block, matmul weights in (in, out) layout."""

    attn_norm: np.ndarray  # (dim,)
    wqkv: np.ndarray  # (dim, (n_heads + 2 * n_kv_heads) * head_dim)  fused Q|K|V, Q/K interleaved
    wo: np.ndarray  # (n_heads * head_dim, dim)
    mlp_norm: np.ndarray  # (dim,)
    w_gate_up: np.ndarray  # (dim, 2 * hidden_dim)  fused gate|up
    w_down: np.ndarray  # (hidden_dim, dim)


@dataclass(frozen=True)
class Weights:
    """All tensors of the model; read-only float32."""

    tok_embeddings: np.ndarray  # (vocab_size, dim)
    layers: tuple[LayerWeights, ...]
    norm: np.ndarray  # (dim,)
    lm_head: np.ndarray  # (dim, vocab_size); a transposed view of tok_embeddings when tied

    def arrays(self) -> list[tuple[str, np.ndarray]]:
        """Every tensor with a stable name (for fingerprints, byte counts and tests)."""
        named = [("tok_embeddings", self.tok_embeddings)]
        for i, layer in enumerate(self.layers):
            named += [(f"layers.{i}.{k}", v) for k, v in vars(layer).items()]
        named += [("norm", self.norm), ("lm_head", self.lm_head)]
        return named

    @property
    def decode_bytes(self) -> int:
        """Bytes a decode step must stream from memory: every matrix once (the embedding is a gather)."""
        return sum(a.nbytes for name, a in self.arrays() if name != "tok_embeddings")


def freeze(array: np.ndarray) -> np.ndarray:
    """A C-contiguous float32 copy-if-needed of `array` that numpy refuses to write to."""
    out = np.ascontiguousarray(array, dtype=np.float32)
    out.flags.writeable = False
    return out


# tensor(HF name) -> float32 array in HF (out, in) layout
TensorSource = Callable[[str], np.ndarray]


def build_weights(config: ModelConfig, tensor: TensorSource) -> Weights:
    """Assemble fused, frozen `Weights` from HF-named tensors in HF (out, in) layout.

    `tensor(name)` returns the float32 array stored under that HF name (e.g.
    `model.layers.0.self_attn.q_proj.weight`), so checkpoints and dummy weights share one path.
    """
    layers = []
    hd = config.head_dim
    for i in range(config.n_layers):
        p = f"model.layers.{i}."
        q = tensor(p + "self_attn.q_proj.weight")  # (n_heads*head_dim, dim)
        k = tensor(p + "self_attn.k_proj.weight")  # (n_kv_heads*head_dim, dim)
        v = tensor(p + "self_attn.v_proj.weight")  # (n_kv_heads*head_dim, dim)
        gate = tensor(p + "mlp.gate_proj.weight")  # (hidden_dim, dim)
        up = tensor(p + "mlp.up_proj.weight")  # (hidden_dim, dim)
        q, k = interleave_heads(q, hd), interleave_heads(k, hd)
        layers.append(
            LayerWeights(
                attn_norm=freeze(tensor(p + "input_layernorm.weight")),  # (dim,)
                wqkv=freeze(np.concatenate([q, k, v], axis=0).T),  # (dim, (H+2KV)*hd)
                wo=freeze(tensor(p + "self_attn.o_proj.weight").T),  # (H*hd, dim)
                mlp_norm=freeze(tensor(p + "post_attention_layernorm.weight")),  # (dim,)
                w_gate_up=freeze(np.concatenate([gate, up], axis=0).T),  # (dim, 2*hidden)
                w_down=freeze(tensor(p + "mlp.down_proj.weight").T),  # (hidden, dim)
            )
        )
    embed = freeze(tensor("model.embed_tokens.weight"))  # (vocab, dim)
    # Tied: a transposed view, no copy; BLAS reads it with the transpose flag at full speed.
    lm_head = embed.T if config.tie_embeddings else freeze(tensor("lm_head.weight").T)  # (dim, vocab)
    return Weights(embed, tuple(layers), freeze(tensor("model.norm.weight")), lm_head)


def interleave_heads(w: np.ndarray, head_dim: int) -> np.ndarray:
    """(heads*hd, dim) HF rotate-half rows -> rows ordered [0, hd/2, 1, hd/2+1, ...] within each head."""
    half = head_dim // 2
    order = np.stack([np.arange(half), np.arange(half) + half], axis=1).reshape(-1)  # (hd,)
    return w.reshape(-1, head_dim, w.shape[-1])[:, order].reshape(w.shape)  # (heads*hd, dim)


def fingerprint(config: ModelConfig, weights: Weights) -> str:
    """A stable sha256 of the config and a strided sample of every tensor (name, shape, bytes).

    Two models that differ in config or in any tensor (beyond a pathological edit between samples)
    get different fingerprints, so a KV cache is never consumed by the wrong model.
    """
    digest = hashlib.sha256(config.to_json().encode())
    for name, array in weights.arrays():
        flat = array.reshape(-1)  # (numel,)
        sample = flat[:: max(1, flat.size // 4096)]  # (<= ~4096,)
        digest.update(f"{name}:{array.shape}".encode())
        digest.update(np.ascontiguousarray(sample).tobytes())
    return digest.hexdigest()[:16]
