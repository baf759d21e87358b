"""The compiled decode attention (kernels.py via batched_decode.py) gives attention.py's numbers: greedy tokens
equal, logprobs within 1e-4, for one sequence, a mixed batch across block boundaries, a prefix-cached table and a
short prompt tail; it really replaces the numpy path for decode segments, runs on attention_threads() cores, and
the engine falls back to numpy when numba does not import. (That it reads the block table: test_paged.py's
wrong-table test, run on both paths.)"""

from __future__ import annotations

import io
import json
import sys

import numpy as np
import pytest

from stack.common.logging import setup_logging

from stack.engine import attention as attention_module
from stack.engine import batched_decode
from stack.engine import model as model_module
from stack.engine.kv_cache import KVCache, KVPool
from stack.engine.model import Model, Segment, forward

from .reference import TINY, naive_logits
from .test_paged import BS, PROMPT, assert_long_prompt_matches_reference, assert_matches_reference, scattered_pool


SHIPPED_MIN_SEGMENTS = batched_decode.MIN_SEGMENTS


@pytest.fixture(autouse=True)
def kernel_for_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests compare the kernel's numbers, a lone sequence's too: it takes every thin segment here.
    Which steps it takes as shipped: test_a_lone_decode_stays_on_numpy_and_two_take_the_kernel."""
    monkeypatch.setattr(batched_decode, "MIN_SEGMENTS", 1)


def both_ways(model: Model, segments: list[Segment]) -> tuple[np.ndarray, np.ndarray]:
    """One step's last-token logits through the kernel and through numpy, from the same cache state (the step writes
    the same K/V either way; lengths are rewound in between)."""
    lengths = [s.cache.length for s in segments]
    kernel = forward(model, segments, attention="numba")
    for s, n in zip(segments, lengths):
        s.cache.length = n
    return kernel, forward(model, segments, attention="numpy")


def test_one_sequence_decodes_like_numpy_and_the_reference(tiny_model: Model, tiny_tensors: dict) -> None:
    """Prefill then greedy decode steps over scattered blocks: the kernel's logits equal numpy's and the naive
    reference's at every step."""
    cache = scattered_pool().allocate(len(PROMPT) + 6)
    assert cache is not None
    logits = forward(tiny_model, [Segment(np.array(PROMPT), cache, 0)], attention="numpy")[0]
    tokens = list(PROMPT)
    for _ in range(5):
        tokens.append(int(logits.argmax()))  # greedy
        kernel, numpy = both_ways(tiny_model, [Segment(np.array(tokens[-1:]), cache, cache.length)])
        assert_matches_reference(kernel, numpy)
        assert_matches_reference(kernel[0], naive_logits(TINY, tiny_tensors, tokens)[-1])
        logits = kernel[0]


@pytest.mark.parametrize("threads", [1, 2])
def test_a_mixed_batch_across_block_boundaries_matches_numpy(tiny_model: Model, monkeypatch: pytest.MonkeyPatch,
                                                             threads: int) -> None:
    """One kernel call per layer over 12 sequences of 1 to 61 tokens whose single-block runs interleave in the pool
    (each crosses a different number of block boundaries, some sit exactly on one) equals numpy's step."""
    monkeypatch.setattr(model_module, "attention_threads", lambda: threads)
    rng = np.random.default_rng(11)
    lengths = [1, 3, 4, 5, 8, 15, 16, 17, 31, 32, 33, 61]
    pool = scattered_pool(300)
    caches = [pool.allocate(n + 1) for n in lengths]
    for cache, n in zip(caches, lengths):
        assert cache is not None
        forward(tiny_model, [Segment(rng.integers(0, 256, n), cache, 0)], attention="numpy")
    new_tokens = rng.integers(0, 256, len(caches))
    segments = [Segment(np.array([int(t)]), c, c.length) for c, t in zip(caches, new_tokens)]  # type: ignore[arg-type]
    kernel, numpy = both_ways(tiny_model, segments)
    assert_matches_reference(kernel, numpy)
    import numba

    # the kernel ran on attention_threads() cores (numba's count is per calling thread)
    assert numba.get_num_threads() == min(threads, numba.config.NUMBA_NUM_THREADS)


