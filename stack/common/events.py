"""Every log event the services emit, with the fields it carries. Logs are an API: the doctor reads them.

Rules: names are `area.what_happened`, lower case; never rename an event or a field (add a new one
instead). Each line carries the flat keys `ts, level, service, event, request_id, msg` plus the fields
its Event declares: `required` ones on every line, `optional` ones when they apply. Numbers are plain
JSON numbers, durations in ms, sizes in bytes; any field may be null (unknown).

`log_event` (stack/common/logging.py) checks each call against its declaration, and the doctor reads
fields through the `Field` constants below (`record[KV_PORT]`), so a rename here reaches both, and a
call that drifts from its declaration fails the tests (strict mode, see logging.py).

A new event: a constant below with its one-line doc and its fields, reusing the vocabulary's `Field`
constants (a new field gets one, with its JSON type and a plausible example). An event no longer logged goes
into RETIRED, not away: older logs still carry it.
tests/unit/common/test_log_declarations.py checks every call site in stack/ against these, and
tests/unit/doctor/test_declared_events.py runs the doctor over every event logged for real.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

# Who logs an event: its `service` on the line (engine: any engine role, any: every service).
ROUTER, PREFILL, DECODE, ENGINE, ANY = "router", "prefill", "decode", "engine", "any"
# client_request_id: on the router's lines of a request whose client sent X-Request-ID (the router names every
# request itself, so ids are unique; the client's own id is kept beside it: stack.common.errors).
BASE_KEYS = frozenset({"ts", "level", "service", "event", "request_id", "msg", "client_request_id"})


@dataclass(frozen=True, eq=False)  # a field is its constant: compared by identity
class Field:
    """One field of the log vocabulary: its key, the JSON type of its values and a plausible example."""

    name: str
    type: type  # float also takes JSON integers; object takes anything
    example: Any  # documentation, and what the tests log for every declared event
    doc: str = ""

    def accepts(self, value: Any) -> bool:
        """Is `value` of this field's type? (None, unknown, always is; a bool is no number.)"""
        if value is None or self.type is object:
            return True
        if isinstance(value, bool):
            return self.type is bool
        return isinstance(value, self.type) or (self.type is float and isinstance(value, int))

    def of(self, data: Mapping[str, Any]) -> Any:
        """The value in a parsed line, or None when it is absent or not of this field's type."""
        value = data.get(self.name)
        return value if self.accepts(value) else None


class Event(str):
    """An event: its name (lines, the doctor and tests compare names, so it is a str) and its declaration."""

    service: str
    doc: str
    level: str  # the usual level (some events log WARNING or ERROR depending on the case)
    fields: Mapping[str, Field]  # by key, required first
    names: frozenset[str]  # every field key a call may pass
    line_keys: frozenset[str]  # every key a line may carry: names and BASE_KEYS
    required: frozenset[str]

    def __new__(cls, name: str, service: str, doc: str, *, required: Iterable[Field] = (),
                optional: Iterable[Field] = (), level: str = "INFO") -> Event:
        self = super().__new__(cls, name)
        required, optional = tuple(required), tuple(optional)
        self.service, self.doc, self.level = service, doc, level
        self.fields = {f.name: f for f in required + optional}
        self.names = frozenset(self.fields)
        self.line_keys = self.names | BASE_KEYS
        self.required = frozenset(f.name for f in required)
        assert len(self.fields) == len(required + optional), f"{name}: a field is declared twice"
        assert not self.names & BASE_KEYS, f"{name}: {sorted(self.names & BASE_KEYS)} are on every line already"
        return self

    def problems(self, keys: Iterable[str]) -> tuple[list[str], list[str]]:
        """(undeclared, missing) keys of a call's fields (or of a line's, BASE_KEYS removed) against this declaration."""
        present = set(keys)
        return sorted(present - self.names), sorted(self.required - present)


