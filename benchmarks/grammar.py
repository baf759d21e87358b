"""Per-token cost of grammar-constrained decoding vs unconstrained, same model, batch 1 (not a test).

    python -m benchmarks.grammar [--model dummy:small] [--steps 128] [--repeat 3]

Each decode step is timed in two parts: the forward pass (the same for every arm) and what the
constraint adds (bitmask + masking + consuming the sampled token). The baseline arm samples the raw
logits; each library arm samples the masked logits. The ratio is (forward + sample + grammar) /
(forward + sample) of the baseline measured in the same run, with the forward taken as the fastest
measured in any arm (the same work everywhere; on a busy machine its noise dwarfs the grammar). Libraries: llguidance (what the engine
uses, stack/engine/grammar.py) and outlines-core (regex from the same JSON Schema, a token-level
index); xgrammar is not tried: its wheel requires torch and triton, too big for the CPU image.
When a grammar completes (only EOS allowed) its matcher is rebuilt outside the timed region.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np

from stack.engine.grammar import Constraint, json_schema_grammar
from stack.engine.kv_cache import KVCache
from stack.engine.model import Model, Segment, forward, load_model
from stack.engine.sampling import adjust, sample

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
                                           "score": {"type": "integer"}}, "required": ["name", "tags", "score"]}


class Arm:
    """A constraint under test: `mask()` -> (vocab,) bool or None, `consume(token)`, `reset()`."""

    def __init__(self, name: str, make: Callable[[], tuple[Callable[[], np.ndarray | None], Callable[[int], bool]]]) -> None:
        self.name, self._make = name, make
        self.reset()

    def reset(self) -> None:
        self.mask, self.consume = self._make()


def llguidance_arm(model: Model) -> Arm:
    grammar = json_schema_grammar(SCHEMA)

    def make() -> tuple[Callable[[], np.ndarray | None], Callable[[int], bool]]:
        c = Constraint(grammar, model.tokenizer, model.config.vocab_size)
        return c.allowed, c.consume
    return Arm("llguidance", make)


def outlines_arm(model: Model) -> Arm | None:
    try:
        from outlines_core import Guide, Index, Vocabulary
        from outlines_core.json_schema import build_regex_from_schema
    except ImportError:
        return None
    import json

    tok, vocab = model.tokenizer, model.config.vocab_size
    eos = tok.eos_id
    table: dict[bytes, list[int]] = {}
    for i in range(vocab):
        if i not in tok.stop_ids and i not in getattr(tok, "special_ids", {}).values():
            table.setdefault(tok.token_bytes(i), []).append(i)
    t0 = time.perf_counter()
    index = Index(build_regex_from_schema(json.dumps(SCHEMA)), Vocabulary(eos, table))
    print(f"  outlines-core index build: {(time.perf_counter() - t0) * 1000:.1f} ms")

    def make() -> tuple[Callable[[], np.ndarray | None], Callable[[int], bool]]:
        guide = Guide(index)

        def mask() -> np.ndarray:
            allowed = np.zeros(vocab, bool)  # (vocab,)
            allowed[guide.get_tokens()] = True
            return allowed

        def consume(token: int) -> bool:
            if token == eos or guide.is_finished():
                return False
            guide.advance(token)
            return True
        return mask, consume
    return Arm("outlines-core", make)


def run(model: Model, arm: Arm | None, steps: int) -> tuple[float, float, int]:
    """(forward s, sample+grammar s, tokens) over `steps` decode steps after a short prompt."""
    cache = KVCache(model.config, steps + 16)
    prompt = np.array(model.tokenizer.encode("Answer in JSON: "))[:15]  # (T,)
    logits = forward(model, [Segment(prompt, cache, 0)])[0]  # (vocab,)
    fwd = extra = 0.0
    eos = model.tokenizer.eos_id
    for step in range(steps - 1):
        t0 = time.perf_counter()
        allowed = arm.mask() if arm is not None else None
        row = adjust(logits, allowed=allowed) if allowed is not None else logits
        token = sample(row, 0.8, 1.0, 1, step)
        if arm is not None and (token == eos or not arm.consume(token)):
            t1 = time.perf_counter()
            arm.reset()  # a finished JSON document: start another one, untimed
            extra += t1 - t0
            token = int(np.argmax(logits))
        else:
            extra += time.perf_counter() - t0
        t0 = time.perf_counter()
        if cache.length >= cache.capacity:
            break
        logits = forward(model, [Segment(np.array([token]), cache, cache.length)])[0]
        fwd += time.perf_counter() - t0
    return fwd, extra, steps - 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="dummy:small", help="dummy:tiny | dummy:small | an HF checkpoint directory")
    parser.add_argument("--steps", type=int, default=128, help="decode steps per run")
    parser.add_argument("--repeat", type=int, default=3, help="runs per arm; the best is reported")
    args = parser.parse_args()
    model = load_model(args.model)
    print(f"model {args.model}: vocab {model.config.vocab_size}, batch 1, {args.steps} decode steps, best of {args.repeat}")
    arms: list[Arm | None] = [None, llguidance_arm(model), outlines_arm(model)]
    results: dict[str, tuple[float, float]] = {}
    for arm in arms:
        name = "unconstrained" if arm is None else arm.name
        if arm is None and name in results:
            continue
        best = min((run(model, arm, args.steps) for _ in range(args.repeat)), key=lambda r: r[0] + r[1])
        fwd, extra, n = best
        results[name] = (fwd / n, extra / n)
    # The forward is the same computation in every arm: the fastest run of it is the machine's figure, and a busy
    # machine's noise in it must not hide (or inflate) what the grammar adds.
    fwd_best = min(fwd for fwd, _ in results.values())
    base = fwd_best + results["unconstrained"][1]
    print(f"forward pass: {fwd_best * 1e3:.3f} ms/token (best over all arms)")
    print(f"{'arm':<15} {'forward ms/tok':>15} {'sample+grammar ms/tok':>22} {'grammar extra us/tok':>21} {'total ms/tok':>13} {'ratio':>7}")
    for name, (fwd, extra) in results.items():
        total = fwd_best + extra
        added = (extra - results["unconstrained"][1]) * 1e6
        print(f"{name:<15} {fwd * 1e3:15.3f} {extra * 1e3:22.3f} {added:21.1f} {total * 1e3:13.3f} {total / base:7.3f}")


if __name__ == "__main__":
    main()