def test_a_prefix_cached_table_decodes_like_numpy(tiny_model: Model, tiny_tensors: dict) -> None:
    """A table that starts with another sequence's cached blocks (shared by reference) decodes through the kernel as
    the reference says, the shared blocks read where the first sequence wrote them."""
    pool = scattered_pool()
    first = pool.allocate(len(PROMPT))
    assert first is not None
    forward(tiny_model, [Segment(np.array(PROMPT), first, 0)], attention="numpy")
    second = pool.allocate(len(PROMPT) + 4, first.table[:4].tolist())
    assert second is not None
    second.set_length(4 * BS)
    tail = PROMPT[4 * BS :] + [9]
    forward(tiny_model, [Segment(np.array(tail), second, 4 * BS)], attention="numpy")
    kernel, numpy = both_ways(tiny_model, [Segment(np.array([42]), second, second.length)])
    assert_matches_reference(kernel, numpy)
    assert_matches_reference(kernel[0], naive_logits(TINY, tiny_tensors, PROMPT + [9, 42])[-1])


def test_a_short_prompt_tail_is_causal_in_the_kernel(tiny_model: Model, tiny_tensors: dict) -> None:
    """A thin segment of several tokens (a prompt tail after a prefix hit, T * G < THIN_QUERIES) goes through the
    kernel too: each of its queries sees only the keys up to its own position."""
    cache = scattered_pool().allocate(len(PROMPT))
    assert cache is not None
    forward(tiny_model, [Segment(np.array(PROMPT[:10]), cache, 0)], attention="numpy")
    tail = Segment(np.array(PROMPT[10:]), cache, 10)
    assert len(PROMPT[10:]) * TINY.n_heads // TINY.n_kv_heads < attention_module.THIN_QUERIES
    logits = forward(tiny_model, [tail], all_logits=True, attention="numba")[0]
    assert_matches_reference(logits, naive_logits(TINY, tiny_tensors, PROMPT)[10:])


