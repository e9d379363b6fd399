"""Fair share inside a lane: the next task a worker takes belongs to the backlogged tenant
that has received the least weighted service (docs/scheduling.md, "Fair share").

This is the Virtual Token Counter of Sheng et al., "Fairness in Serving Large Language
Models" (OSDI 2024), kept in Redis so that every gateway and worker of the fleet agree:

* A tenant is an API key (``key:<key id>``); with auth off, a WebSocket or gRPC
  connection, or an HTTP client's address. Its counter grows by the weighted tokens it is
  served: a request's prompt tokens times ``PROMPT_WEIGHT`` when a worker takes it, its
  generated tokens times ``GENERATED_WEIGHT`` when it ends, each divided by the share of
  the key's tier (``Tier.share``), at least ``MIN_COST`` a request. An embeddings
  request is charged its input tokens as a prompt; an utterance ``MIN_COST`` when it is
  taken and its audio when it ends (``shared.tiers.AUDIO_TOKENS_PER_S`` tokens a second,
  times ``PROMPT_WEIGHT``).
* A task does not join the lane's stream at once: it waits in its tenant's queue (a FIFO
  per tenant kept in two hashes, ``<base>:tasks`` and ``<base>:ends``), and the tenant,
  while it has tasks waiting, in a sorted set scored by its counter (``<base>``). Tasks
  move into the stream in fair order, the lowest counter first (``release``), whenever
  the stream holds fewer unread entries than a worker is about to read, plus ``window``
  (default 1) left unread so that an idle worker's blocking read wakes. So a lone tenant
  gets the whole fleet (work-conserving), and at most ``window`` entries of a lane are
  ever taken out of fair order.
* A tenant that starts waiting is lifted to the lowest counter among those waiting (or to
  the lane's virtual time when none is: the counter of the last task released), so
  nobody banks credit while idle. Counters of tenants that are not waiting are kept in
  ``<base>:seen`` only while above that virtual time (``<base>:vt``), so the state is
  bounded by the tenants recently served; both expire after ``ttl_s`` without traffic.
  ``<base>:queued`` is a list of one element per task waiting: its ``LLEN`` is what
  ``XLEN`` of the stream no longer counts (``redis-cli``, KEDA's ``redis`` list scaler).

Everything runs in Lua scripts (one round trip, atomic) on declared keys, the keys of one
model sharing a hash tag, so a Redis Cluster runs them on the lanes' shard.
"""

from __future__ import annotations

from collections.abc import Sequence

from streamfleet.shared.keys import GROUP, Keys

__all__ = ["PROMPT_WEIGHT", "GENERATED_WEIGHT", "MIN_COST", "FAIR_LIB", "ENQUEUE_LUA", "FAIR_READ_LUA",
           "prompt_cost", "token_cost", "audio_cost", "enqueue_call", "read_call"]

#: weighted cost of one prompt token (prefill: read in parallel, cheap per token)
PROMPT_WEIGHT = 1.0
#: weighted cost of one generated token (one decode step each; the paper's choice of 2)
GENERATED_WEIGHT = 2.0
#: the least a request costs, so that requests with no tokens counted at admission
#: (speech, whose audio is still arriving) still take turns
MIN_COST = 1.0


def prompt_cost(tokens: int, share: float) -> float:
    """What taking a request of ``tokens`` prompt (or input) tokens adds to its tenant's
    counter, for a tier of ``share``."""
    return max(MIN_COST, tokens * PROMPT_WEIGHT) / share


def token_cost(share: float) -> float:
    """What one generated token adds to its tenant's counter, for a tier of ``share``."""
    return GENERATED_WEIGHT / share


def audio_cost(share: float) -> float:
    """What one token of transcribed audio (``shared.tiers.AUDIO_TOKENS_PER_S`` a second)
    adds to its tenant's counter, for a tier of ``share``: audio is input, like a prompt."""
    return PROMPT_WEIGHT / share


