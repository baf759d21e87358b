"""Record the doctor's real-vLLM bundles: one fault staged on a real vLLM (CPU) prefill/decode pair over NIXL behind the
real router, requests sent with the openai SDK, and the logs kept as tests/unit/doctor/bundles/vllm_<fault>/.

    python -m tests.vllm.record_bundles [FAULT ...]      (repo root; the venv with the router's deps)

Faults: key_mismatch, max_len, decode_restart, tokenizer, small_kv, engine_dead, no_tool_parser (all when none is
named). One pair runs at a time (2 cores), every wait is bounded, and everything started is stopped, also on failure. Each bundle holds
prefill.log, decode.log (vLLM's own output), router.log (JSON lines) and client.txt (what the SDK raised, per request).
"""

from __future__ import annotations

import json
import os
import re
import signal
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import openai

from stack.engine import tiny_llama
from tests.ports import late_bound_port
from tests.vllm.conftest import INSTALL_BOUND_S, KEY, MODEL, REPO, RouterProcess, VllmServer, stop_all
from tests.vllm.test_pd_nixl import kv_config

BUNDLES = REPO / "tests/unit/doctor/bundles"
HELLO = [{"role": "user", "content": "Explain the key value cache in one sentence"}]
# ~1,100 tokens with the tiny checkpoint's byte-level BPE (digits are single tokens): over 512, under 2048.
LONG = [{"role": "user", "content": " ".join(str(i) for i in range(300))}]
# An agent's tool list (one tool is enough): every Claude Code or Codex request carries one.
TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file of the workspace.",
                                           "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                          "required": ["path"]}}}]
REQUEST_BOUND_S = 240
# key_mismatch's two keys: the router's PD_INTERNAL_KEY and the engines' VLLM_API_KEY (neither may reach a bundle)
ROUTER_INTERNAL_KEY, ENGINE_KEY = "router-internal-key-1", "engine-key-2"


class Pair:
    """A vLLM prefill (core 0) and decode (core 1) over NIXL, the router over them, and the client log."""

    def __init__(self, venv: Path, checkpoint: Path, workdir: Path, started: list, prefill_args: tuple[str, ...] = (),
                 decode_args: tuple[str, ...] = (), env: dict[str, str] | None = None) -> None:
        """`started`: the caller's list of what runs, stopped by it also when this start fails."""
        self.venv, self.checkpoint, self.workdir, self.env = venv, checkpoint, workdir, env or {}
        self.started = started
        self.client_lines: list[str] = []
        self.decode_env = self._env("1")
        self.decode_args = decode_args
        self.decode = self._engine("decode", "kv_consumer", decode_args, self.decode_env)
        self.prefill = self._engine("prefill", "kv_producer", prefill_args, self._env("0"))
        self.decode.wait_healthy()
        self.prefill.wait_healthy()
        self.router = RouterProcess(workdir, self.prefill, self.decode, scheduler='kv_connector = "nixl"',
                                    pools='capabilities = "vllm"')
        self.started.append(self.router)

    def _env(self, core: str) -> dict[str, str]:
        return {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(late_bound_port()),
                "VLLM_CPU_OMP_THREADS_BIND": core, **self.env}

    def _engine(self, name: str, role: str, args: tuple[str, ...], env: dict[str, str], port: int | None = None) -> VllmServer:
        server = VllmServer(self.venv, self.checkpoint, self.workdir / f"{name}.log", "--kv-transfer-config",
                            kv_config(role), "--enable-prompt-tokens-details", *args, env=env, port=port)
        self.started.append(server)
        return server

    def restart_decode(self) -> None:
        """Stop decode and start it again on the same port and side channel: its log shows a second start-up."""
        self.decode.stop()
        self.decode = self._engine("decode", "kv_consumer", self.decode_args, self.decode_env, port=self.decode.port)
        self.decode.wait_healthy()

    def send(self, rid: str, messages: list[dict] = HELLO, stream: bool = False, max_tokens: int = 8,
             extra: dict | None = None) -> None:
        """One request through the router; what the SDK raised (or the usage it got) goes to the client log."""
        client = openai.OpenAI(base_url=f"{self.router.url}/v1", api_key=KEY, max_retries=0, timeout=REQUEST_BOUND_S)
        started = time.monotonic()
        try:
            kwargs = dict(model=MODEL, messages=messages, max_tokens=max_tokens, extra_headers={"X-Request-ID": rid},
                          extra_body=extra or None)
            if stream:
                text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
                    stream=True, **kwargs) if c.choices)
                self.client_lines.append(f"request_id={rid} ok, streamed {len(text)} characters in {time.monotonic() - started:.1f} s")
            else:
                usage = client.chat.completions.create(**kwargs).usage
                self.client_lines.append(f"request_id={rid} ok, prompt_tokens {usage.prompt_tokens if usage else '?'} in "
                                         f"{time.monotonic() - started:.1f} s")
        except openai.APIError as exc:
            self.client_lines.append(f"request_id={rid} {type(exc).__module__}.{type(exc).__name__}: {exc}")

    def send_each(self, prefix: str, count: int = 3) -> None:
        """`count` short requests one after the other, the last one streamed."""
        for n in range(count):
            self.send(f"{prefix}-{n}", stream=n == count - 1)

    def save(self, name: str) -> Path:
        """Stop everything and keep the bundle (the router key must never be in it)."""
        stop_all(self.started)
        out = BUNDLES / f"vllm_{name}"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        for log in ("prefill.log", "decode.log", "router.log"):
            text = (self.workdir / log).read_text(errors="replace")
            assert not any(k in text for k in (KEY, ROUTER_INTERNAL_KEY, ENGINE_KEY)), f"{log}: a key reached a log"
            (out / log).write_text(text)
        (out / "client.txt").write_text("\n".join(self.client_lines) + "\n")
        return out