# -- the field vocabulary ----------------------------------------------------------------------
# Service life and config
CONFIG = Field("config", str, "decode/config.json", "the config file the service loaded")
HOST = Field("host", str, "0.0.0.0")
PORT = Field("port", int, 8000, "the HTTP port")
HEALTH_PORT = Field("health_port", int, 50051, "the gRPC health port")
WARMUP_MS = Field("warmup_ms", float, 812.4)
LOAD_MS = Field("load_ms", float, 95.2, "time to load or build the model")
ROLE = Field("role", str, "decode", "an engine role (prefill | decode | both); on router lines the backend's")
KV_ROLE = Field("kv_role", str, "kv_consumer", "kv_producer | kv_consumer | kv_both")
MODEL = Field("model", str, "tiny-llama")
CHECKPOINT = Field("checkpoint", str, "/models/tiny-llama", "null: dummy weights from a seed")
FINGERPRINT = Field("fingerprint", str, "llama-tiny-seed0-4c1f9a2e", "config + weights; prefill and decode must agree")
PREFILL_URLS = Field("prefill", list, ["http://prefill:8000"], "the router's prefill backends (or its discover name)")
DECODE_URLS = Field("decode", list, ["http://decode:8000"], "the router's decode backends (or its discover name)")
POLICY = Field("policy", str, "load_aware", "the router's scheduling policy")
KEY = Field("key", str, "kv_transfer_config.kv_connector", "a config key, dotted")
VALUE = Field("value", object, "PyNcclConnector", "the value as written")
FILE = Field("file", str, "decode/config.json")
PROBLEM = Field("problem", str, "must be positive bytes, got -1", "what is wrong")
LOGGER = Field("logger", str, "aiohttp.server", "the stdlib logger that wrote a free-form line")
EXC = Field("exc", str, "RuntimeError: sampling produced NaN logits", "the exception, `Type: message`")
FOR_EVENT = Field("for_event", str, "kv_producer.sent", "the event whose log call drifted")
# HTTP
METHOD = Field("method", str, "POST")
PATH = Field("path", str, "/v1/chat/completions")
STATUS = Field("status", int, 200, "an HTTP status")
DURATION_MS = Field("duration_ms", float, 41.3)
ERROR_TYPE = Field("type", str, "invalid_request_error", "the OpenAI error type")
CODE = Field("code", str, "invalid_api_key", "a machine-readable error code")
ERROR = Field("error", str, "[Errno 111] Connection refused", "what went wrong, as text")
REASON = Field("reason", str, "buffer_full", "why, as one of the event's documented words")
# Requests in an engine
PROMPT_TOKENS = Field("prompt_tokens", int, 40)
COMPLETION_TOKENS = Field("completion_tokens", int, 16)
MAX_TOKENS = Field("max_tokens", int, 16)
STREAM = Field("stream", bool, True)
PD_LEG = Field("pd_leg", str, "decode", "prefill | decode: which leg of a PD request; null when not PD")
BLOCKS_NEEDED = Field("blocks_needed", int, 4)
BLOCKS_FREE = Field("blocks_free", int, 1)
PREFILL_MS = Field("prefill_ms", float, 32.0)
QUEUE_MS = Field("queue_ms", float, 0.4, "time waiting: an engine's for the first step; router.scheduled's since the "
                 "request entered the PD flow (the router's queue, on attempt 1)")