#: The functions the scripts share. A lane's keys are declared, eight in a row from
#: KEYS[o + 1] (``FairKeys.script_keys`` after the lane's stream): its stream (L), the
#: tenants waiting, sorted by counter (F), the counters of tenants served but not waiting
#: (S), one element per task waiting (Q), the lane's virtual time (V), the waiting tasks
#: (T: a hash, field ``<tenant> <n>``, value ``<cost> <tokens> <task JSON>``), each
#: waiting tenant's first and last n (E: a hash, ``<first> <last>``) and its waiting
#: prompt tokens (C: a hash): a FIFO per tenant in hashes, so no script names a key of
#: its own making (Redis Cluster).
FAIR_LIB = """
local function unread(o, group)
  local n = redis.call('XLEN', KEYS[o + 1])
  if n == 0 then return 0 end
  local p = redis.pcall('XPENDING', KEYS[o + 1], group)
  if type(p) == 'table' and p.err == nil and p[1] then return n - tonumber(p[1]) end
  return n
end

local function vtime(o)
  return tonumber(redis.call('GET', KEYS[o + 5]) or '0')
end

local function advance(o, c, ttl)
  if c >= vtime(o) then
    redis.call('SET', KEYS[o + 5], tostring(c), 'EX', ttl)
    redis.call('ZREMRANGEBYSCORE', KEYS[o + 3], '-inf', '(' .. tostring(c))
  else
    redis.call('EXPIRE', KEYS[o + 5], ttl)
  end
end

local function ends(o, tenant)
  local e = redis.call('HGET', KEYS[o + 7], tenant)
  if not e then return nil, nil end
  local sp = string.find(e, ' ', 1, true)
  return tonumber(string.sub(e, 1, sp - 1)), tonumber(string.sub(e, sp + 1))
end

local function stage(o, tenant, tokens, item)
  if not redis.call('ZSCORE', KEYS[o + 2], tenant) then
    local c = vtime(o)
    local seen = redis.call('ZSCORE', KEYS[o + 3], tenant)
    if seen and tonumber(seen) > c then c = tonumber(seen) end
    local low = redis.call('ZRANGE', KEYS[o + 2], 0, 0, 'WITHSCORES')
    if #low > 0 and tonumber(low[2]) > c then c = tonumber(low[2]) end
    redis.call('ZADD', KEYS[o + 2], c, tenant)
    redis.call('ZREM', KEYS[o + 3], tenant)
  end
  local first, last = ends(o, tenant)
  if first then last = last + 1 else first, last = 1, 1 end
  redis.call('HSET', KEYS[o + 6], tenant .. ' ' .. last, item)
  redis.call('HSET', KEYS[o + 7], tenant, first .. ' ' .. last)
  redis.call('HINCRBY', KEYS[o + 8], tenant, tokens)
  redis.call('RPUSH', KEYS[o + 4], '1')
end

-- move waiting tasks into the stream, lowest counter first, until it holds want unread
-- entries; returns the last entry id added (false when none)
local function release(o, group, want, ttl)
  local last_id = false
  local have = unread(o, group)
  while have < want do
    local top = redis.call('ZRANGE', KEYS[o + 2], 0, 0, 'WITHSCORES')
    if #top == 0 then break end
    local tenant, c = top[1], tonumber(top[2])
    local first, last = ends(o, tenant)
    local item = first and redis.call('HGET', KEYS[o + 6], tenant .. ' ' .. first)
    if not item then
      redis.call('ZREM', KEYS[o + 2], tenant)
      redis.call('HDEL', KEYS[o + 7], tenant)
      redis.call('HDEL', KEYS[o + 8], tenant)
    else
      redis.call('HDEL', KEYS[o + 6], tenant .. ' ' .. first)
      local sp = string.find(item, ' ', 1, true)
      local sp2 = string.find(item, ' ', sp + 1, true)
      local cost = tonumber(string.sub(item, 1, sp - 1))
      last_id = redis.call('XADD', KEYS[o + 1], '*', 'task', string.sub(item, sp2 + 1))
      have = have + 1
      redis.call('LPOP', KEYS[o + 4])
      advance(o, c, ttl)
      c = c + cost
      if first < last then
        redis.call('HSET', KEYS[o + 7], tenant, (first + 1) .. ' ' .. last)
        redis.call('HINCRBY', KEYS[o + 8], tenant, -tonumber(string.sub(item, sp + 1, sp2 - 1)))
        redis.call('ZADD', KEYS[o + 2], c, tenant)
      else
        redis.call('HDEL', KEYS[o + 7], tenant)
        redis.call('HDEL', KEYS[o + 8], tenant)
        redis.call('ZREM', KEYS[o + 2], tenant)
        redis.call('ZADD', KEYS[o + 3], c, tenant)
        redis.call('EXPIRE', KEYS[o + 3], ttl)
      end
    end
  end
  return last_id
end

-- a task that went into a stream without waiting (routed to a worker's affinity stream)
local function charge(o, tenant, cost, ttl)
  local c = vtime(o)
  local seen = redis.call('ZSCORE', KEYS[o + 3], tenant)
  if seen and tonumber(seen) > c then c = tonumber(seen) end
  advance(o, c, ttl)
  redis.call('ZADD', KEYS[o + 3], c + cost, tenant)
  redis.call('EXPIRE', KEYS[o + 3], ttl)
end
"""

