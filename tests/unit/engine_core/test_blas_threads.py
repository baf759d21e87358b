"""BLAS's threads stay out of attention's way: while a prefill's attention is split over threads each BLAS product runs
on its caller's core only, and the process's setting is back after the step; the engine's BLAS environment defaults
never override an operator's own (blas_env.py). Why: docs/engine.md, "A step on the cores"."""

from __future__ import annotations

import os

import numpy as np
import pytest

from stack.engine import attention as attention_module
from stack.engine import blas_env
from stack.engine import model as model_module
from stack.engine.model import Model, Segment, forward

from .reference import TINY, naive_logits
from .test_paged import PROMPT, assert_matches_reference, scattered_pool


def blas_threads() -> int:
    return model_module.blas_controller().info()[0]["num_threads"]


def record_blas_threads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """BLAS's thread count at every call of attention.py's `attention`, in the calling thread, as it runs."""
    seen: list[int] = []
    attend = attention_module.attention

    def recording(*args, **kwargs):  # noqa: ANN002, ANN003 - attention's own signature
        seen.append(blas_threads())
        return attend(*args, **kwargs)

    monkeypatch.setattr(attention_module, "attention", recording)
    return seen


def test_a_split_prefill_runs_one_blas_thread_per_attention_thread(tiny_model: Model, tiny_tensors: dict,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill whose query blocks are split over 2 threads: every attention call sees BLAS at 1 thread, the
    weight matmuls' setting (2) is back after the step, and the numbers equal the reference."""
    if not model_module.blas_controller().lib_controllers:
        pytest.fail("threadpoolctl finds no BLAS under numpy: the engine could not limit its threads")
    monkeypatch.setattr(model_module, "attention_threads", lambda: 2)
    monkeypatch.setattr(model_module, "PARALLEL_MIN_KEYS", 0)
    monkeypatch.setattr(attention_module, "THIN_QUERIES", 4)  # the 23-token prompt is a prefill, not a thin segment
    monkeypatch.setattr(attention_module, "QUERY_BLOCK", 2)  # and 12 query-block tasks: enough to split
    seen = record_blas_threads(monkeypatch)
    cache = scattered_pool().allocate(len(PROMPT) + 1)
    assert cache is not None
    with model_module.blas_controller().limit(limits=2):  # what the weight matmuls run with on a 2-core engine
        logits = forward(tiny_model, [Segment(np.array(PROMPT), cache, 0)], all_logits=True, attention="numpy")[0]
        after = blas_threads()
    assert len(seen) >= model_module.PARALLEL_MIN_SEGMENTS * TINY.n_layers, "the prefill's attention was not split"
    assert set(seen) == {1}, f"BLAS threads seen by the split attention: {sorted(set(seen))}"
    assert after == 2, "the step left BLAS limited"
    assert_matches_reference(logits, naive_logits(TINY, tiny_tensors, PROMPT))


def test_an_unsplit_step_keeps_the_weight_matmuls_blas_threads(tiny_model: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    """One attention thread: nothing to limit, attention's products keep every BLAS thread."""
    monkeypatch.setattr(model_module, "attention_threads", lambda: 1)
    seen = record_blas_threads(monkeypatch)
    cache = scattered_pool().allocate(len(PROMPT))
    assert cache is not None
    with model_module.blas_controller().limit(limits=2):
        forward(tiny_model, [Segment(np.array(PROMPT), cache, 0)], attention="numpy")
    assert seen and set(seen) == {2}


def test_blas_defaults_apply_only_where_the_operator_set_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset: one BLAS thread per core of the process's affinity, workers asleep after 2^18 cycles. Set: kept."""
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    monkeypatch.delenv("OPENBLAS_THREAD_TIMEOUT", raising=False)
    blas_env.apply_defaults()
    assert os.environ["OPENBLAS_NUM_THREADS"] == str(len(os.sched_getaffinity(0)))
    assert os.environ["OPENBLAS_THREAD_TIMEOUT"] == "18"
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    monkeypatch.setenv("OPENBLAS_THREAD_TIMEOUT", "28")
    blas_env.apply_defaults()
    assert (os.environ["OPENBLAS_NUM_THREADS"], os.environ["OPENBLAS_THREAD_TIMEOUT"]) == ("1", "28")
