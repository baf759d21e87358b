"""Every log event name the services emit. Logs are an API: the doctor reads these names.

Rules: names are `area.what_happened`, lower case; never rename one (add a new one instead);
every event a service logs is a constant here, and `ALL` lists them for the doctor and the tests.
Each line carries the flat fields `ts, level, service, event, request_id, msg` plus the extra
fields named in the comment (numbers are plain JSON numbers, durations in ms, sizes in bytes).
"""

# -- any service -------------------------------------------------------------------------------
SERVICE_STARTING = "service.starting"  # config (path), role/version facts
SERVICE_READY = "service.ready"  # health flipped to SERVING; warmup_ms
SERVICE_STOPPING = "service.stopping"  # signal received
CONFIG_IGNORED = "config.ignored"  # key, value: accepted but meaningless on CPU (logged once)
CONFIG_INVALID = "config.invalid"  # file, key, problem (then the process exits 2)
HTTP_ACCESS = "http.access"  # method, path, status, duration_ms
HTTP_BAD_REQUEST = "http.bad_request"  # status, type, code, message (4xx answered to a client)
HTTP_ERROR = "http.error"  # status, type, message; an internal error (5xx) with traceback in log only

# -- engine: requests --------------------------------------------------------------------------
ENGINE_REQUEST_RECEIVED = "engine.request_received"  # prompt_tokens, max_tokens, stream, role
ENGINE_REQUEST_QUEUED = "engine.request_queued"  # waiting for KV blocks; blocks_needed, blocks_free
ENGINE_PREFILL_DONE = "engine.prefill_done"  # prompt_tokens, prefill_ms
ENGINE_FIRST_TOKEN = "engine.first_token"  # ttft_ms
ENGINE_REQUEST_FINISHED = "engine.request_finished"  # prompt_tokens, completion_tokens, finish_reason, e2e_ms
ENGINE_REQUEST_CANCELLED = "engine.request_cancelled"  # client went away; kv_blocks_freed
ENGINE_REQUEST_REJECTED = "engine.request_rejected"  # can never fit: prompt_tokens, max_tokens, limit
ENGINE_STEP_FAILED = "engine.step_failed"  # sequences: a forward/sampling step raised (a bug); they end with an error

# -- engine: KV transfer, prefill side (kv_producer) -------------------------------------------
KV_PRODUCER_SENDING = "kv_producer.sending"  # transfer_id, decode_kv_addr, num_tokens, bytes
KV_PRODUCER_SENT = "kv_producer.sent"  # transfer_id, decode_kv_addr, num_tokens, bytes, transfer_ms, gbps
KV_PRODUCER_CONNECT_FAILED = "kv_producer.connect_failed"  # transfer_id, decode_kv_addr, error
KV_PRODUCER_REJECTED = "kv_producer.rejected"  # transfer_id, reason (buffer_full|fingerprint_mismatch|checksum|…), detail
KV_PRODUCER_FAILED = "kv_producer.failed"  # transfer_id, error (any other send failure)

# -- engine: KV transfer, decode side (kv_consumer) --------------------------------------------
KV_CONSUMER_LISTENING = "kv_consumer.listening"  # kv_port, kv_buffer_size
KV_CONSUMER_RECEIVED = "kv_consumer.received"  # transfer_id, num_tokens, bytes, peer
KV_CONSUMER_CLAIMED = "kv_consumer.claimed"  # transfer_id, wait_ms
KV_CONSUMER_TIMEOUT = "kv_consumer.timeout"  # transfer_id, waited_ms, kv_transfer_timeout_ms
KV_CONSUMER_BUFFER_FULL = "kv_consumer.buffer_full"  # transfer_id, bytes, kv_buffer_size, buffer_used
KV_CONSUMER_FINGERPRINT_MISMATCH = "kv_consumer.fingerprint_mismatch"  # transfer_id, local, remote
KV_CONSUMER_CHECKSUM_MISMATCH = "kv_consumer.checksum_mismatch"  # transfer_id, expected, actual
KV_CONSUMER_LEASE_EXPIRED = "kv_consumer.lease_expired"  # transfer_id, bytes, lease_ms (pushed, never claimed)
KV_CONSUMER_RECOMPUTE = "kv_consumer.recompute"  # transfer_id, reason: policy recompute ran prefill locally
KV_CONSUMER_FAILED = "kv_consumer.failed"  # transfer_id, reason: policy fail answered an error
KV_CONSUMER_PROTOCOL_ERROR = "kv_consumer.protocol_error"  # peer, code (bad_header|duplicate_transfer|claim_expired), error
KV_CONSUMER_INCOMPLETE = "kv_consumer.incomplete"  # transfer_id, received, bytes, peer: connection closed mid-payload
KV_CONSUMER_PROMPT_MISMATCH = "kv_consumer.prompt_mismatch"  # transfer_id, local_tokens, remote_tokens (router sent another prompt)