#: A gateway's enqueue (``gateway.requests.broker.Broker.submit``): one round trip,
#: atomic, so all gateways together never push a lane past its refusal threshold. Unless
#: the lane's backlog (its stream, the tasks waiting, its affinity streams: XLEN counts
#: queued + in flight, since workers XDEL what they ack) has reached the threshold, a task
#: of a tenant (fair share on) waits in its tenant's queue and tasks move into the stream
#: in fair order up to ``window`` unread; a task of no tenant (fair share off) joins its
#: stream at once. A task routed to a worker's affinity stream (prefix-aware routing,
#: docs/architecture.md) goes there directly while no tenant waits in the lane and that
#: stream holds fewer than ``routed_window`` unread tasks (a burst of one tenant's
#: requests on one prefix keeps its locality; a flood does not go around the fair share:
#: its worker reads its affinity stream first); otherwise it waits its turn in the shared
#: lane like the rest. An affinity stream is made (with its group) when new, and joins
#: the model's set of them.
#: KEYS[1] the stream the task is routed to (the lane, or an affinity stream), KEYS[2] the
#: wake channel (declared: on a cluster it is published with SPUBLISH and shares the
#: lane's slot), KEYS[3] the model's set of affinity streams, KEYS[4..11] the lane's keys
#: (``FAIR_LIB``, o = 3), the keys after those: the lane's other streams, counted in its
#: backlog. ARGV[1] threshold (0 = none), ARGV[2] task JSON, ARGV[3] the wake's source
#: (the lane's name, or ``<lane>@<worker id>``), ARGV[4] PUBLISH or SPUBLISH, ARGV[5] the
#: consumer group, ARGV[6] tenant ("": none), ARGV[7] its cost, ARGV[8] window, ARGV[9]
#: ttl (s), ARGV[10] the lane's name, ARGV[11] the task's prompt tokens, ARGV[12] the most
#: prompt tokens the tenant may have waiting in the lane (0 = no cap; a task is taken
#: whatever its size while none of the tenant's wait), ARGV[13] ``routed_window``.
#: Publishes a ``shared.schema.Wake`` (``"<source> <entry id>"``) for a task that joined
#: a stream. Returns {1, depth after add}, {0, depth} (the lane is full) or {2, the
#: tokens the tenant has waiting} (its cap).
ENQUEUE_LUA = FAIR_LIB + """
local group, window, ttl = ARGV[5], tonumber(ARGV[8]), tonumber(ARGV[9])
local routed = KEYS[1] ~= KEYS[4]
local depth = redis.call('XLEN', KEYS[4]) + redis.call('LLEN', KEYS[7])
if routed then depth = depth + redis.call('XLEN', KEYS[1]) end
for i = 12, #KEYS do
  depth = depth + redis.call('XLEN', KEYS[i])
end
local limit = tonumber(ARGV[1])
if limit > 0 and depth >= limit then
  return {0, depth}
end
local fair = ARGV[6] ~= ''
local cap = tonumber(ARGV[12])
if fair and cap > 0 then
  local waiting = tonumber(redis.call('HGET', KEYS[11], ARGV[6]) or '0')
  if waiting > 0 and waiting + tonumber(ARGV[11]) > cap then
    return {2, waiting}
  end
end
if not fair or (routed and redis.call('ZCARD', KEYS[5]) == 0 and unread(0, group) < tonumber(ARGV[13])) then
  if routed then
    if redis.call('EXISTS', KEYS[1]) == 0 then
      redis.call('XGROUP', 'CREATE', KEYS[1], group, '0', 'MKSTREAM')
    end
    redis.call('SADD', KEYS[3], KEYS[1])
  end
  local id = redis.call('XADD', KEYS[1], '*', 'task', ARGV[2])
  if fair then
    charge(3, ARGV[6], tonumber(ARGV[7]), ttl)
  end
  redis.call(ARGV[4], KEYS[2], ARGV[3] .. ' ' .. id)
  return {1, depth + 1}
end
stage(3, ARGV[6], tonumber(ARGV[11]), ARGV[7] .. ' ' .. ARGV[11] .. ' ' .. ARGV[2])
local id = release(3, group, window, ttl)
if id then
  redis.call(ARGV[4], KEYS[2], ARGV[10] .. ' ' .. id)
end
return {1, depth + 1}
"""

