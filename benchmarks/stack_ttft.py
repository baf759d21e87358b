"""Cold time to first token of agent-sized prompts through the running stack, the way a client sees it.

    ./pd up   # or ./pd colocated, or any stack on --url
    python -m benchmarks.stack_ttft [--words 6000] [--requests 3] [--url http://127.0.0.1:8080/v1]

Each request is one streamed chat completion whose prompt is --words fresh random words (about 2.7 tokens each
with the dummy tokenizer: 6,000 words is ~16k tokens), new for every request, so no prefix cache can serve any of
it: the figure is a whole prefill, plus (on the PD stack) the KV hand-off to decode and decode's first step. The key
is TAOTOKEN_API_KEY from the environment or from .env. Prints each request's prompt tokens, first-token and total
seconds and the 1-minute load average, then the median [min-max] of the first tokens.

To compare two versions, run it against each in turn on a quiet machine, alternating which goes first, as
docs/engine.md does for the BLAS settings (two checkouts, each's `./pd up`). Not a test: it prints figures.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from pathlib import Path

from openai import OpenAI

REPO = Path(__file__).resolve().parents[1]
WORDS = "alpha beta gamma delta river stone cloud paper engine window garden silver orange quiet rapid table".split()


def api_key() -> str:
    """TAOTOKEN_API_KEY from the environment, else from the repository's .env (what ./pd up wrote)."""
    if key := os.environ.get("TAOTOKEN_API_KEY"):
        return key
    env = REPO / ".env"
    for line in env.read_text().splitlines() if env.exists() else []:
        if line.startswith("TAOTOKEN_API_KEY="):
            return line.split("=", 1)[1].strip().strip("'\"")
    raise SystemExit("no TAOTOKEN_API_KEY in the environment or in .env: run ./pd up first")


def prompt(words: int, seed: int) -> str:
    """`words` random words with numbers: text no earlier request shares a prefix with (beyond chance)."""
    rng = random.Random(seed)
    return " ".join(f"{rng.choice(WORDS)}{rng.randint(0, 99)}" for _ in range(words))


def one(client: OpenAI, model: str, text: str) -> tuple[int, float, float]:
    """(prompt tokens, seconds to the first content token, seconds to the end) of one streamed request."""
    started, first, tokens = time.perf_counter(), None, 0
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}], max_tokens=8,
                                            stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - started
        if chunk.usage:
            tokens = chunk.usage.prompt_tokens
    end = time.perf_counter() - started
    return tokens, end if first is None else first, end


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--words", type=int, default=6000, help="prompt length in words (~2.7 tokens each)")
    parser.add_argument("--requests", type=int, default=3, help="cold requests, one after the other")
    parser.add_argument("--url", default="http://127.0.0.1:8080/v1", help="the stack's OpenAI base URL")
    parser.add_argument("--seed", type=int, default=None, help="first prompt's seed (default: from the clock)")
    args = parser.parse_args()
    client = OpenAI(base_url=args.url, api_key=api_key(), timeout=1800, max_retries=0)
    model = client.models.list().data[0].id
    seed = time.time_ns() if args.seed is None else args.seed
    firsts = []
    for i in range(args.requests):
        tokens, first, total = one(client, model, prompt(args.words, seed + i))
        firsts.append(first)
        print(f"request {i + 1}: {tokens} prompt tokens, first token {first:.1f} s, total {total:.1f} s, "
              f"load {os.getloadavg()[0]:.1f}", flush=True)
    print(f"first token: median {statistics.median(firsts):.1f} s [{min(firsts):.1f}-{max(firsts):.1f}] over "
          f"{len(firsts)} cold requests to {model} at {args.url}")


if __name__ == "__main__":
    main()