# -- router ------------------------------------------------------------------------------------
AUTH_ACCEPTED = "auth.accepted"  # key_name (never the key or its hash); DEBUG: router.request_done carries key_name
AUTH_REJECTED = "auth.rejected"  # reason: missing|malformed|whitespace|quoted|unknown|no_keys_configured, header
AUTH_KEY_MISSING = "auth.key_missing"  # at start: api_key_env is unset or empty in the environment
LIMIT_RATE = "limit.rate_limited"  # key_name, limit (rpm|tpm|concurrency), current, maximum
LIMIT_QUOTA = "limit.quota_exhausted"  # key_name, used, quota
USAGE_FLUSH_FAILED = "usage.flush_failed"  # db_path, requests (kept in memory, retried next interval), error
ROUTER_REQUEST_RECEIVED = "router.request_received"  # api (chat|completions|messages|responses), model, stream
ROUTER_SCHEDULED = "router.scheduled"  # prefill, decode, policy, mode (disaggregated|colocated), attempt
ROUTER_QUEUED = "router.queued"  # all backend slots busy; queue_depth
ROUTER_QUEUE_FULL = "router.queue_full"  # rejected with 429/503; queue_depth, retry_after_s
ROUTER_PREFILL_DONE = "router.prefill_done"  # prefill, prefill_ms, transfer_id
ROUTER_PREFILL_FAILED = "router.prefill_failed"  # prefill, status, error, attempt (retried or not)
ROUTER_KV_HANDOFF = "router.kv_handoff"  # decode, transfer_id, kv_transfer_params keys
ROUTER_DECODE_FIRST_TOKEN = "router.decode_first_token"  # decode, ttft_ms
ROUTER_DECODE_FAILED = "router.decode_failed"  # decode, status, error, mid_stream (bool)
ROUTER_UPSTREAM_ERROR = "router.upstream_error"  # backend, status, body (the raw error body from an engine)
ROUTER_CLIENT_DISCONNECTED = "router.client_disconnected"  # upstream requests cancelled
ROUTER_REQUEST_DONE = "router.request_done"  # status, prompt_tokens, completion_tokens, e2e_ms
BACKEND_HEALTH = "backend.health"  # backend, role, state (up|down), was
BACKEND_CIRCUIT = "backend.circuit"  # backend, state (open|half_open|closed), failures
BACKEND_KV_ADDR = "backend.kv_addr"  # backend, kv_addr, reported_by: a decode's KV address, learned from its GET /health
# ERROR: a KV port the router was given disagrees with the one decode reports (which is used): backend, kv_addr,
# reported_port, reported_by ("GET <url>/health"), configured_port, configured_by (KV_TRANSFER_PORT | decode.kv_addrs[i] in <file>)
ROUTER_KV_PORT_MISMATCH = "router.kv_port_mismatch"
P2PNCCL_JOINED = "p2pnccl.joined"  # a vLLM P2pNccl instance registered: role, backend, zmq_address
P2PNCCL_LEFT = "p2pnccl.left"  # it stopped pinging and was removed: role, backend, zmq_address
P2PNCCL_BAD_PING = "p2pnccl.bad_ping"  # a registration that is not vLLM's format (logged once per sender): sender, error
# doctor (choices diagnosis): a stream ended with the usage chunk whose `choices` is []; client_asked
# (bool: the client itself sent stream_options.include_usage). Logged by the router once per stream.
ROUTER_USAGE_CHUNK = "router.usage_chunk"  # client_asked, prompt_tokens, completion_tokens

ALL: frozenset[str] = frozenset(
    value for name, value in dict(globals()).items() if name.isupper() and isinstance(value, str)
)
