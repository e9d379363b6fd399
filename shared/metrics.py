"""Prometheus metrics of every process kind, defined in one place so names and labels
stay consistent (they are listed in docs/operations.md). Gateways and workers serve them on
``/metrics`` of a port of their own (``SF_METRICS_PORT``; the gateway's is
``gateway/scrape.py``), never on the gateway's API port.

Naming follows Prometheus conventions: ``streamfleet_`` prefix, base units (seconds),
``_total`` for counters.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

__all__ = ["gateway", "worker", "LATENCY_BUCKETS"]

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class gateway:
    requests = Counter("streamfleet_requests_total", "Requests that ended, by outcome (stop, length, cancelled, "
                       "error) and error code", ["model", "lane", "transport", "outcome", "code"])
    refusals = Counter("streamfleet_refusals_total", "Requests refused before enqueueing, by code "
                       "(rate_limited, overloaded, too_many_requests, unauthorized, forbidden, ...)",
                       ["transport", "code"])
    queue_time = Histogram("streamfleet_queue_time_seconds", "Time from enqueue to a worker admitting the task",
                           ["model", "lane"], buckets=LATENCY_BUCKETS)
    # per tier, never per key (fair share, docs/admission.md): "none" with auth off
    tier_tokens = Counter("streamfleet_tier_tokens_total", "Tokens served to the requests of a tier's keys",
                          ["tier", "kind"])
    tier_queue_time = Histogram("streamfleet_tier_queue_time_seconds", "Time from enqueue to a worker admitting "
                                "the task, per tier", ["tier"], buckets=LATENCY_BUCKETS)
    ttft = Histogram("streamfleet_time_to_first_token_seconds", "Time from enqueue to the first token "
                     "reaching the gateway", ["model", "lane", "transport"], buckets=LATENCY_BUCKETS)
    itl = Histogram("streamfleet_inter_token_latency_seconds", "Time between consecutive tokens of a stream, "
                    "as the gateway delivers them", ["model", "transport"], buckets=ITL_BUCKETS)
    tokens = Counter("streamfleet_tokens_streamed_total", "Completion tokens delivered to clients",
                     ["model", "transport"])
    connections = Gauge("streamfleet_active_connections", "Open WebSocket connections")
    streams = Gauge("streamfleet_active_streams", "Requests being streamed to clients", ["transport"])
    lane_depth = Gauge("streamfleet_lane_depth", "Tasks queued (waiting for their tenant's turn or read) or in "
                       "flight in a lane", ["model", "lane"])
    lane_inflight = Gauge("streamfleet_lane_in_flight", "Tasks delivered to a worker and not yet acked (XPENDING)",
                          ["model", "lane"])
    lane_lag = Gauge("streamfleet_lane_lag", "Tasks not yet read by any worker (XINFO GROUPS lag)",
                     ["model", "lane"])
    live_workers = Gauge("streamfleet_live_workers", "Workers with a fresh heartbeat", ["model"])
    prefix_routes = Counter("streamfleet_prefix_routes_total", "Text requests looked up for prefix-aware routing, "
                            "by outcome: routed (to the worker holding the longest run of their prompt's "
                            "blocks) or shared (no candidate held the first one)", ["model", "outcome"])
    dead_letters = Gauge("streamfleet_dead_letters", "Entries in the dead-letter stream", ["model"])
    duplicates = Counter("streamfleet_duplicate_tokens_dropped_total", "Token events dropped because their "
                         "index was already delivered (redelivered tasks)")
    gaps = Counter("streamfleet_token_gaps_total", "Index gaps seen in pub/sub, by how they ended "
                   "(repaired from the log, or skipped)", ["result"])
    redis_errors = Counter("streamfleet_redis_errors_total", "Redis errors seen by the gateway", ["operation"])


class worker:
    admissions = Counter("streamfleet_worker_admissions_total", "Tasks admitted into the batch, by lane",
                         ["model", "lane"])
    tokens = Counter("streamfleet_worker_tokens_generated_total", "Completion tokens generated", ["model"])
    audio = Counter("streamfleet_worker_audio_seconds_total", "Seconds of utterance audio decoded (speech "
                    "models)", ["model"])
    shared_prefills = Counter("streamfleet_worker_shared_prefills_total", "Sequences started from the cache of "
                              "another with the same prompt instead of a prefill of their own (n > 1)", ["model"])
    prompt_tokens = Counter("streamfleet_worker_prompt_tokens_total", "Prompt tokens of the sequences started, "
                            "by where their cache came from: computed (prefilled) or cached (the prefix cache "
                            "had them)", ["model", "source"])
    prefix_lookups = Counter("streamfleet_worker_prefix_cache_lookups_total", "Prompts looked up in the prefix "
                             "cache, by result: hit (at least one block reused) or miss", ["model", "result"])
    prefix_evicted = Counter("streamfleet_worker_prefix_cache_evicted_blocks_total", "Prefix cache blocks dropped "
                             "to stay within SF_PREFIX_CACHE_MB", ["model"])
    prefix_bytes = Gauge("streamfleet_worker_prefix_cache_bytes", "Bytes of KV blocks the prefix cache holds",
                         ["model"])
    prefix_blocks = Gauge("streamfleet_worker_prefix_cache_blocks", "KV blocks the prefix cache holds", ["model"])
    prefix_reply_tokens = Counter("streamfleet_worker_prefix_cache_reply_tokens_total", "Tokens of finished "
                                  "replies (and the prompt tails before them) prefilled into the prefix cache while "
                                  "the worker was idle, for their conversations' next turns", ["model"])
    grammar_mask = Histogram("streamfleet_worker_grammar_mask_seconds", "Time one step spent computing and "
                             "applying the token masks of its constrained sequences (structured outputs)", ["model"],
                             buckets=(0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0))
    finished = Counter("streamfleet_worker_requests_finished_total", "Requests that ended on this worker",
                       ["model", "outcome"])
    batch_size = Histogram("streamfleet_worker_batch_size", "Sequences in one engine step", ["model"],
                           buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
    step_time = Histogram("streamfleet_worker_step_seconds", "Wall time of one continuous-batching step",
                          ["model"], buckets=LATENCY_BUCKETS)
    slots_in_use = Gauge("streamfleet_worker_slots_in_use", "Sequences in the batch", ["model"])
    slots = Gauge("streamfleet_worker_slots", "Batch capacity (max_batch)", ["model"])
    reclaimed = Counter("streamfleet_worker_reclaimed_tasks_total", "Tasks taken over from silent workers",
                        ["model"])
    affinity_taken = Counter("streamfleet_worker_affinity_taken_total", "Tasks routed to another worker for its "
                             "cached prefix that this one took after they waited SF_AFFINITY_WAIT_MS", ["model"])
    dead_letters = Counter("streamfleet_worker_dead_letters_total", "Tasks moved to the dead-letter stream",
                           ["model"])
    cancelled_no_listener = Counter("streamfleet_worker_no_listener_cancels_total", "Sequences stopped because "
                                    "their events reached no subscriber", ["model"])
    redis_errors = Counter("streamfleet_worker_redis_errors_total", "Redis errors seen by the worker",
                           ["operation"])