TTFT_MS = Field("ttft_ms", float, 35.2)
FINISH_REASON = Field("finish_reason", str, "length", "stop | length | abort | error")
E2E_MS = Field("e2e_ms", float, 98.5)
KV_BLOCKS_FREED = Field("kv_blocks_freed", int, 3)
LIMIT = Field("limit", str, "rpm", "the limit hit: rpm | tpm | concurrency (engine: the size it can never fit)")
SEQUENCES = Field("sequences", int, 2, "sequences in the failed step")
# KV transfer
TRANSFER_ID = Field("transfer_id", str, "kv-3f9c1a2b", "one KV hand-off; joins prefill's and decode's lines")
DECODE_KV_ADDR = Field("decode_kv_addr", str, "decode:9100", "host:port of decode's KV listener")
NUM_TOKENS = Field("num_tokens", int, 40, "tokens of KV in the transfer")
BYTES = Field("bytes", int, 81920, "size of the transfer")
TRANSFER_MS = Field("transfer_ms", float, 1.6)
REUSED_BLOCKS = Field("reused_blocks", int, 40, "leading prompt blocks decode already held (prefix cache): not sent")
TAIL_MS = Field("tail_ms", float, 0.4, "transfer time after the prefill finished: the part not hidden behind compute")
GBPS = Field("gbps", float, 0.05, "GB/s")
DETAIL = Field("detail", str, "KV transfer of 8192000 bytes does not fit the receive buffer", "decode's message")
KV_PORT = Field("kv_port", int, 9100, "the port decode's KV listener is bound to")
KV_BUFFER_SIZE = Field("kv_buffer_size", float, 8e9, "decode's KV receive buffer, bytes")
KV_LEASE_MS = Field("kv_lease_ms", int, 30000, "unclaimed KV is freed after this; a push silent this long is closed")
PEER = Field("peer", str, "172.18.0.3:41822", "the remote side's address (a KV pusher, an HTTP caller)")
RECEIVE_MS = Field("receive_ms", float, 1.2)
WAIT_MS = Field("wait_ms", float, 0.3, "how long the decode request waited for its KV")
WAITED_MS = Field("waited_ms", float, 5000.0)
KV_TRANSFER_TIMEOUT_MS = Field("kv_transfer_timeout_ms", float, 5000)
IN_FLIGHT = Field("in_flight", bool, False, "the KV was still arriving when decode gave up")
BUFFER_USED = Field("buffer_used", int, 0, "bytes of the receive buffer in use")
LOCAL = Field("local", str, "llama-tiny-seed1-77d0b3c1", "decode's own fingerprint")
REMOTE = Field("remote", str, "llama-tiny-seed0-4c1f9a2e", "the fingerprint in prefill's KV header")
EXPECTED = Field("expected", str, "9f86d081", "the checksum prefill sent")
ACTUAL = Field("actual", str, "60303ae2", "the checksum of what arrived")
BAD_SEGMENTS = Field("bad_segments", int, 1)
RECEIVED = Field("received", int, 40960, "payload bytes that arrived before the connection closed")
LEASE_MS = Field("lease_ms", int, 30000)
LOCAL_TOKENS = Field("local_tokens", int, 40, "the decode request's prompt tokens")
REMOTE_TOKENS = Field("remote_tokens", int, 38, "the tokens the KV was computed for")
# Router
KEY_NAME = Field("key_name", str, "default", "the caller key's name (never the key)")
HEADER = Field("header", str, "authorization", "authorization | x-api-key")
ENV_VAR = Field("env_var", str, "TAOTOKEN_API_KEY")
CURRENT = Field("current", int, 61)
MAXIMUM = Field("maximum", int, 60)
RETRY_AFTER_S = Field("retry_after_s", float, 1)
USED = Field("used", int, 100204, "tokens used")
QUOTA = Field("quota", int, 100000, "the key's token quota")
DB_PATH = Field("db_path", str, "/data/usage.sqlite3")
REQUESTS = Field("requests", int, 12, "finished requests not yet written")
API = Field("api", str, "chat", "chat | completions | messages | responses")
PREFILL_URL = Field("prefill", str, "http://prefill:8000", "the prefill backend")
DECODE_URL = Field("decode", str, "http://decode:8000", "the decode backend")
BACKEND = Field("backend", str, "http://decode:8000", "a backend's URL")
KV_ADDR = Field("kv_addr", str, "decode:9100", "a decode's KV address as the router uses it")
REPORTED_BY = Field("reported_by", str, "GET http://decode:8000/health", "where the router learned the value")
REPORTED_PORT = Field("reported_port", int, 9100, "the KV port decode reports (and the router uses)")
CONFIGURED_PORT = Field("configured_port", int, 9200, "a KV port the router was given")
CONFIGURED_BY = Field("configured_by", str, "KV_TRANSFER_PORT", "KV_TRANSFER_PORT or decode.kv_addrs[i] in <file>")
MODE = Field("mode", str, "disaggregated", "disaggregated | colocated")
ATTEMPT = Field("attempt", int, 1)
PREFILL_ATTEMPT = Field("prefill_attempt", int, 1, "prefill tries within this attempt")
QUEUE_DEPTH = Field("queue_depth", int, 3)
KV_TRANSFER_PARAMS = Field("kv_transfer_params", list, ["do_remote_prefill", "num_tokens", "transfer_id"],
                           "the keys of the prefill's kv_transfer_params")
MID_STREAM = Field("mid_stream", bool, False, "the client had already received tokens")
RETRIED = Field("retried", bool, False, "the router tried another backend")
BODY = Field("body", str, '{"error": {"message": "CUDA out of memory"}}', "an engine's error body (raw, ≤ 2000 chars)")
CHUNKS_RELAYED = Field("chunks_relayed", int, 5)
STATE = Field("state", str, "up", "backend.health: up | down; backend.circuit: open | half_open | closed")
WAS = Field("was", str, "down", "the state before")
FAILURES = Field("failures", int, 5)
ZMQ_ADDRESS = Field("zmq_address", str, "10.0.0.5:21001")
SENDER = Field("sender", str, "b'\\x00k\\x8bEg'", "the ZMQ identity of a sender")
CLIENT_ASKED = Field("client_asked", bool, True, "the client itself sent stream_options.include_usage")
CAPABILITIES = Field("capabilities", list, ["tools", "structured_outputs"],
                     "capability flags (stack.protocol.capabilities.Capabilities field names) that are set")
PARAM = Field("param", str, "tool_choice", "the request parameter, as the client named it")
DEADLINE_MS = Field("deadline_ms", int, 120000, "[scheduler] deadline_ms, plus a long prompt's prefill work (deadlines.py)")
WORST_CASE_S = Field("worst_case_s", dict, {"first_byte_s": 120.0}, "the request time bounds computed from the settings")
# Any service: abuse limits and liveness
STALLED_S = Field("stalled_s", float, 31.2, "how long the event loop did not tick")
LIMIT_S = Field("limit_s", float, 30.0, "the bound that was passed")

# -- any service -------------------------------------------------------------------------------
SERVICE_STARTING = Event(
    "service.starting", ANY, "the process read its config (engine: model loaded; router: its backends)",
    required=(CONFIG,), optional=(ROLE, KV_ROLE, MODEL, CHECKPOINT, FINGERPRINT, LOAD_MS, PREFILL_URLS, DECODE_URLS, POLICY))
