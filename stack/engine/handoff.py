"""The two PD legs on the engine side (design §2): push after a prefill leg, claim before a decode leg.

Prefill leg (`kv_transfer_params.do_remote_decode`): the sequence computes the prompt KV and its
first token, then `push` ships them to `decode_kv_addr` and returns the `kv_transfer_params` the
router copies into the decode leg. Decode leg (`do_remote_prefill`): `claim` waits for that
transfer and checks it belongs to this prompt; when it cannot (timeout, prompt mismatch) the
`kv_load_failure_policy` decides: `recompute` (run the prefill here) or `fail` (answer an error).
"""

from __future__ import annotations

from stack.common import events
from stack.common.logging import log_event
from stack.engine import kv_wire
from stack.engine.config import EngineConfig
from stack.engine.errors import KVTransferError
from stack.engine.kv_consumer import KVConsumer, ReceivedKV
from stack.engine.kv_transfer import KVProducer, prompt_hash, split_addr
from stack.engine.kv_wire import KVHeader
from stack.engine.model import Model
from stack.engine.protocol import CompletionRequest
from stack.engine.scheduler import Sequence


class KVHandoff:
    """Both legs for one engine; `consumer` is None unless the engine listens on kv_port."""

    def __init__(self, config: EngineConfig, model: Model, consumer: KVConsumer | None) -> None:
        self.config = config
        self.model = model
        self.consumer = consumer
        kv = config.kv_transfer_config
        self.producer = KVProducer(io_timeout_s=max(kv.kv_transfer_timeout_ms, 1000) / 1000)

    def check_producer(self) -> None:
        """A prefill leg needs a KV producer; refuse it before computing anything."""
        if not self.config.is_kv_producer:
            raise KVTransferError(
                "not_a_producer",
                f"this engine (role {self.config.role}, {self.config.kv_role}) does not send KV; "
                "send do_remote_decode requests to a prefill engine",
            )

    async def push(self, request_id: str, req: CompletionRequest, seq: Sequence) -> dict[str, object]:
        """Ship the finished prefill leg's KV; returns the response's `kv_transfer_params`."""
        params = req.kv_transfer
        assert params is not None and params.decode_kv_addr is not None, "push needs a prefill leg"
        cache = seq.cache
        assert cache is not None and seq.output, f"prefill leg {request_id} finished without KV or a first token"
        n, cfg = len(seq.prompt), self.model.config
        payload = kv_wire.segments(cache.k, cache.v, n)
        header = KVHeader(
            transfer_id=params.transfer_id,
            request_id=request_id,
            fingerprint=self.model.fingerprint,
            dtype=kv_wire.DTYPE,
            n_layers=cfg.n_layers,
            n_kv_heads=cfg.n_kv_heads,
            head_dim=cfg.head_dim,
            num_tokens=n,
            first_token=seq.output[0],
            seed=seq.seed,
            prompt_hash=prompt_hash(seq.prompt),
            total_bytes=sum(p.nbytes for p in payload),
            checksums=tuple(kv_wire.checksum(p) for p in payload),
        )
        await self.producer.push(header, payload, params.decode_kv_addr)
        host, port = split_addr(params.decode_kv_addr)
        return {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "transfer_id": params.transfer_id,
            "num_tokens": n,
            "remote_host": host,  # where the KV now is: the decode's KV listener
            "remote_port": port,
        }

    async def claim(self, req: CompletionRequest) -> ReceivedKV | None:
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
            if kv.kv_load_failure_policy == "recompute":
                log_event(events.KV_CONSUMER_RECOMPUTE, f"running the prefill of {len(req.prompt_tokens)} tokens here instead: {err.message}",
                          "WARNING", transfer_id=params.transfer_id, reason=err.reason, prompt_tokens=len(req.prompt_tokens))
                return None
            log_event(events.KV_CONSUMER_FAILED, f"answering an error (kv_load_failure_policy=fail): {err.message}", "ERROR",
                      transfer_id=params.transfer_id, reason=err.reason)
            raise

    def _check_prompt(self, received: ReceivedKV, prompt: list[int]) -> None:
        header = received.header
        if header.num_tokens == len(prompt) and header.prompt_hash == prompt_hash(prompt):
            return
        received.release()
        msg = (f"the KV of transfer {header.transfer_id} is for another prompt ({header.num_tokens} tokens, hash {header.prompt_hash}); "
               f"this request has {len(prompt)} tokens, hash {prompt_hash(prompt)}")
        log_event(events.KV_CONSUMER_PROMPT_MISMATCH, msg, "ERROR", transfer_id=header.transfer_id,
                  local_tokens=len(prompt), remote_tokens=header.num_tokens)
        raise KVTransferError("prompt_mismatch", msg, local_tokens=len(prompt), remote_tokens=header.num_tokens)