def test_decode_segments_skip_the_numpy_path(tiny_model: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the kernel on, a step of decodes beside a prefill chunk calls attention.py only for the chunk's query
    blocks, handing it the compiled exp of its score tiles; with attention="numpy" for every segment, numpy alone."""
    calls: list[tuple[int, bool]] = []  # (queries, compiled exp given)
    reference = attention_module.attention

    def counting(q, runs, start_pos, ops=attention_module.NUMPY):  # type: ignore[no-untyped-def]
        calls.append((len(q), ops.exp_rows is not None))
        return reference(q, runs, start_pos, ops)

    monkeypatch.setattr(attention_module, "attention", counting)
    pool = KVPool(TINY, 4096 * TINY.kv_bytes_per_token, BS)
    decodes = [pool.allocate(20) for _ in range(3)]
    for cache in decodes:
        forward(tiny_model, [Segment(np.arange(10), cache, 0)], attention="numpy")  # type: ignore[arg-type]
    chunk_cache = pool.allocate(100)
    step = [Segment(np.array([5]), c, 10) for c in decodes]  # type: ignore[arg-type]
    step.append(Segment(np.arange(100) % 256, chunk_cache, 0))  # type: ignore[arg-type]
    calls.clear()
    forward(tiny_model, step, attention="numba")
    assert calls == [(100, True)] * TINY.n_layers  # the chunk only: one query block per layer
    for cache in decodes:
        cache.length = 10  # type: ignore[union-attr]
    chunk_cache.length = 0  # type: ignore[union-attr]
    calls.clear()
    forward(tiny_model, step, attention="numpy")
    assert sorted(calls) == sorted([(1, False)] * 3 * TINY.n_layers + [(100, False)] * TINY.n_layers)


def test_without_numba_the_engine_runs_numpy_and_says_so_once(tiny_model: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    """numba not importable: compiled() answers None after one engine.attention warning (reason numba_missing) and
    forward with attention="numba" gives numpy's logits."""
    monkeypatch.setitem(sys.modules, "numba", None)  # `import numba` raises ImportError
    monkeypatch.setitem(sys.modules, "stack.engine.kernels", None)
    batched_decode.compiled.cache_clear()
    sink = io.StringIO()
    setup_logging("engine-test", sink=sink)
    try:
        cache = KVCache(TINY, 8)
        got = forward(tiny_model, [Segment(np.arange(5), cache, 0)], attention="numba")
        cache.length = 0
        assert batched_decode.compiled() is None
        np.testing.assert_array_equal(got, forward(tiny_model, [Segment(np.arange(5), cache, 0)], attention="numpy"))
    finally:
        setup_logging("engine-test")
        batched_decode.compiled.cache_clear()
    lines = [json.loads(line) for line in sink.getvalue().splitlines() if '"engine.attention"' in line]
    assert len(lines) == 1
    assert (lines[0]["level"], lines[0]["attention"], lines[0]["reason"]) == ("WARNING", "numpy", "numba_missing")


def test_a_lone_decode_stays_on_numpy_and_two_take_the_kernel(tiny_model: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    """As shipped (MIN_SEGMENTS 2: a lone sequence's attention is faster through numpy's BLAS, batched_decode.py),
    one decode segment goes to attention.py and a step of two goes to the kernel alone."""
    monkeypatch.setattr(batched_decode, "MIN_SEGMENTS", SHIPPED_MIN_SEGMENTS)
    assert SHIPPED_MIN_SEGMENTS == 2
    calls: list[int] = []
    reference = attention_module.attention
    monkeypatch.setattr(attention_module, "attention", lambda q, *a: calls.append(len(q)) or reference(q, *a))
    pool = scattered_pool()
    caches = [pool.allocate(len(PROMPT) + 2) for _ in range(2)]
    for cache in caches:
        assert cache is not None
        forward(tiny_model, [Segment(np.array(PROMPT), cache, 0)], attention="numpy")
    calls.clear()
    forward(tiny_model, [Segment(np.array([5]), caches[0], caches[0].length)], attention="numba")  # type: ignore[union-attr]
    assert calls == [1] * TINY.n_layers  # one query a layer, through numpy
    calls.clear()
    forward(tiny_model, [Segment(np.array([6]), c, c.length) for c in caches], attention="numba")  # type: ignore[union-attr]
    assert calls == []


def test_the_kernels_softmax_matches_numpys_over_the_whole_float32_range() -> None:
    """The kernel computes exp itself (kernels.exp_shifted, shifted by the row's maximum as the QK pass finds it):
    scores from far below float32's underflow to large ones,
    against numpy's exp in float64. Within 1e-5 relative wherever the weight is above 1e-30 (1e-7 near the top);
    lighter weights (below exp(-87): float32's smallest normal instead of 0) are off by less than 1e-35."""
    from stack.engine import kernels

    scores = np.concatenate([np.linspace(-300, 80, 4001), [80.0, 79.3, -87.5, 0.0]]).astype(np.float32)  # (4005,)
    row = scores.copy()
    inverse = 1 / kernels.exp_shifted(row, scores.max(), np.empty(row.shape[0], np.int32))
    expected = np.exp(scores.astype(np.float64) - scores.max())
    weighty = expected > 1e-30
    np.testing.assert_allclose(row[weighty], expected[weighty], rtol=1e-5)
    np.testing.assert_allclose(row[expected > 0.5], expected[expected > 0.5], rtol=1e-7)
    assert np.abs(row[~weighty] - expected[~weighty]).max() < 1e-35
    assert inverse == pytest.approx(1 / expected.sum(), rel=1e-6)


def test_the_compiled_tile_exp_matches_numpys() -> None:
    """kernels.exp_rows, a prefill tile's exp and row sums: against numpy in float64 for scores across float32's range,
    shifted by a running maximum above the row's own (a later tile) and with masked -inf keys, which weigh less than
    1e-35 (exp(-87), not 0)."""
    kernels = batched_decode.compiled()
    assert kernels is not None
    rng = np.random.default_rng(7)
    scores = (rng.standard_normal((37, 301)) * 40).astype(np.float32)  # (rows, n): some rows span > 87 below the max
    scores[5, 200:] = -np.inf  # a diagonal tile's masked keys
    shift = (scores.max(axis=-1) + rng.uniform(0, 3, 37)).astype(np.float32)  # (rows,) a running max at or above
    got, sums = scores.copy(), np.empty(37, np.float32)
    kernels.exp_rows(got, shift, sums)
    expected = np.exp(scores.astype(np.float64) - shift[:, None])
    weighty = expected > 1e-30
    np.testing.assert_allclose(got[weighty], expected[weighty], rtol=1e-5)
    assert np.abs(got[~weighty] - expected[~weighty]).max() < 1e-35
    np.testing.assert_allclose(sums, expected.sum(axis=-1), rtol=1e-5)


@pytest.mark.usefixtures("small_tiles")
def test_a_long_prompt_through_the_compiled_exp_matches_the_reference(tiny_model: Model, tiny_tensors: dict,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt cut into many query blocks and key tiles (the causal diagonal in some, the online softmax across
    them), attended with the compiled tile exp: the reference's logits at every position."""
    used: list[bool] = []
    fold = attention_module.exp_shifted
    monkeypatch.setattr(attention_module, "exp_shifted", lambda s, shift, exp_rows: used.append(exp_rows is not None) or fold(s, shift, exp_rows))
    assert_long_prompt_matches_reference(tiny_model, tiny_tensors, seed=5)
    assert used and all(used)