SERVICE_READY = Event("service.ready", ANY, "health flipped to SERVING after warm-up",
                      required=(HOST, PORT, HEALTH_PORT, WARMUP_MS))
SERVICE_STOPPING = Event("service.stopping", ANY, "a signal was received; draining")
CONFIG_IGNORED = Event("config.ignored", ANY, "a key is accepted but meaningless here (logged once at start)",
                       required=(KEY, VALUE))
CONFIG_INVALID = Event("config.invalid", ANY, "a bad config value (then the process exits 2)",
                       required=(FILE, KEY, PROBLEM), level="ERROR")
HTTP_ACCESS = Event("http.access", ANY, "one HTTP request answered (aiohttp's access log)",
                    required=(METHOD, PATH, STATUS, DURATION_MS))
HTTP_BAD_REQUEST = Event("http.bad_request", ANY, "a 4xx answered to a client; param: the field it names",
                         required=(STATUS, ERROR_TYPE), optional=(CODE, PARAM), level="WARNING")
HTTP_ERROR = Event("http.error", ANY, "a 5xx answered; an unhandled exception carries only exc (traceback in the log only)",
                   optional=(STATUS, ERROR_TYPE, CODE, PARAM, EXC), level="ERROR")
HTTP_BODY_TIMEOUT = Event("http.body_timeout", ANY, "a client announced a body and did not send it in time (408)",
                          required=(LIMIT_S,), level="WARNING")
INTERNAL_AUTH_REJECTED = Event("internal_auth.rejected", ANY,
                               "an engine refused a caller without the router's PD_INTERNAL_KEY (401)",
                               required=(PATH, PEER), level="WARNING")
INTERNAL_AUTH_OPEN = Event("internal_auth.open", ANY, "at start: PD_INTERNAL_KEY is unset, so /v1/* takes any caller",
                           level="WARNING")
SERVICE_LIVENESS_FAILED = Event("service.liveness_failed", ANY,
                                "the event loop stalled past its limit; the process exits so its restart policy applies",
                                required=(STALLED_S, LIMIT_S), level="ERROR")
LOG = Event("log", ANY, "a free-form line: stdlib logging (aiohttp, grpc, asyncio) or loguru's logger",
            optional=(LOGGER, EXC))
LOG_FIELDS_MISMATCH = Event("log.fields_mismatch", ANY,
                            "a log call's fields differ from its declaration here (once per event and problem)",
                            required=(FOR_EVENT, PROBLEM), level="WARNING")

# -- long prompts (issue 19): KV capacity, stalled pushes, abandoned work ------------------------
POOL_TOKENS = Field("pool_tokens", int, 61440, "tokens of KV a decode's whole KV pool holds")
KV_CACHE_BYTES = Field("kv_cache_bytes", int, 1000000000, "an engine's kv_cache_bytes (its KV pool budget)")
IDLE_MS = Field("idle_ms", int, 30000, "time since the last byte of a KV push")
COMPUTED_TOKENS = Field("computed_tokens", int, 8192, "prompt tokens whose KV was computed before the work stopped")
LAYERS_DONE = Field("layers_done", int, 3, "layers of the current forward done before it stopped")

# -- engine: requests --------------------------------------------------------------------------
ENGINE_REQUEST_RECEIVED = Event("engine.request_received", ENGINE, "a completion request was parsed",
                                required=(PROMPT_TOKENS, MAX_TOKENS, STREAM, ROLE, PD_LEG, TRANSFER_ID))
ENGINE_REQUEST_QUEUED = Event("engine.request_queued", ENGINE, "waiting for KV blocks",
                              required=(BLOCKS_NEEDED, BLOCKS_FREE))
ENGINE_PREFILL_DONE = Event("engine.prefill_done", ENGINE, "the prompt's KV is computed",
                            required=(PROMPT_TOKENS, PREFILL_MS, QUEUE_MS))
ENGINE_FIRST_TOKEN = Event("engine.first_token", ENGINE, "the first token was sampled", required=(TTFT_MS,))
ENGINE_REQUEST_FINISHED = Event("engine.request_finished", ENGINE, "a sequence ended",
                                required=(PROMPT_TOKENS, COMPLETION_TOKENS, FINISH_REASON, E2E_MS))
ENGINE_REQUEST_CANCELLED = Event("engine.request_cancelled", ENGINE, "the client went away; its KV blocks freed",
                                 required=(KV_BLOCKS_FREED, COMPLETION_TOKENS), level="WARNING")
ENGINE_REQUEST_REJECTED = Event("engine.request_rejected", ENGINE, "the request can never fit the KV cache",
                                required=(PROMPT_TOKENS, MAX_TOKENS, LIMIT), level="WARNING")
