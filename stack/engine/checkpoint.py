"""Where weights come from: deterministic dummy weights from a seed, or a Hugging Face checkpoint.

Dummy models (like vLLM's `--load-format dummy`) draw every tensor from one seeded generator with
a 1/sqrt(fan_in) scale, so activations stay O(1) and logits have a spread that makes sampling
non-degenerate. Checkpoints are Llama-family directories: config.json, model.safetensors or a
sharded model.safetensors.index.json, tokenizer.json and tokenizer_config.json; F32/F16/BF16 tensors
are converted to float32. Any problem raises `CheckpointError` naming the file and what is wrong.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from stack.engine.errors import CheckpointError
from stack.engine.tokenizer import HFTokenizer, Tokenizer, dummy_tokenizer
from stack.engine.weights import ModelConfig, Weights, build_weights

_DUMMY_VOCAB = dummy_tokenizer().vocab_size  # embedding rows follow the tokenizer

DUMMY_CONFIGS = {
    # fast enough for unit tests
    "tiny": ModelConfig(vocab_size=_DUMMY_VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                        hidden_dim=192, max_seq_len=512),
    # ~42M parameters (17M of them the 16,390-row embedding and lm_head). 64k context: a coding agent's
    # long session fits (16 KiB of float32 KV per token: 1 GiB for a full window; docs/long-prompts.md)
    "small": ModelConfig(vocab_size=_DUMMY_VOCAB, dim=512, n_layers=8, n_heads=8, n_kv_heads=4,
                         hidden_dim=1536, max_seq_len=65536),
}

# config.json key -> (ModelConfig field, required)
_HF_KEYS = {
    "vocab_size": ("vocab_size", True),
    "hidden_size": ("dim", True),
    "num_hidden_layers": ("n_layers", True),
    "num_attention_heads": ("n_heads", True),
    "num_key_value_heads": ("n_kv_heads", False),
    "intermediate_size": ("hidden_dim", True),
    "rms_norm_eps": ("norm_eps", False),
    "rope_theta": ("rope_theta", False),
    "max_position_embeddings": ("max_seq_len", False),
    "tie_word_embeddings": ("tie_embeddings", False),
}


def dummy_weights(config: ModelConfig, seed: int) -> Weights:
    """Deterministic random weights for `config` from `seed`."""
    return build_weights(config, dummy_tensors(config, seed).__getitem__)


def dummy_tensors(config: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """The same weights as Hugging Face-named float32 tensors (what stack.engine.tiny_llama writes)."""
    rng = np.random.default_rng(seed)
    d, hd, f = config.dim, config.head_dim, config.hidden_dim

    def normal(rows: int, cols: int, fan_in: int) -> np.ndarray:  # (rows, cols) HF (out, in)
        return rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(fan_in**-0.5)

    tensors = {"model.embed_tokens.weight": normal(config.vocab_size, d, 1), "model.norm.weight": np.ones(d, np.float32)}
    for i in range(config.n_layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": normal(config.n_heads * hd, d, d),
            p + "self_attn.k_proj.weight": normal(config.n_kv_heads * hd, d, d),
            p + "self_attn.v_proj.weight": normal(config.n_kv_heads * hd, d, d),
            p + "self_attn.o_proj.weight": normal(d, config.n_heads * hd, config.n_heads * hd),
            p + "mlp.gate_proj.weight": normal(f, d, d),
            p + "mlp.up_proj.weight": normal(f, d, d),
            p + "mlp.down_proj.weight": normal(d, f, f),
            p + "input_layernorm.weight": np.ones(d, np.float32),
            p + "post_attention_layernorm.weight": np.ones(d, np.float32),
        }
    if not config.tie_embeddings:
        tensors["lm_head.weight"] = normal(config.vocab_size, d, d)
    return tensors


def load_checkpoint(directory: str | Path) -> tuple[ModelConfig, Weights, Tokenizer]:
    """Config, weights and tokenizer of the HF Llama-family checkpoint in `directory`."""
    root = Path(directory)
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a checkpoint directory")
    config = read_hf_config(root / "config.json")
    tensors = SafetensorsReader(root)

    def tensor(name: str) -> np.ndarray:
        array = tensors.get(name)
        expected = _expected_shape(config, name)
        if expected is not None and array.shape != expected:
            raise CheckpointError(f"{tensors.file_of(name)}: tensor {name} has shape {array.shape}, "
                                  f"config.json implies {expected}")
        return array

    weights = build_weights(config, tensor)
    return config, weights, load_hf_tokenizer(root, config)


def read_hf_config(path: Path) -> ModelConfig:
    raw = _read_json(path)
    scaling = raw.get("rope_scaling")
    if scaling and (not isinstance(scaling, dict) or (scaling.get("rope_type") or scaling.get("type")) != "llama3"):
        raise CheckpointError(f"{path}: rope_scaling {scaling!r} is not supported (only rope_type 'llama3')")
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise CheckpointError(f"{path}: attention/MLP biases are not supported (Llama without biases only)")
    if raw.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{path}: hidden_act {raw['hidden_act']!r} is not supported (SwiGLU uses silu)")
    fields = {}
    for key, (field, required) in _HF_KEYS.items():
        if key in raw and raw[key] is not None:
            fields[field] = _checked(path, key, raw[key], ModelConfig.__dataclass_fields__[field].type)
        elif required:
            raise CheckpointError(f"{path}: missing required key {key!r}")
    fields.setdefault("n_kv_heads", fields["n_heads"])
    if scaling:
        try:
            fields["rope_scaling"] = (float(scaling["factor"]), float(scaling["low_freq_factor"]),
                                      float(scaling["high_freq_factor"]), int(scaling["original_max_position_embeddings"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{path}: rope_scaling needs factor, low_freq_factor, high_freq_factor and "
                                  f"original_max_position_embeddings ({exc!r})") from exc
    head_dim = raw.get("head_dim")
    if head_dim is not None and head_dim * fields["n_heads"] != fields["dim"]:
        raise CheckpointError(f"{path}: head_dim {head_dim} != hidden_size / num_attention_heads is not supported")
    try:
        return ModelConfig(**fields)
    except (AssertionError, TypeError) as exc:
        raise CheckpointError(f"{path}: inconsistent model shape: {exc}") from exc


def load_hf_tokenizer(root: Path, config: ModelConfig) -> Tokenizer:
    path = root / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (the engine needs the fast tokenizer file)")
    tok_config = _read_json(root / "tokenizer_config.json") if (root / "tokenizer_config.json").is_file() else {}
    gen_path = root / "generation_config.json"
    eos = _read_json(gen_path).get("eos_token_id") if gen_path.is_file() else None
    extra_eos = eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else []
    try:
        tokenizer = HFTokenizer(str(path), tok_config, extra_eos)
    except Exception as exc:  # tokenizers raises bare Exception subclasses for bad files
        raise CheckpointError(f"{path}: cannot load tokenizer: {exc}") from exc
    if tokenizer.vocab_size > config.vocab_size:
        raise CheckpointError(f"{path}: tokenizer has {tokenizer.vocab_size} tokens, model vocab_size is {config.vocab_size}")
    return tokenizer


class SafetensorsReader:
    """Tensors by name across model.safetensors or the shards listed in model.safetensors.index.json.

    The format is read directly (8-byte header length, JSON header, raw bytes) because
    `safetensors.numpy` cannot represent bfloat16, the dtype most checkpoints ship in.
    """

    _DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}

    def __init__(self, root: Path) -> None:
        index, single = root / "model.safetensors.index.json", root / "model.safetensors"
        self._source = index if index.is_file() else single
        if index.is_file():
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: no 'weight_map' object")
            self._file = {name: root / shard for name, shard in weight_map.items()}
        elif single.is_file():
            self._file = {name: single for name in self._header(single)}
        else:
            raise CheckpointError(f"{root}: neither model.safetensors nor model.safetensors.index.json found")
        self._headers: dict[Path, dict] = {}

    def file_of(self, name: str) -> Path:
        if name not in self._file:
            raise CheckpointError(f"{self._source}: tensor {name!r} not found")
        return self._file[name]

    def get(self, name: str) -> np.ndarray:
        """The tensor as float32 (a fresh array; the file is memory-mapped while reading)."""
        path = self.file_of(name)
        header = self._headers.setdefault(path, self._header(path))
        if name not in header:
            raise CheckpointError(f"{path}: tensor {name!r} listed in the index but not in the file")
        meta = header[name]
        dtype = self._DTYPES.get(meta.get("dtype"))
        if dtype is None:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {meta.get('dtype')!r}")
        start, end = meta["data_offsets"]
        count = int(np.prod(meta["shape"], dtype=np.int64))
        if end - start != count * np.dtype(dtype).itemsize:
            raise CheckpointError(f"{path}: tensor {name!r} byte range does not match shape {meta['shape']}")
        base = meta["__base__"]
        try:
            raw = np.memmap(path, dtype=np.uint8, mode="r", offset=base + start, shape=(end - start,))
        except (ValueError, OSError) as exc:
            raise CheckpointError(f"{path}: truncated data for tensor {name!r}: {exc}") from exc
        values = raw.view(dtype).reshape(meta["shape"])
        if meta["dtype"] == "BF16":  # bfloat16 = the top 16 bits of a float32
            return (values.astype(np.uint32) << 16).view(np.float32)
        return values.astype(np.float32)

    @staticmethod
    def _header(path: Path) -> dict:
        try:
            with path.open("rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                if size > 100_000_000:
                    raise ValueError(f"header length {size} is implausible")
                header = json.loads(f.read(size))
        except FileNotFoundError as exc:
            raise CheckpointError(f"{path}: missing") from exc
        except (struct.error, ValueError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{path}: not a safetensors file ({exc})") from exc
        header.pop("__metadata__", None)
        file_size = path.stat().st_size
        for meta in header.values():
            meta["__base__"] = 8 + size
            if 8 + size + meta["data_offsets"][1] > file_size:
                raise CheckpointError(f"{path}: truncated (tensor data runs past the end of the file)")
        return header


def _checked(path: Path, key: str, value: object, type_name: str) -> object:
    """`value` if it has the field's type (ints positive), else a CheckpointError naming the key."""
    if type_name == "bool":
        ok = isinstance(value, bool)
    elif type_name == "int":
        ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
    else:  # float
        ok = isinstance(value, int | float) and not isinstance(value, bool) and value > 0
    if not ok:
        raise CheckpointError(f"{path}: {key} must be a positive {type_name}, got {value!r}")
    return value


def _expected_shape(config: ModelConfig, name: str) -> tuple[int, ...] | None:
    d, hd = config.dim, config.head_dim
    suffixes = {
        "embed_tokens.weight": (config.vocab_size, d), "lm_head.weight": (config.vocab_size, d),
        "q_proj.weight": (config.n_heads * hd, d), "k_proj.weight": (config.n_kv_heads * hd, d),
        "v_proj.weight": (config.n_kv_heads * hd, d), "o_proj.weight": (d, config.n_heads * hd),
        "gate_proj.weight": (config.hidden_dim, d), "up_proj.weight": (config.hidden_dim, d),
        "down_proj.weight": (d, config.hidden_dim), "norm.weight": (d,), "layernorm.weight": (d,),
    }
    return next((shape for suffix, shape in suffixes.items() if name.endswith(suffix)), None)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path}: missing") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: invalid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data
