"""Settings are data: one object per process kind, read once at start-up from the
environment (prefix ``SF_``) and command-line flags, then passed down explicitly.

``REDIS_URL`` is honoured as well as ``SF_REDIS_URL``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import AliasChoices, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from streamfleet.shared.schema import DEFAULT_MAX_TOKENS

if TYPE_CHECKING:
    from streamfleet.shared.grammar import GrammarLimits
    from streamfleet.shared.keys import Keys
    from streamfleet.shared.redis import RedisTarget

__all__ = ["CommonSettings", "GatewaySettings", "WorkerSettings"]


class CommonSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SF_", extra="ignore")

    redis_url: str = Field(
        "redis://127.0.0.1:6379/0", validation_alias=AliasChoices("SF_REDIS_URL", "REDIS_URL")
    )
    #: Redis Cluster (docs/cluster.md): SF_REDIS_URL then names one or more seed nodes
    #: (``redis://h1:7000,h2:7000``); a URL listing several hosts implies it
    redis_cluster: bool = False
    #: cluster: seconds a subscription or a batch waits for a failed primary's replica to
    #: take over before the requests on that shard end with ``broker_unavailable`` (a
    #: worker cancels those whose events have not reached their shard for that long)
    redis_failover_s: float = 30.0
    #: prefix of every Redis key (docs/operations.md, "Redis keys")
    key_prefix: str = "sf"
    #: model repository folder (default: <repo>/engines)
    engines_dir: str | None = None
    log_level: str = "info"
    #: event loop: auto (uvloop when installed), uvloop, asyncio
    event_loop: Literal["auto", "uvloop", "asyncio"] = "auto"
    #: "json" (production) or "console" (readable; `streamfleet serve`)
    log_format: str = "json"
    #: log prompt text (off by default: prompts may be private)
    log_prompts: bool = False
    #: seconds a worker heartbeat stays valid
    worker_ttl_s: float = 10.0
    #: request event logs (sf:log:{request_id}) for resume and gap repair
    log_ttl_s: float = 600.0
    log_maxlen: int = 10_000
    #: a Redis command with no reply for this long fails (blocking reads add their block
    #: time). Stalls shorter than this (a fork, a slow disk, a network blip) only delay
    #: requests; past it, affected requests end with ``broker_unavailable``. A refused or
    #: reset connection fails at once whatever this is.
    redis_socket_timeout_s: float = 10.0
    #: API-key tier overrides as JSON, e.g. '{"free": {"requests_per_minute": 20}}'
    #: (fields and defaults: shared/tiers.py); empty = the default tiers
    tiers: str = ""
    #: what one structured-output constraint may cost (docs/security.md, "Grammars"), the
    #: same in gateways (which try each new grammar) and workers (which enforce it):
    #: llguidance's lexer work to build a grammar's lexer, and per token; its lexer states
    #: (about 1 KiB each); its parser items per token; its compiled size
    grammar_lexer_fuel: int = 50_000
    grammar_step_fuel: int = 50_000
    grammar_lexer_states: int = 10_000
    grammar_step_items: int = 50_000
    grammar_size: int = 200_000
    #: a token mask that takes longer than this ends its request (the batch goes on)
    grammar_mask_budget_ms: float = 50.0
    #: deepest nesting of a schema, a tool's parameters or any JSON a request carries
    grammar_max_depth: int = 64
    #: compiled grammars a worker keeps, sized by the memory they allocated (MB)
    grammar_cache_mb: float = 64.0
    #: tokens in one block of the prefix cache, which gateways and workers hash alike
    #: (shared/prefixhash.py); the same in every process of a fleet
    prefix_block_tokens: int = Field(32, ge=1, le=4096)
    #: fair share inside a lane (shared/fairshare.py): unread entries a lane's stream keeps
    #: while tasks wait for their tenant's turn (so an idle worker's read wakes); at most
    #: this many tasks of a lane are ever taken out of fair order. The same in every process
    fair_window: int = Field(1, ge=1, le=1024)
    #: seconds the counters of tenants who no longer send anything are kept
    fair_ttl_s: int = Field(3600, ge=1, le=30 * 86400)

    @model_validator(mode="after")
    def _cluster_from_url(self) -> CommonSettings:
        self.redis_cluster = self.redis_target().cluster  # (a bad URL is refused here, by name)
        return self

    def redis_target(self) -> RedisTarget:
        """Where Redis is: ``shared.redis.RedisTarget`` (one server, or a cluster's seeds)."""
        from streamfleet.shared.redis import RedisTarget

        return RedisTarget.parse(self.redis_url, self.redis_cluster)

    def grammar_limits(self) -> GrammarLimits:
        """The ``SF_GRAMMAR_*`` settings as ``shared.grammar.GrammarLimits``."""
        from streamfleet.shared.grammar import GrammarLimits

        return GrammarLimits(lexer_fuel=self.grammar_lexer_fuel, step_fuel=self.grammar_step_fuel,
                             step_items=self.grammar_step_items, lexer_states=self.grammar_lexer_states,
                             grammar_size=self.grammar_size, mask_budget_ms=self.grammar_mask_budget_ms,
                             max_depth=self.grammar_max_depth, cache_mb=self.grammar_cache_mb)

    def keys(self) -> Keys:
        """The key names of this fleet (prefix, cluster or not): ``shared.keys.Keys``."""
        from streamfleet.shared.keys import Keys

        return Keys(self.key_prefix, self.redis_cluster)


class GatewaySettings(CommonSettings):
    host: str = "127.0.0.1"
    port: int = 8000
    #: require an API key (Authorization: Bearer, or ?api_key= on WebSockets)
    auth_enabled: bool = False
    #: seconds a gateway caches an API-key record; a revocation takes effect within this
    key_cache_s: float = 5.0
    default_model: str = "tiny-gpt"
    #: models served, comma separated; empty = every model in the repository
    models: str = ""
    max_frame_bytes: int = 1 << 20
    max_prompt_chars: int = 100_000
    max_inflight_per_connection: int = 64
    max_max_tokens: int = 4096
    #: a request that asks for an OpenAI parameter streamfleet does not implement
    #: (``echo``, ``suffix``, ``store``…) gets 400 naming it;
    #: false: it is served without it and a warning logged (for clients that cannot help
    #: sending such fields)
    refuse_unsupported: bool = True
    #: a request for a model that has had no live worker for this many seconds (or since
    #: this gateway started) is refused with 503 ``no_workers`` and Retry-After instead of
    #: queued; within it (a worker rollout, a crash) requests queue in the lanes. 0: always
    #: queue (workers scaled to zero, woken by the lanes' backlog)
    no_worker_grace_s: float = 60.0
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    max_stop_sequences: int = 4
    max_stop_chars: int = 64
    #: capacity of each lane (tasks queued + in flight); new work is refused with 429
    #: ``overloaded`` once a lane's backlog reaches ``overload_fraction`` of it (0 = no limit)
    lane_capacity: dict[str, int] = {"high": 1024, "normal": 1024}
    #: send a request whose prompt's prefix a live worker holds in its prefix cache to
    #: the worker where it would start soonest (docs/architecture.md, "Prefix-aware
    #: routing"); off: every request through the shared lanes
    prefix_routing: bool = True
    #: what one task waiting or running at a worker weighs in the routing choice, in prompt
    #: tokens to prefill (about a step's work: SF_MAX_STEP_TOKENS' default)
    route_task_tokens: int = Field(256, ge=0, le=1_000_000)
    #: inside a lane, the next task taken belongs to the waiting tenant (API key; its
    #: connection with auth off) served the fewest weighted tokens (docs/scheduling.md,
    #: "Fair share"); off: first come, first served
    fair_share: bool = True
    #: with fair share on, a task routed to a worker's affinity stream (prefix-aware
    #: routing) goes there directly only while nobody waits in its lane and that stream
    #: holds fewer unread tasks than this; otherwise it waits its turn in the shared lane
    fair_routed_window: int = Field(4, ge=1, le=1024)
    overload_fraction: float = 0.8
    overload_retry_after_ms: int = 1000
    #: most WebSocket connections one gateway process holds
    max_connections: int = 10_000
    #: the edge before auth (docs/security.md, "The edge before auth"): most connections of
    #: any kind open on the HTTP port of one gateway process (HTTP, SSE, WebSocket, and those
    #: that have sent no request yet); past it a new one gets 503 and is closed (0 = no cap).
    #: Keep it above ``max_connections``
    max_open_connections: int = 12_000
    #: most connections one client address may hold open on the HTTP port before they
    #: authenticate; past it a new one gets 429 and is closed (0 = no cap). Behind a proxy
    #: or load balancer every client has the proxy's address: leave it 0 there
    max_connections_per_address: int = 0
    #: longest request target (the URL in the request line); longer gets 414 and a close
    max_request_line_bytes: int = 8192
    #: largest request head (request line and header fields); past it, 431 and a close
    #: before the rest is parsed
    max_header_bytes: int = 32_768
    #: most header fields in one request; more get 431 and a close
    max_header_count: int = 100
    #: a request head must arrive whole within this many seconds of the connection opening
    #: (or of its first byte, on a kept-alive connection), else the connection is closed (408
    #: when part of it came); also the gRPC port's handshake timeout. 0 = no limit
    header_timeout_s: float = 10.0
    #: close a WebSocket with no request in flight after this many seconds
    ws_idle_timeout_s: float = 60.0
    #: close a WebSocket this old once it has nothing in flight (0 = never)
    ws_max_age_s: float = 3600.0
    #: ... and regardless of what is in flight this long after that
    ws_max_age_grace_s: float = 60.0
    #: a WebSocket that drops without a close frame keeps its requests running this long,
    #: so the client can resume them (on any gateway); a clean close cancels at once
    ws_resume_grace_s: float = 30.0
    #: the same for an SSE response whose client disconnects (0: cancel at once)
    sse_resume_grace_s: float = 0.0
    #: which web pages may use the gateway (WebSockets and HTTP POSTs that carry an Origin
    #: header; clients that send none are not concerned): empty = the same origin only
    #: (Origin's scheme, host and port = the request's), "*" = any, else a comma-separated
    #: list of exact origins (gateway/edge/origin.py)
    allowed_origins: str = ""
    #: default request timeout (queue deadline), seconds
    request_timeout_s: float = 120.0
    #: SIGTERM: let streams finish for this long, then close what is left (1001)
    drain_timeout_s: float = 30.0
    #: SSE comment sent after this many seconds without an event
    sse_keepalive_s: float = 15.0
    #: the Responses API (``/v1/responses``, docs/openai.md): seconds a stored response
    #: (``store``, on by default) is kept for ``GET`` and ``previous_response_id``
    responses_ttl_s: float = 604_800.0
    #: largest stored response (its object and its conversation, encoded); a request whose
    #: conversation is already larger is refused (400 naming ``input``), one whose output
    #: takes it past is answered but not stored (``"store": false`` in the response)
    responses_max_bytes: int = 1 << 20
    #: negotiate per-message deflate when a client offers it (browsers do). Off: a token
    #: frame is a few dozen bytes, and compressing it costs zlib state per connection and
    #: CPU per frame (docs/operations.md, "Idle connections")
    ws_compression: bool = False
    ws_ping_interval_s: float = 20.0
    ws_ping_timeout_s: float = 20.0
    #: the gRPC service (streamfleet.v1.Inference, health, reflection) on this port of
    #: ``host`` (0 = off); its messages may be up to ``max_frame_bytes``
    grpc_port: int = 50051
    #: most concurrent calls on one HTTP/2 connection (more wait for one to end)
    grpc_max_concurrent_streams: int = 256
    #: ping an idle gRPC connection after this many seconds; drop it if no answer within
    #: ``grpc_keepalive_timeout_s``. Clients may ping every 10 s at most, also without calls
    grpc_keepalive_s: float = 30.0
    grpc_keepalive_timeout_s: float = 10.0
    #: ask a gRPC connection this old to reconnect (GOAWAY), so clients spread over new
    #: gateways; calls in flight get ``grpc_max_connection_age_grace_s`` more (0 = never)
    grpc_max_connection_age_s: float = 3600.0
    grpc_max_connection_age_grace_s: float = 60.0
    #: most connections open on the gRPC port of one gateway process; past it a new one is
    #: closed at once (0 = no cap)
    grpc_max_connections: int = 1000
    #: close a gRPC connection with no call open for this long (GOAWAY; a client reconnects
    #: on its next call), so connections that never open a call are not held (0 = never)
    grpc_max_connection_idle_s: float = 120.0
    #: largest metadata (headers) a gRPC call may send; a larger one is refused
    #: (RESOURCE_EXHAUSTED) before its handler runs
    grpc_max_metadata_bytes: int = 16_384
    #: voice (``/v1/audio/stream``, docs/voice.md): the speech model a ``start`` frame gets
    #: when it names none
    default_asr_model: str = "asr-en"
    #: inbound frames a voice connection may send per second on average, and at once
    audio_frames_per_s: float = 150.0
    audio_frames_burst: float = 300.0
    #: seconds of audio (the frames' durations) a voice connection may send per second of
    #: wall time on average: 1.5 = half again real time. A frame over it is dropped, not
    #: queued, with ``rate_limited`` (docs/voice.md, "Limits"); 0 = no limit
    audio_max_realtime: float = 1.5
    #: ... and how far ahead of that it may get at once, in seconds of audio (jitter)
    audio_realtime_burst_s: float = 2.0
    #: voice activity detector: silero | webrtc | energy, or off (every frame is speech:
    #: an utterance lasts from the first audio to ``stop``, as for push-to-talk clients)
    vad: Literal["silero", "webrtc", "energy", "off"] = "silero"
    #: speech this quiet for this long ends its utterance (ms)
    vad_end_silence_ms: int = 600
    #: audio kept after the last voiced frame before speech counts as stopped (ms)
    vad_hangover_ms: int = 200
    #: audio before the onset that goes with the utterance (ms)
    vad_preroll_ms: int = 300
    #: an utterance this long is ended and a new one begins (s)
    max_utterance_s: float = 30.0
    #: an utterance that has waited this long for a worker slot gets a ``high_load`` warning
    voice_slot_warning_s: float = 3.0
    #: share the speech workers' decoder slots fairly among tenants (API keys; connections
    #: with auth off), across gateways in Redis: an utterance waits at its gateway until it
    #: is its tenant's turn (docs/voice.md, "Fair slots"). False: utterances queue in the
    #: lanes, first come, first served
    voice_fair_slots: bool = True
    #: slots a tenant at or over its fair share must leave free for other tenants
    voice_reserved_slots: int = Field(1, ge=0)
    #: ``POST /v1/audio/transcriptions`` (docs/openai.md, "Audio transcriptions"): the
    #: largest audio file, in bytes (OpenAI's limit, 25 MiB); a larger upload is refused
    #: with 413 at the byte that crosses it (or at once, by its Content-Length)
    transcription_max_bytes: int = Field(26_214_400, ge=1)
    #: the longest audio a transcription takes, in seconds (read from the file's header
    #: before it is decoded)
    transcription_max_duration_s: float = Field(1500.0, gt=0)
    #: utterances of one file transcribed at once: each is a request of its own (a stream
    #: slot of the key, a fair speech slot, a worker's decoder slot)
    transcription_concurrency: int = Field(4, ge=1)
    #: Prometheus ``/metrics`` on a listener of its own, never on the API port (0 = none).
    #: Off by default, like the worker's: several gateways on one host each need their own
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"
    #: serve the OpenAPI schema and its pages (/openapi.json, /docs, /redoc), which need
    #: no API key; off = 404
    api_docs: bool = False


class WorkerSettings(CommonSettings):
    model: str = "tiny-gpt"
    #: override the backend named in engine.toml (onnxruntime | tensorrt | echo)
    backend: str | None = None
    #: override engine.toml's max_batch
    max_batch: int | None = None
    #: an embedding model's step: about this long (ms), its inputs sized by the measured
    #: time per token (workers/embedcore.py); 0 = as many as the engine's limits allow
    embed_step_ms: float = Field(50.0, ge=0, le=60_000)
    #: admission weights per lane; with both lanes backlogged each gets at least its share
    lane_weights: dict[str, float] = {"high": 0.8, "normal": 0.2}
    #: ms an idle worker blocks on XREADGROUP
    block_ms: int = 1000
    #: how often a worker writes its heartbeat (sf:workers:{model})
    heartbeat_interval_s: float = 0.5
    #: a worker whose heartbeat has not changed for this long, as seen by a live worker
    #: that kept reading it throughout, is dead: its deliveries are taken over at once (a
    #: worker just started counts from the time the heartbeat was written: workers/reclaim.py)
    worker_dead_after_s: float = 1.5
    #: the worker's GET /healthz (metrics port) answers 503 when sequences are in flight
    #: and no step has finished for this long, or its event loop has not run for this long
    worker_stall_s: float = 60.0
    #: worker consumer name (default: host-pid-random)
    worker_id: str | None = None
    #: intra-op threads for ONNX Runtime (0 = runtime default)
    threads: int = 0
    #: publish step N and read new tasks while step N+1 computes (default: on, except for
    #: onnxruntime, whose CPU compute competes with that I/O for the same cores)
    overlap_io: bool | None = None
    #: TensorRT: build a plan when none matches this GPU / graph (else refuse to start)
    trt_build_if_missing: bool = True
    #: TensorRT: CUDA binding (auto | cuda-python | pycuda)
    trt_cuda: str = "auto"
    #: echo engine: per-step delay
    echo_delay_ms: float = 0.0
    #: fallback: a delivery idle this long (its holder stopped refreshing it, whatever its
    #: heartbeat says) is reclaimed by another worker
    claim_idle_ms: int = 10_000
    #: how often a worker refreshes its own deliveries and looks for dead workers' ones
    reclaim_interval_s: float = 0.25
    #: a request whose events reach no subscriber for this long is stopped (its gateway died;
    #: a gateway re-subscribing after a dropped pub/sub socket is back well within it)
    orphan_grace_s: float = 1.0
    #: deliveries after which a task goes to the dead-letter stream
    max_deliveries: int = 3
    #: the dead-letter stream keeps about this many newest entries
    dead_maxlen: int = 10_000
    #: SIGTERM: finish in-flight work for this long, then hand the rest back
    drain_timeout_s: float = 30.0
    #: memory for the KV blocks of earlier prompts, reused by later ones that start the
    #: same way (docs/scheduling.md, "Prefix cache"); 0 = no prefix cache
    prefix_cache_mb: float = Field(512.0, ge=0)
    #: most tokens one step puts through the engine: the running sequences' decodes
    #: first, then chunks of the prompts being prefilled (docs/scheduling.md, "Chunked
    #: prefill"); 0 = no limit (a prompt is prefilled in one step)
    max_step_tokens: int = Field(256, ge=0)
    #: the time one step should take, in ms: the prompts being prefilled get what the
    #: running sequences' decodes leave of it, by the costs the worker learns from its own
    #: steps (docs/scheduling.md, "Chunked prefill"); ``max_step_tokens`` stays the
    #: ceiling. It bounds how long a running stream waits for its next token while a long
    #: prompt goes in. 0 = no time budget (the token ceiling alone)
    step_target_ms: float = Field(100.0, ge=0)
    #: ms a request sent to one worker for its cached prefix (prefix-aware routing) waits
    #: there before any idle worker of the model may take it
    affinity_wait_ms: int = Field(250, ge=0)
    #: Prometheus metrics port (0 = none)
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"