ENGINE_REQUEST_ABANDONED = Event("engine.request_abandoned", ENGINE,
                                 "the caller (the router) closed the connection: the request is cancelled, its KV freed, its push stopped",
                                 required=(PROMPT_TOKENS, PD_LEG, WAITED_MS), level="WARNING")
ENGINE_PREFILL_STOPPED = Event("engine.prefill_stopped", ENGINE,
                               "a cancelled prefill stopped between layers of its forward, not after the last one",
                               required=(PROMPT_TOKENS, COMPUTED_TOKENS, LAYERS_DONE), level="WARNING")
ENGINE_STEP_FAILED = Event("engine.step_failed", ENGINE, "a forward/sampling step raised (a bug); its sequences end with an error",
                           required=(SEQUENCES,), optional=(EXC,), level="ERROR")
ATTENTION = Field("attention", str, "numba", "numba | numpy: the decode attention an engine runs (docs/engine.md)")
THREADING_LAYER = Field("threading_layer", str, "tbb", "numba's threading layer the kernels' parallel loops run on: tbb, or "
                        "workqueue (~30x dearer a launch) when oneTBB does not load (stack/engine/batched_decode.py)")
KERNEL_MS = Field("kernel_ms", float, 412.0, "time to compile the numba attention kernel, or to load it from numba's cache")
KERNEL_CACHED = Field("kernel_cached", bool, True, "the kernel came from numba's on-disk cache (the image bakes one)")
ENGINE_ATTENTION = Event("engine.attention", ENGINE, "at warm-up: which decode attention this engine runs; reason numba_missing "
                         "(a warning: the kernel is wanted, numba does not import) or configured (attention: numpy)",
                         required=(ATTENTION,), optional=(KERNEL_MS, KERNEL_CACHED, THREADING_LAYER, REASON))
GEMM = Field("gemm", str, "mkl", "mkl | numba | numpy: what an engine's weight matmuls run on (stack/engine/gemm.py)")
CPU_VENDOR = Field("cpu_vendor", str, "GenuineIntel", "the CPU's vendor string (/proc/cpuinfo): gemm auto picks mkl on GenuineIntel only")
ENGINE_GEMM = Event("engine.gemm", ENGINE, "at warm-up: what the weight matmuls run on (mkl | numba | numpy) and the CPU's vendor; at "
                    "model load, a warning with reason mkl_missing when mkl is wanted and oneMKL does not load",
                    required=(GEMM,), optional=(CPU_VENDOR, REASON))

# -- engine: KV transfer, prefill side (kv_producer) -------------------------------------------
KV_PRODUCER_SENDING = Event("kv_producer.sending", PREFILL, "a KV push to decode starts",
                            required=(TRANSFER_ID, DECODE_KV_ADDR, NUM_TOKENS, BYTES))
KV_PRODUCER_SENT = Event("kv_producer.sent", PREFILL, "decode acknowledged the pushed KV",
                         required=(TRANSFER_ID, DECODE_KV_ADDR, NUM_TOKENS, BYTES, TRANSFER_MS, GBPS), optional=(REUSED_BLOCKS, TAIL_MS))
KV_PRODUCER_CONNECT_FAILED = Event("kv_producer.connect_failed", PREFILL, "no TCP connection to decode's KV address",
                                   required=(TRANSFER_ID, DECODE_KV_ADDR, ERROR), level="ERROR")
KV_PRODUCER_REJECTED = Event(
    "kv_producer.rejected", PREFILL,
    "decode refused the KV; reason is its code (buffer_full | pool_too_small | fingerprint_mismatch | checksum_mismatch | "
    "duplicate_transfer | claim_expired | bad_header), with the numbers behind it",
    required=(TRANSFER_ID, DECODE_KV_ADDR, REASON, DETAIL),
    optional=(LOCAL, REMOTE, BYTES, KV_BUFFER_SIZE, BUFFER_USED, EXPECTED, ACTUAL, NUM_TOKENS, POOL_TOKENS, KV_CACHE_BYTES),
    level="ERROR")
KV_PRODUCER_FAILED = Event("kv_producer.failed", PREFILL, "the push broke after connecting",
                           required=(TRANSFER_ID, DECODE_KV_ADDR, ERROR), level="ERROR")

# -- engine: KV transfer, decode side (kv_consumer) --------------------------------------------
KV_CONSUMER_LISTENING = Event("kv_consumer.listening", DECODE, "the KV listener is bound (at start)",
                              required=(KV_PORT, KV_BUFFER_SIZE, KV_LEASE_MS))
KV_CONSUMER_RECEIVED = Event("kv_consumer.received", DECODE, "a transfer arrived whole",
                             required=(TRANSFER_ID, NUM_TOKENS, BYTES, PEER, RECEIVE_MS, GBPS), optional=(REUSED_BLOCKS,))
KV_CONSUMER_CLAIMED = Event("kv_consumer.claimed", DECODE, "a decode request took its KV",
                            required=(TRANSFER_ID, WAIT_MS, NUM_TOKENS, BYTES))
