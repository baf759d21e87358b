"""The weight matmuls on oneMKL's packed GEMM and on the compiled kernel (gemm.py) give numpy's numbers: each matrix
at every row count, and a batched decode through a model on either matches the numpy model and the float64
reference (greedy tokens equal, logprobs within 1e-4). The packed copy (the transposed copy) is really what
2..MAX_ROWS rows multiply by, one row and big chunks stay on numpy, auto picks MKL on Intel CPUs and the kernel on
others, and without MKL the engine runs numpy and says so once."""

from __future__ import annotations

import io
import json
from dataclasses import replace

import numpy as np
import pytest

from stack.common.logging import setup_logging
from stack.engine import gemm
from stack.engine.kv_cache import KVCache
from stack.engine.model import Model, Segment, attention_threads, forward

from .reference import TINY, naive_logits
from .test_paged import PROMPT, assert_long_prompt_matches_reference, assert_matches_reference, scattered_pool


@pytest.fixture(scope="module")
def mkl_model(tiny_model: Model) -> Model:
    """The reference's tiny model with its weights packed for MKL (MKL is a runtime dependency: it must load)."""
    matmul = gemm.weight_matmul(tiny_model.weights, "mkl", attention_threads())
    assert isinstance(matmul, gemm.PackedMatmul), "oneMKL did not load: `pip install mkl` (pyproject.toml)"
    return replace(tiny_model, matmul=matmul)


@pytest.fixture(scope="module")
def numba_model(tiny_model: Model) -> Model:
    """The reference's tiny model with its weights transposed for the compiled kernel (numba is a runtime dependency)."""
    matmul = gemm.weight_matmul(tiny_model.weights, "numba", attention_threads())
    assert isinstance(matmul, gemm.CompiledMatmul), "numba did not import (pyproject.toml)"
    return replace(tiny_model, matmul=matmul)


@pytest.fixture(params=["mkl", "numba"])
def fast_model(request: pytest.FixtureRequest) -> Model:
    """Each of the two fast weight-matmul paths in turn."""
    return request.getfixturevalue(f"{request.param}_model")


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, gemm.PACK_ROWS, 33, gemm.MAX_ROWS, gemm.MAX_ROWS + 1, 2048])
def test_every_weight_matrix_at_every_row_count_equals_numpy(fast_model: Model, rows: int) -> None:
    """Packed once (for PACK_ROWS rows) or transposed once, each matrix serves any row count (the kernel's padding
    to whole row blocks, and tiny's 128-column wqkv its 4 x 1 tail): within float32 rounding of numpy's."""
    rng = np.random.default_rng(rows)
    for matrix in gemm.weight_matrices(fast_model.weights):
        x = rng.standard_normal((rows, matrix.shape[0]), dtype=np.float32)  # (rows, k)
        got = fast_model.matmul(x, matrix)
        assert got.shape == (rows, matrix.shape[1]) and got.dtype == np.float32
        np.testing.assert_allclose(got, x @ matrix, rtol=1e-5, atol=1e-5 * float(np.abs(x @ matrix).max()))


def test_the_packed_copy_is_what_a_batch_multiplies_by(tiny_model: Model) -> None:
    """Put the packed copy of -W where W's belongs: 2..MAX_ROWS rows now give x @ -W, while one row and a bigger
    chunk still give numpy's x @ W, so the packed path takes exactly the rows it is meant for. (MKL's packed layout
    has a header of its own: it cannot be edited in place.)"""
    matmul = gemm.weight_matmul(tiny_model.weights, "mkl", attention_threads())
    assert isinstance(matmul, gemm.PackedMatmul)
    matrix = tiny_model.weights.layers[0].wo
    negated = -matrix
    matmul._pack(negated)
    matmul._packed[id(matrix)] = matmul._packed.pop(id(negated))
    rng = np.random.default_rng(0)
    for rows in (2, 8, gemm.MAX_ROWS):
        x = rng.standard_normal((rows, matrix.shape[0]), dtype=np.float32)
        np.testing.assert_allclose(matmul(x, matrix), -(x @ matrix), rtol=1e-5, atol=1e-4)
    for rows in (1, gemm.MAX_ROWS + 1):
        x = rng.standard_normal((rows, matrix.shape[0]), dtype=np.float32)
        np.testing.assert_array_equal(matmul(x, matrix), x @ matrix)


