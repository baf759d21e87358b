"""Typed errors raised inside the engine (model, checkpoint, KV cache).

The HTTP boundary maps these onto `stack.common.errors.APIError` subclasses; nothing here knows HTTP.
Other engine modules may append their own classes below (append only, one-line docstring each).
"""

from __future__ import annotations


class EngineError(Exception):
    """Base of every error the engine core raises on purpose."""


class CheckpointError(EngineError):
    """A model source could not be loaded; the message names the file and the problem."""


class CacheCapacityError(EngineError):
    """A request's tokens can never fit the KV pool or the model's context window."""


class KVTransferError(EngineError):
    """A KV push or claim failed; `reason` names the cause and `details` carries the numbers.

    Reasons: connect_failed, buffer_full, pool_too_small, fingerprint_mismatch, checksum_mismatch, bad_header,
    duplicate_transfer, claim_expired, io_error, not_a_producer (prefill side); timeout,
    prompt_mismatch, not_a_consumer (decode side).
    """

    def __init__(self, reason: str, message: str, **details: object) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.details = details


class TokenRangeError(EngineError):
    """A token id outside [0, vocab_size) reached the model (e.g. a client-supplied id list)."""


class ChatTemplateError(EngineError):
    """The checkpoint's chat template refused the messages (e.g. roles that do not alternate)."""