KV_CONSUMER_TIMEOUT = Event("kv_consumer.timeout", DECODE, "a decode request's KV did not arrive in time",
                            required=(TRANSFER_ID, WAITED_MS, KV_TRANSFER_TIMEOUT_MS, IN_FLIGHT),
                            level="ERROR")
KV_CONSUMER_BUFFER_FULL = Event("kv_consumer.buffer_full", DECODE, "a transfer does not fit the receive buffer",
                                required=(TRANSFER_ID, BYTES, KV_BUFFER_SIZE, BUFFER_USED, PEER), optional=(NUM_TOKENS,),
                                level="ERROR")
KV_CONSUMER_POOL_TOO_SMALL = Event("kv_consumer.pool_too_small", DECODE,
                                   "a transfer's prompt can never fit this decode's KV pool: refused at the header, before any KV moves",
                                   required=(TRANSFER_ID, NUM_TOKENS, POOL_TOKENS, KV_CACHE_BYTES, PEER), level="ERROR")
KV_CONSUMER_STALLED = Event("kv_consumer.stalled", DECODE,
                            "an admitted push sent nothing for kv_lease_ms (the lease counts from the last byte): closed",
                            required=(TRANSFER_ID, IDLE_MS, KV_LEASE_MS, RECEIVED, BYTES, PEER), level="ERROR")
KV_CONSUMER_FINGERPRINT_MISMATCH = Event("kv_consumer.fingerprint_mismatch", DECODE,
                                         "the KV came from another model version",
                                         required=(TRANSFER_ID, LOCAL, REMOTE, PEER), level="ERROR")
KV_CONSUMER_CHECKSUM_MISMATCH = Event("kv_consumer.checksum_mismatch", DECODE, "the KV arrived corrupted",
                                      required=(TRANSFER_ID, EXPECTED, ACTUAL, BAD_SEGMENTS, PEER),
                                      level="ERROR")
KV_CONSUMER_LEASE_EXPIRED = Event("kv_consumer.lease_expired", DECODE, "pushed KV nobody claimed was freed",
                                  required=(TRANSFER_ID, BYTES, LEASE_MS, BUFFER_USED), level="WARNING")
KV_CONSUMER_RECOMPUTE = Event("kv_consumer.recompute", DECODE, "policy recompute: decode runs the prefill itself",
                              required=(TRANSFER_ID, REASON, PROMPT_TOKENS), level="WARNING")
KV_CONSUMER_FAILED = Event("kv_consumer.failed", DECODE, "policy fail: the KV failure is answered as an error",
                           required=(TRANSFER_ID, REASON), level="ERROR")
KV_CONSUMER_PROTOCOL_ERROR = Event(
    "kv_consumer.protocol_error", DECODE, "a push broke the protocol; code: bad_header | duplicate_transfer | claim_expired",
    required=(TRANSFER_ID, CODE, ERROR, PEER), level="ERROR")
KV_CONSUMER_INCOMPLETE = Event("kv_consumer.incomplete", DECODE, "the connection closed mid-payload",
                               required=(TRANSFER_ID, RECEIVED, BYTES, PEER), level="ERROR")
KV_CONSUMER_PROMPT_MISMATCH = Event("kv_consumer.prompt_mismatch", DECODE,
                                    "the KV was computed for another prompt than the decode request's",
                                    required=(TRANSFER_ID, LOCAL_TOKENS, REMOTE_TOKENS), level="ERROR")

# -- router ------------------------------------------------------------------------------------
AUTH_ACCEPTED = Event("auth.accepted", ROUTER, "a caller's key matched", required=(KEY_NAME, HEADER), level="DEBUG")
AUTH_REJECTED = Event(
    "auth.rejected", ROUTER, "401; reason: missing | malformed | whitespace | quoted | unknown | no_keys_configured",
    required=(REASON, HEADER), level="WARNING")
AUTH_KEY_MISSING = Event("auth.key_missing", ROUTER, "at start: a key's env var is unset or empty",
                         required=(KEY_NAME, ENV_VAR), level="WARNING")
LIMIT_RATE = Event("limit.rate_limited", ROUTER, "a key hit its rate or concurrency limit (429)",
                   required=(KEY_NAME, LIMIT, CURRENT, MAXIMUM, RETRY_AFTER_S), level="WARNING")
LIMIT_QUOTA = Event("limit.quota_exhausted", ROUTER, "a key used up its token quota (429)",
                    required=(KEY_NAME, USED, QUOTA), level="WARNING")
USAGE_FLUSH_FAILED = Event("usage.flush_failed", ROUTER, "usage could not be written (kept in memory, retried)",
                           required=(DB_PATH, REQUESTS, ERROR), level="ERROR")