def test_the_transposed_copy_is_what_the_kernel_multiplies_by(tiny_model: Model) -> None:
    """Put -W^T where W's transposed copy belongs: 2..MAX_ROWS rows now give x @ -W (a column-major x too, which the
    kernel takes as a copy), while one row and a bigger chunk still give numpy's x @ W."""
    matmul = gemm.weight_matmul(tiny_model.weights, "numba", attention_threads())
    assert isinstance(matmul, gemm.CompiledMatmul)
    matrix = tiny_model.weights.layers[0].wqkv  # (64, 128): 128 % 6 columns go through the kernel's 4 x 1 tail
    matmul._transposed[id(matrix)] = (matrix, np.ascontiguousarray(-matrix.T))
    rng = np.random.default_rng(0)
    for rows in (2, 7, gemm.MAX_ROWS):
        x = rng.standard_normal((rows, matrix.shape[0]), dtype=np.float32)
        np.testing.assert_allclose(matmul(x, matrix), -(x @ matrix), rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(matmul(np.asfortranarray(x), matrix), -(x @ matrix), rtol=1e-5, atol=1e-4)
    for rows in (1, gemm.MAX_ROWS + 1):
        x = rng.standard_normal((rows, matrix.shape[0]), dtype=np.float32)
        np.testing.assert_array_equal(matmul(x, matrix), x @ matrix)


def test_a_batched_decode_on_mkl_or_the_kernel_matches_numpy_and_the_reference(fast_model: Model, tiny_model: Model,
                                                                               tiny_tensors: dict) -> None:
    """Eight sequences of different lengths over scattered blocks, prefilled then decoded greedily for four steps on
    the MKL model or the kernel's: every step's logits match the numpy model's (from the same caches) and the naive
    reference's."""
    pool = scattered_pool(blocks=128)
    prompts = [list(PROMPT[: 5 + 3 * i]) for i in range(8)]
    caches = [pool.allocate(len(p) + 5) for p in prompts]
    assert all(c is not None for c in caches)
    tokens = []
    for prompt, cache in zip(prompts, caches):
        logits = forward(fast_model, [Segment(np.array(prompt), cache, 0)])[0]
        tokens.append([*prompt, int(logits.argmax())])
    for _ in range(4):  # each step feeds every sequence's newest token
        step = [Segment(np.array(t[-1:]), c, c.length) for t, c in zip(tokens, caches)]
        lengths = [c.length for c in caches]
        fast = forward(fast_model, step)  # (8, vocab)
        for c, n in zip(caches, lengths):
            c.length = n
        assert_matches_reference(fast, forward(tiny_model, step))
        for i, t in enumerate(tokens):
            assert_matches_reference(fast[i], naive_logits(TINY, tiny_tensors, t)[-1])
            t.append(int(fast[i].argmax()))


def test_gemm_numpy_is_numpys_matmul(tiny_model: Model) -> None:
    assert gemm.weight_matmul(tiny_model.weights, "numpy", 2) is np.matmul


@pytest.mark.parametrize(("vendor", "kind"), [("GenuineIntel", gemm.PackedMatmul), ("AuthenticAMD", gemm.CompiledMatmul),
                                              ("unknown", gemm.CompiledMatmul)])
def test_auto_packs_on_an_intel_cpu_only_and_mkl_on_any(tiny_model: Model, monkeypatch: pytest.MonkeyPatch,
                                                        vendor: str, kind: type) -> None:
    """auto (the default) runs MKL where it runs its own kernels, an Intel CPU; elsewhere the compiled kernel (MKL's
    generic code lost to OpenBLAS on an AMD EPYC, and the kernel beat OpenBLAS there, gemm.py). An explicit mkl packs
    on any CPU."""
    monkeypatch.setattr(gemm, "cpu_vendor", lambda: vendor)
    matmul = gemm.weight_matmul(tiny_model.weights, "auto", 2)
    assert isinstance(matmul, kind)
    assert gemm.describe(matmul) == {gemm.PackedMatmul: "mkl", gemm.CompiledMatmul: "numba"}[kind]
    assert isinstance(gemm.weight_matmul(tiny_model.weights, "mkl", 2), gemm.PackedMatmul)



def test_without_mkl_the_engine_runs_numpy_and_says_so(tiny_model: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    """No loadable libmkl_rt: numpy's matmul, after one engine.gemm warning with reason mkl_missing."""
    monkeypatch.setattr(gemm, "load_mkl", lambda threads: None)
    sink = io.StringIO()
    setup_logging("engine-test", sink=sink)
    try:
        matmul = gemm.weight_matmul(tiny_model.weights, "mkl", 2)
    finally:
        setup_logging("engine-test")
    assert matmul is np.matmul
    lines = [json.loads(line) for line in sink.getvalue().splitlines() if '"engine.gemm"' in line]
    assert [(x["level"], x["gemm"], x["reason"]) for x in lines] == [("WARNING", "numpy", "mkl_missing")]
    cache = KVCache(TINY, 8)
    assert forward(replace(tiny_model, matmul=matmul), [Segment(np.arange(5), cache, 0)]).shape == (1, TINY.vocab_size)


def test_attention_tiles_multiply_on_mkl_from_the_pool_in_place(mkl_model: Model) -> None:
    """PackedMatmul.tile: a query block @ a K tile transposed and a score tile @ a V tile, each a strided view of one
    KV head of a pool-shaped array, equal numpy's; a view without a unit stride goes to numpy."""
    rng = np.random.default_rng(2)
    pool = rng.standard_normal((300, 4, 64), dtype=np.float32)  # (slots, KV, hd): one head is a strided view
    q = rng.standard_normal((40, 64), dtype=np.float32)
    scores = rng.standard_normal((40, 300), dtype=np.float32)
    tile = mkl_model.matmul.tile  # type: ignore[attr-defined]
    for a, b in ((q, pool[:, 1].T), (scores, pool[:, 2]), (q[:, :32], pool[:, 3, ::2].T)):
        expected = a @ b
        np.testing.assert_allclose(tile(a, b), expected, rtol=1e-5, atol=1e-5 * float(np.abs(expected).max()))
    assert gemm.tile_matmul(mkl_model.matmul) == tile and gemm.tile_matmul(np.matmul) is np.matmul


@pytest.mark.usefixtures("small_tiles")
def test_a_long_prompt_with_its_tiles_on_mkl_matches_the_reference(mkl_model: Model, tiny_tensors: dict,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt cut into many query blocks and key tiles, the weights on MKL: every tile GEMM goes through MKL and
    the logits at every position are the reference's."""
    shapes: list[tuple[int, int]] = []
    tile = gemm.PackedMatmul.tile
    monkeypatch.setattr(gemm.PackedMatmul, "tile", lambda self, a, b: shapes.append(b.shape) or tile(self, a, b))
    assert_long_prompt_matches_reference(mkl_model, tiny_tensors, seed=6)
    hd = TINY.head_dim
    assert any(s[0] == hd for s in shapes) and any(s[1] == hd for s in shapes)  # Q @ K^T and P @ V both