#: A worker's read of one lane (``workers.intake.Intake``): tasks move into the stream
#: in fair order until it holds ``n + window`` unread entries, then the worker reads ``n``
#: (``n`` = 0: only the top-up, after an idle worker's blocking read took the window's).
#: KEYS[1..8] the lane's keys (``FAIR_LIB``, o = 0); ARGV[1] group, ARGV[2] consumer,
#: ARGV[3] n, ARGV[4] window, ARGV[5] ttl (s). Returns what XREADGROUP does.
FAIR_READ_LUA = FAIR_LIB + """
local n = tonumber(ARGV[3])
if redis.call('ZCARD', KEYS[2]) > 0 then
  release(0, ARGV[1], n + tonumber(ARGV[4]), tonumber(ARGV[5]))
end
if n == 0 then
  return false
end
return redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', n, 'STREAMS', KEYS[1], '>')
"""


def enqueue_call(keys: Keys, model: str, lane: str, target: str, counted: Sequence[str], *, threshold: int,
                 task: bytes, source: str, tenant: str, cost: float, window: int, ttl_s: int, tokens: int = 0,
                 max_queued_tokens: int | None = None, routed_window: int = 4,
                 ) -> tuple[tuple[str, ...], tuple[bytes | str | int, ...]]:
    """``ENQUEUE_LUA``'s keys and arguments: a task of ``tenant`` costing ``cost``
    (of ``tokens`` prompt tokens, the tenant allowed ``max_queued_tokens`` waiting, None
    for no cap) for ``lane`` of ``model``, routed to ``target`` (the lane's stream, or an
    affinity stream named ``source``), the lane's other streams ``counted`` in its backlog."""
    shared_lane = keys.lane(model, lane)
    script_keys = (target, keys.wake(model), keys.affinity_streams(model), shared_lane,
                   *keys.fair(model, lane).script_keys, *(k for k in counted if k not in (shared_lane, target)))
    args = (threshold, task, source, keys.publish, GROUP, tenant, repr(float(cost)), window, ttl_s, lane, tokens,
            max_queued_tokens or 0, routed_window)
    return script_keys, args


def read_call(keys: Keys, model: str, lane: str, consumer: str, n: int, *, window: int, ttl_s: int,
              ) -> tuple[tuple[str, ...], tuple[bytes | str | int, ...]]:
    """``FAIR_READ_LUA``'s keys and arguments: ``consumer`` reads ``n`` of ``lane``."""
    return (keys.lane(model, lane), *keys.fair(model, lane).script_keys), (GROUP, consumer, n, window, ttl_s)