# -- several routers: limits shared through Redis (stack/router/limits_redis.py; fleet) ------------
STORE_URL = Field("url", str, "redis://redis:6379/0", "the shared limit store (never carries a password)")
STORE_OP = Field("op", str, "take", "what the router was doing: start | take | give_back | totals | in_flight | renew")
LIMIT_STORE_CONNECTED = Event("limit_store.connected", ROUTER, "at start: per-key limits are shared through this Redis",
                              required=(STORE_URL, LEASE_MS))
LIMIT_STORE_UNAVAILABLE = Event("limit_store.unavailable", ROUTER,
                                "Redis did not answer: generation requests get 503 limits_unavailable until it does",
                                required=(STORE_URL, STORE_OP, ERROR), level="ERROR")
# Retired (RETIRED below): router.scheduled carries its api, model and stream, and its queue_ms says when the request
# entered the PD flow, so a request's router hop is one line. Those four are optional there only because older routers' lines
# lack them; the router logs all four on every attempt.
ROUTER_REQUEST_RECEIVED = Event("router.request_received", ROUTER, "a generation request was parsed",
                                required=(API, MODEL, STREAM))
ROUTER_SCHEDULED = Event("router.scheduled", ROUTER, "a prefill/decode pair was picked for an attempt of a request",
                         required=(PREFILL_URL, DECODE_URL, POLICY, MODE, ATTEMPT),
                         optional=(PREFILL_ATTEMPT, API, MODEL, STREAM, QUEUE_MS))
ROUTER_QUEUED = Event("router.queued", ROUTER, "every backend slot is busy; the request waits",
                      required=(ROLE, QUEUE_DEPTH))
ROUTER_QUEUE_FULL = Event("router.queue_full", ROUTER, "rejected with 429/503: the queue is full or the wait too long",
                          required=(ROLE, QUEUE_DEPTH, RETRY_AFTER_S), level="WARNING")
ROUTER_PREFILL_DONE = Event("router.prefill_done", ROUTER, "the prefill leg answered; decode starts with its kv_transfer_params "
                            "(the names of the keys handed on)",
                            required=(PREFILL_URL, PREFILL_MS, TRANSFER_ID), optional=(DECODE_URL, KV_TRANSFER_PARAMS))
ROUTER_PREFILL_FAILED = Event("router.prefill_failed", ROUTER, "the prefill leg failed (retried or not)",
                              required=(PREFILL_URL, STATUS, ERROR, ATTEMPT, RETRIED), optional=(DECODE_URL, CODE), level="WARNING")
# Retired (RETIRED below): router.prefill_done carries it now.
ROUTER_KV_HANDOFF = Event("router.kv_handoff", ROUTER, "the decode leg starts with prefill's kv_transfer_params",
                          required=(DECODE_URL, TRANSFER_ID, KV_TRANSFER_PARAMS))
ROUTER_DECODE_FIRST_TOKEN = Event("router.decode_first_token", ROUTER, "decode's first chunk reached the router",
                                  required=(DECODE_URL, TTFT_MS))
ROUTER_DECODE_FAILED = Event("router.decode_failed", ROUTER, "the decode leg failed (before or after the first token)",
                             required=(DECODE_URL, STATUS, ERROR, MID_STREAM, RETRIED), level="ERROR")
ROUTER_UPSTREAM_ERROR = Event("router.upstream_error", ROUTER, "an engine answered an error; its raw body",
                              required=(BACKEND, ROLE, STATUS, BODY), level="WARNING")
ROUTER_CLIENT_DISCONNECTED = Event("router.client_disconnected", ROUTER, "the client went away; upstream cancelled",
                                   required=(DECODE_URL, CHUNKS_RELAYED), level="WARNING")
ROUTER_REQUEST_DONE = Event("router.request_done", ROUTER, "a generation request ended (status as the client saw it)",
                            required=(API, KEY_NAME, STATUS, ERROR, PROMPT_TOKENS, COMPLETION_TOKENS, E2E_MS))
ROUTER_DEADLINE_EXCEEDED = Event("router.deadline_exceeded", ROUTER,
                                 "no first byte (or non-streamed answer) within the request's deadline (504; deadlines.py)",
                                 required=(DEADLINE_MS, STREAM), optional=(PROMPT_TOKENS,), level="WARNING")
ROUTER_BOUNDS = Event("router.bounds", ROUTER, "at start: the worst-case request times computed from the settings",
                      required=(WORST_CASE_S,))
ROUTER_USAGE_CHUNK = Event("router.usage_chunk", ROUTER, "a stream ended with the usage chunk whose choices is []",
                           required=(CLIENT_ASKED, PROMPT_TOKENS, COMPLETION_TOKENS))
BACKEND_HEALTH = Event("backend.health", ROUTER, "a backend went up or down", required=(BACKEND, ROLE, STATE, WAS, REASON))
BACKEND_CIRCUIT = Event("backend.circuit", ROUTER, "a backend's circuit breaker changed state",
                        required=(BACKEND, STATE, FAILURES), level="WARNING")
