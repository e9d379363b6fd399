"""gRPC channels for tests: each with its own subchannels.

grpc-core shares subchannels between channels to the same address through a process-wide
pool. Tests start and kill gateways whose free ports the next test may be handed again, so
a channel of one test could pick up a subchannel another test left backing off from a dead
gateway (or closed idle by one): with a local pool, a test's channel connects afresh.
"""

from __future__ import annotations

import grpc

#: a channel's own subchannels, never the process-wide pool's
LOCAL_POOL = ("grpc.use_local_subchannel_pool", 1)


def aio_channel(target: str, *options: tuple[str, object]) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(target, options=[LOCAL_POOL, *options])


def sync_channel(target: str, *options: tuple[str, object]) -> grpc.Channel:
    return grpc.insecure_channel(target, options=[LOCAL_POOL, *options])
