"""The PD hand-off on the engine side (design §2): each leg, from the parsed request to the scheduler.

Prefill leg (`kv_transfer_params.do_remote_decode`): `prefill` runs the prompt to its first token
(`Scheduler.prefill`) while the push to `decode_kv_addr` (kv_transfer.py) streams each finished
layer — only the blocks decode does not already hold — then sends the first token, gives the cache
back to the pool and returns the `kv_transfer_params` the router copies into the decode leg.

Decode leg (`do_remote_prefill`): `decode` claims the transfer from the receive buffer
(kv_consumer.py), checks it belongs to this prompt, and hands the scheduler plain arrays and the
first token (`Scheduler.submit(kv=…)`). The receive buffer is released once the scheduler has
copied them into its pool, or dropped the request first (`seq.kv_read`). When the KV cannot be
had (timeout, prompt mismatch) `kv_load_failure_policy` decides: `recompute` (prefill here, an
ordinary request) or `fail` (answer an error).

Transports, transfer ids and the KV listener's lifecycle live here and below; the scheduler sees
arrays and tokens only.
"""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass
from typing import Any, Literal

from stack.common import events
from stack.common.logging import log_event
from stack.engine.config import EngineConfig
from stack.engine.errors import KVTransferError
from stack.engine.kv_consumer import KVConsumer, ReceivedKV
from stack.engine.kv_transfer import KVProducer, LayerStream, prompt_hash, split_addr
from stack.engine.kv_wire import KVHeader, KVTrailer
from stack.engine.metrics import EngineMetrics
from stack.engine.model import Model
from stack.engine.protocol import CompletionRequest, KVTransferParams
from stack.engine.scheduler import Scheduler
from stack.engine.sequence import Output, PromptKV, Sequence, TokenLogprob


def pd_leg(req: CompletionRequest) -> Literal["prefill", "decode"] | None:
    """The PD leg `req` is: prefill (do_remote_decode), decode (do_remote_prefill), or None (an ordinary request)."""
    if req.kv_transfer is None:
        return None
    return "prefill" if req.kv_transfer.do_remote_decode else "decode"


@dataclass(frozen=True)
class PrefillLeg:
    """What a prefill leg answers: the first token's output and, if it was pushed, the decode leg's params."""

    output: Output  # finish_reason error | abort: the step failed or the engine stops; nothing was pushed
    kv_transfer_params: dict[str, Any] | None
    cached_tokens: int = 0  # prompt tokens this prefill took from its prefix cache