def key_mismatch(pair: Callable[..., Pair]) -> Pair:
    """Engines started with their own API key (VLLM_API_KEY) ≠ the router's PD_INTERNAL_KEY."""
    os.environ["PD_INTERNAL_KEY"] = ROUTER_INTERNAL_KEY
    try:
        p = pair(env={"VLLM_API_KEY": ENGINE_KEY})
    finally:
        del os.environ["PD_INTERNAL_KEY"]
    p.send_each("rec-key")
    return p


def max_len(pair: Callable[..., Pair]) -> Pair:
    """Decode started with --max-model-len 512, prefill with 2048: a ~1,100-token prompt passes prefill only."""
    p = pair(decode_args=("--max-model-len", "512"))
    p.send("rec-len-short")
    for n in range(2):
        p.send(f"rec-len-long-{n}", LONG, stream=n == 1)
    return p


def decode_restart(pair: Callable[..., Pair]) -> Pair:
    """Decode stopped while streams run, then started again; later requests succeed."""
    p = pair()
    p.send("rec-restart-before")
    with ThreadPoolExecutor(3) as pool:
        cut = [pool.submit(p.send, f"rec-restart-cut-{n}", HELLO, True, 400, {"ignore_eos": True}) for n in range(3)]
        time.sleep(4)  # the streams are under way (the pair answers an 8-token request in about a second)
        p.restart_decode()
        for future in cut:
            future.result(timeout=REQUEST_BOUND_S)
    _wait_router_sees_decode(p)
    for n in range(2):
        p.send(f"rec-restart-after-{n}")
    return p


def _wait_router_sees_decode(p: Pair, bound_s: float = 60) -> None:
    deadline = time.monotonic() + bound_s
    while not any(e.get("state") == "up" and e.get("role") == "decode" for e in p.router.events("backend.health")[-1:]):
        if time.monotonic() > deadline:
            return  # the requests after it then show what the router did
        time.sleep(0.5)