BACKEND_KV_ADDR = Event("backend.kv_addr", ROUTER, "a decode's KV address, learned from its GET /health",
                        required=(BACKEND, KV_ADDR, REPORTED_BY))
ROUTER_KV_PORT_MISMATCH = Event("router.kv_port_mismatch", ROUTER,
                                "a KV port the router was given disagrees with decode's own (decode's is used)",
                                required=(BACKEND, KV_ADDR, REPORTED_PORT, REPORTED_BY, CONFIGURED_PORT, CONFIGURED_BY),
                                level="ERROR")
P2PNCCL_JOINED = Event("p2pnccl.joined", ROUTER, "a vLLM P2pNccl instance registered",
                       required=(ROLE, BACKEND, ZMQ_ADDRESS))
P2PNCCL_LEFT = Event("p2pnccl.left", ROUTER, "a P2pNccl instance stopped pinging and was removed",
                     required=(ROLE, BACKEND, ZMQ_ADDRESS), level="WARNING")
P2PNCCL_BAD_PING = Event("p2pnccl.bad_ping", ROUTER, "a registration not in vLLM's format (once per sender)",
                         required=(SENDER, ERROR), level="WARNING")
BACKEND_CAPABILITIES = Event("backend.capabilities", ROUTER,
                             "what a backend can do, learned from its GET /health or set in settings.toml (on change)",
                             required=(BACKEND, ROLE, CAPABILITIES, REPORTED_BY))
ROUTER_UNSUPPORTED = Event("router.unsupported_parameter", ROUTER,
                           "400: the request asks for what the backends cannot do (their declared capabilities)",
                           required=(API, PARAM, CAPABILITIES), level="WARNING")

# -- vLLM's own PD (issue 11): what real vLLM showed the router ----------------------------------------
ROUTER_PREFILL_FINISHED = Event("router.prefill_finished", ROUTER,
                                "the prefill's one token ended the answer (EOS, a stop string): it is the answer, no decode leg",
                                required=(PREFILL_URL, DECODE_URL, FINISH_REASON))
ROUTER_KV_EXPIRED = Event("router.kv_expired", ROUTER,
                          "the prefill's KV lease ran out before the decode leg was sent: the pair is re-picked, never sent",
                          required=(PREFILL_URL, DECODE_URL, LEASE_MS, WAITED_MS), level="WARNING")

# -- replica discovery (issue 14: stack/router/replicas.py) -----------------------------------------
DISCOVER = Field("discover", str, "dns://prefill:8000", "a pool's discover setting: the name its replicas are found under")
REPLICAS = Field("replicas", int, 2, "addresses the discover name has now")
IN_FLIGHT_REQUESTS = Field("in_flight_requests", int, 1, "requests still running on a backend that left its pool")
DISCOVERY_JOINED = Event("discovery.joined", ROUTER, "a replica appeared under its pool's discover name; it takes requests once healthy",
                         required=(ROLE, BACKEND, DISCOVER, REPLICAS))
DISCOVERY_LEFT = Event("discovery.left", ROUTER, "a replica vanished from its discover name; it gets no new request, those in flight finish",
                       required=(ROLE, BACKEND, DISCOVER, REPLICAS, IN_FLIGHT_REQUESTS))
DISCOVERY_FAILED = Event("discovery.failed", ROUTER, "a discover name could not be resolved; the pool stays as it was (once per streak)",
                         required=(ROLE, DISCOVER, ERROR), level="WARNING")

ROUTER_VERSION_SPLIT = Event("router.model_version_split", ROUTER,
                             "no usable prefill runs this decode's model (a rolling update): decode serves the request alone",
                             required=(DECODE_URL, FINGERPRINT), level="WARNING")

# -- start-up failures (issue 20) --------------------------------------------------------------------
PORT_OWNER = Field("owner", str, "python3 (pid 4242)", "the process listening on the port, when /proc shows it")
SETTING = Field("setting", str, "[server] port (settings.toml) or --port", "what to change to use another port")
SERVICE_PORT_IN_USE = Event("service.port_in_use", ANY, "the HTTP or health port is taken by another process: the service exits 2",
                            required=(PORT, SETTING), optional=(PORT_OWNER,), level="ERROR")

ALL: Mapping[str, Event] = {value: value for value in dict(globals()).values() if isinstance(value, Event)}
# Events no service logs any more, kept declared so that the doctor still reads the logs (and recorded bundles) of
# the versions that did. Retire an event instead of deleting it.
RETIRED: frozenset[Event] = frozenset({ROUTER_KV_HANDOFF, ROUTER_REQUEST_RECEIVED})


def constant_of(declared: Event | Field) -> str:
    """The name of an event's or field's constant here (for messages that say which declaration to edit)."""
    return next(name for name, value in globals().items() if value is declared)