class KVHandoff:
    """Both legs for one engine; `consumer` is None unless the engine listens on kv_port."""

    def __init__(self, config: EngineConfig, model: Model, scheduler: Scheduler, metrics: EngineMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or scheduler.metrics
        self.model = model
        self.scheduler = scheduler
        kv = config.kv_transfer_config
        self.consumer: KVConsumer | None = None
        if config.is_kv_consumer:
            self.consumer = KVConsumer(fingerprint=model.fingerprint, buffer_size=kv.buffer_bytes, lease_ms=kv.kv_lease_ms, metrics=self.metrics,
                                       prefix=scheduler.prefix if scheduler.prefix.enabled else None, pool=scheduler.pool)
        self.producer = KVProducer(io_timeout_s=max(kv.kv_transfer_timeout_ms, 1000) / 1000)

    async def start(self) -> None:
        if self.consumer is not None:
            kv = self.config.kv_transfer_config
            await self.consumer.start(kv.kv_ip, kv.kv_port)

    async def close(self) -> None:
        if self.consumer is not None:
            await self.consumer.close()

    def health(self) -> dict[str, int | str]:
        """The KV listener's numbers for /health (the router learns decode's KV address from kv_port and kv_host)."""
        if self.consumer is None:
            return {}
        c = self.consumer
        return {"kv_port": c.port, "kv_host": self.config.kv_transfer_config.kv_advertise_host or socket.gethostname(),
                "kv_buffer_used": c.buffer_used, "kv_buffer_size": c.buffer_size, "kv_held_transfers": c.held_transfers}

    # -- prefill leg -----------------------------------------------------------------------------

    async def prefill(self, request_id: str, req: CompletionRequest) -> PrefillLeg:
        """Run the prompt to its first token and push its KV to decode_kv_addr.

        Raises KVTransferError (wrong role, the push failed) or CacheCapacityError (can never fit).
        """
        params = req.kv_transfer
        assert params is not None and params.decode_kv_addr is not None, "a prefill leg needs decode_kv_addr"
        if not self.config.is_kv_producer:  # refuse before computing anything
            raise KVTransferError(
                "not_a_producer",
                f"this engine (role {self.config.role}, {self.config.kv_role}) does not send KV; "
                "send do_remote_decode requests to a prefill engine",
            )
        prompt = list(req.prompt_tokens)
        stream = LayerStream()
        push = asyncio.ensure_future(self._push(request_id, params, prompt, stream))
        computing = asyncio.ensure_future(self.scheduler.prefill(request_id, prompt, req.sampling, on_layer=stream.layer_done))
        prefilled = None
        try:
            await asyncio.wait({computing, push}, return_when=asyncio.FIRST_COMPLETED)
            if push.done() and push.exception() is not None and not computing.done():
                # decode refused the KV (capacity) or the push broke: the rest of the prefill would be thrown away
                computing.cancel()
                await asyncio.gather(computing, return_exceptions=True)
                push.result()  # raises the push's error
            prefilled = await computing
            kv = prefilled.kv
            if kv is None:
                stream.abort()
                await asyncio.gather(push, return_exceptions=True)  # the push ends at once; nothing to report
                return PrefillLeg(prefilled.output, None)
            lp = kv.first_logprob
            stream.finish(KVTrailer(kv.first_token, kv.seed, first_logprob=None if lp is None else (lp.token, lp.logprob, [list(t) for t in lp.top]),
                                    cached_tokens=kv.cached_tokens))
            await push
        finally:
            stream.abort()  # no-op after finish: the sender has stopped reading
            for task in (computing, push):
                if not task.done():
                    task.cancel()  # the caller went away: the prefill stops (between layers) and the push closes its socket
            if prefilled is None and computing.done() and not computing.cancelled() and computing.exception() is None:
                prefilled = computing.result()  # it finished in the loop turn the caller went away: nobody took the cache
            if prefilled is not None:
                prefilled.release()  # pushed or not, the pool gets the cache back
        host, port = split_addr(params.decode_kv_addr)
        return PrefillLeg(prefilled.output, cached_tokens=prefilled.kv.cached_tokens, kv_transfer_params={
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "transfer_id": params.transfer_id,
            "num_tokens": len(prompt),
            "remote_host": host,  # where the KV now is: the decode's KV listener
            "remote_port": port,
        })

    async def _push(self, request_id: str, params: KVTransferParams, prompt: list[int], stream: LayerStream) -> None:
        assert params.decode_kv_addr is not None, "push needs decode_kv_addr"
        cfg, prefix = self.model.config, self.scheduler.prefix
        header = KVHeader(
            transfer_id=params.transfer_id,
            request_id=request_id,
            fingerprint=self.model.fingerprint,
            dtype=self.config.kv_dtype,
            n_layers=cfg.n_layers,
            n_kv_heads=cfg.n_kv_heads,
            head_dim=cfg.head_dim,
            num_tokens=len(prompt),
            prompt_hash=prompt_hash(prompt),
            block_size=prefix.block_size,
            block_hashes=tuple(prefix.hashes(prompt)),  # empty with prefix caching off: decode then reuses nothing
        )
        try:
            result = await self.producer.push(header, stream, params.decode_kv_addr)
        except KVTransferError as err:
            if err.reason != "aborted":  # the prefill itself failed; its error is the answer
                self.metrics.on_kv_failed("send", err.reason)
            raise
        self.metrics.on_kv_sent(result.bytes, result.transfer_ms / 1000)

    # -- decode leg ------------------------------------------------------------------------------

    async def decode(self, request_id: str, req: CompletionRequest) -> Sequence:
        """Claim this leg's KV and queue the decode from it (or, by policy, an ordinary request).

        Raises KVTransferError (no KV: wrong role, timeout, another prompt) or CacheCapacityError.
        """
        prompt = list(req.prompt_tokens)
        received = await self._claim(req)
        if received is None:
            return self.scheduler.submit(request_id, prompt, req.sampling)
        trailer = received.trailer
        try:
            lp = trailer.first_logprob
            first_logprob = None if lp is None else TokenLogprob(int(lp[0]), float(lp[1]), tuple((int(i), float(x)) for i, x in lp[2]))
            kv = PromptKV(received.k, received.v, trailer.first_token, trailer.seed, first_logprob, prefix=tuple(received.reused),
                          cached_tokens=trailer.cached_tokens)
            seq = self.scheduler.submit(request_id, prompt, req.sampling, kv)
        except BaseException:  # CacheCapacityError: the scheduler never took the arrays
            received.release()
            raise
        seq.kv_read.add_done_callback(lambda _: received.release())
        return seq

    async def _claim(self, req: CompletionRequest) -> ReceivedKV | None:
        """The pushed KV for this decode leg, or None when the policy says recompute."""
        params = req.kv_transfer
        assert params is not None, "claim needs a decode leg"
        if self.consumer is None:
            raise KVTransferError(
                "not_a_consumer",
                f"this engine (role {self.config.role}, {self.config.kv_role}) does not receive KV; "
                "send do_remote_prefill requests to a decode engine",
            )
        kv = self.config.kv_transfer_config
        try:
            received = await self.consumer.claim(params.transfer_id, kv.kv_transfer_timeout_ms)
            self._check_prompt(received, list(req.prompt_tokens))
            return received
        except KVTransferError as err:
            self.metrics.on_kv_failed("receive", err.reason)
            if kv.kv_load_failure_policy == "recompute":
                log_event(events.KV_CONSUMER_RECOMPUTE, f"running the prefill of {len(req.prompt_tokens)} tokens here instead: {err.message}",
                          "WARNING", transfer_id=params.transfer_id, reason=err.reason, prompt_tokens=len(req.prompt_tokens))
                return None
            log_event(events.KV_CONSUMER_FAILED, f"answering an error (kv_load_failure_policy=fail): {err.message}", "ERROR",
                      transfer_id=params.transfer_id, reason=err.reason)
            raise

    def _check_prompt(self, received: ReceivedKV, prompt: list[int]) -> None:
        """The KV must be this prompt's (count and hash); otherwise it is released and refused."""
        header = received.header
        if header.num_tokens == len(prompt) and header.prompt_hash == prompt_hash(prompt):
            return
        received.release()
        msg = (f"the KV of transfer {header.transfer_id} is for another prompt ({header.num_tokens} tokens, hash {header.prompt_hash}); "
               f"this request has {len(prompt)} tokens, hash {prompt_hash(prompt)}")
        log_event(events.KV_CONSUMER_PROMPT_MISMATCH, msg, "ERROR", transfer_id=header.transfer_id,
                  local_tokens=len(prompt), remote_tokens=header.num_tokens)
        raise KVTransferError("prompt_mismatch", msg, local_tokens=len(prompt), remote_tokens=header.num_tokens)