def tokenizer(pair: Callable[..., Pair], workdir: Path, checkpoint: Path) -> Pair:
    """Decode reads the same weights with another tokenizer (a BPE with fewer merges: more, different token ids)."""
    other = workdir / "other-tokenizer"
    shutil.copytree(checkpoint, other)
    tiny_llama.train_tokenizer(280).save(str(other / "tokenizer.json"))
    p = pair(decode_args=("--tokenizer", str(other)))
    p.send_each("rec-tok")
    return p


def small_kv(pair: Callable[..., Pair]) -> Pair:
    """Decode with KV for about two ~1,100-token requests (--num-gpu-blocks-override 18 blocks of 128), 12 sent at once,
    each prompt its own (no shared prefix to cache) and 200 tokens long; vLLM's stats line every 2 s."""
    p = pair(decode_args=("--num-gpu-blocks-override", "18"), env={"VLLM_LOG_STATS_INTERVAL": "2"})
    p.send("rec-kv-warm")
    with ThreadPoolExecutor(12) as pool:
        futures = [pool.submit(p.send, f"rec-kv-{n}", [{"role": "user", "content": f"{n} " + LONG[0]["content"]}],
                               n % 2 == 0, 200, {"ignore_eos": True}) for n in range(12)]
        for future in futures:
            future.result(timeout=REQUEST_BOUND_S * 2)
    return p


def engine_dead(pair: Callable[..., Pair]) -> Pair:
    """Decode's engine core process SIGKILLed (as the kernel's OOM killer does) while its API server lives on."""
    p = pair()
    p.send("rec-dead-before")
    core = re.search(r"^\(EngineCore(?:_DP0)? pid=(\d+)\)", p.decode.log(), re.M)
    assert core, "decode's log names no EngineCore pid"
    os.kill(int(core.group(1)), signal.SIGKILL)
    p.send_each("rec-dead")
    return p


def no_tool_parser(pair: Callable[..., Pair]) -> Pair:
    """Engines started as `vllm serve` starts by default, without --enable-auto-tool-choice and --tool-call-parser: a
    request without tools is served, one that carries tools is refused when its tool_choice is "auto" (the default)."""
    p = pair()
    p.send("rec-tools-without")
    for n in range(2):
        p.send(f"rec-tools-{n}", stream=n == 1, extra={"tools": TOOLS})
    p.send("rec-tools-choice-none", extra={"tools": TOOLS, "tool_choice": "none"})
    return p


FAULTS = ("key_mismatch", "max_len", "decode_restart", "tokenizer", "small_kv", "engine_dead", "no_tool_parser")


def record(name: str, venv: Path, checkpoint: Path) -> Path:
    started: list = []

    def pair(**kwargs) -> Pair:
        return Pair(venv, checkpoint, workdir, started, **kwargs)

    with tempfile.TemporaryDirectory(prefix=f"pd-rec-{name}-") as tmp:
        workdir = Path(tmp)
        try:
            fault = globals()[name]
            p = fault(pair, workdir, checkpoint) if name == "tokenizer" else fault(pair)
            return p.save(name)
        finally:
            stop_all(started)


def main(argv: list[str]) -> None:
    unknown = set(argv) - set(FAULTS)
    if unknown:
        sys.exit(f"unknown fault(s) {', '.join(sorted(unknown))}; known: {', '.join(FAULTS)}")
    done = subprocess.run([str(REPO / "scripts/vllm-cpu.sh"), "venv"], capture_output=True, text=True,
                          timeout=INSTALL_BOUND_S, check=True)
    venv = Path(done.stdout.strip().splitlines()[-1])
    with tempfile.TemporaryDirectory(prefix="pd-rec-ck-") as ck:
        checkpoint = Path(ck)
        tiny_llama.write(checkpoint)
        for name in argv or FAULTS:
            out = record(name, venv, checkpoint)
            print(f"{name}: {out}")
            print(json.dumps((out / "client.txt").read_text().splitlines(), indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
