#!/bin/sh
# Start one Redis Cluster node: `redis-cluster-node.sh redis-server ARGS...`.
#
# Two things plain `redis-server` does not do:
#
# * It announces the node's DNS name (REDIS_CLUSTER_ANNOUNCE_HOSTNAME: the compose
#   service name, or the pod's name under the headless Service) with
#   --cluster-announce-hostname; the node's config sets cluster-preferred-endpoint-type
#   hostname, so clients are redirected (MOVED, CLUSTER SHARDS) to names, which stay
#   right when a container or pod comes back with another IP.
# * The cluster bus still uses IP addresses, and nodes.conf remembers every peer's. A
#   container or pod that is recreated gets a new IP; when all of them are (a host
#   reboot, `docker compose down && up`, a node pool replaced), every node still knows
#   only old addresses and none can reach another: CLUSTER INFO may even say ok while
#   every link is down. So before Redis starts, each node's address in nodes.conf (its
#   own too, which Redis does not correct by itself and reports in CLUSTER NODES/SHARDS)
#   is replaced by what the node's hostname (written there by Redis 7 next to the
#   address) resolves to now. A peer that does not resolve within
#   REDIS_CLUSTER_RESOLVE_WAIT_S (not started yet) keeps its old address: it resolves
#   this node when it starts, and Redis takes a known node's new address from its first
#   PING.
#
# One script for both: docker compose (deploy/compose/cluster.yml) mounts this file.
# POSIX sh + awk + getent (or
# busybox nslookup): runs in redis:7.x-alpine as the redis user.
set -eu

NODES_CONF=${REDIS_NODES_CONF:-/data/nodes.conf}
WAIT_S=${REDIS_CLUSTER_RESOLVE_WAIT_S:-20}

# the first IPv4 address of a name (else its first address), nothing if it does not resolve
resolve() {
    if command -v getent >/dev/null 2>&1; then
        getent hosts "$1" 2>/dev/null | awk '
            $1 ~ /^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$/ { print $1; found = 1; exit }
            !any { any = $1 }
            END { if (!found && any) print any }'
    else
        nslookup "$1" 2>/dev/null | awk '
            /^Name:/ { named = 1; next }
            named { for (i = 2; i <= NF; i++) if ($i ~ /^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$/) { print $i; exit } }'
    fi
}

# the hostnames of the nodes that nodes.conf lists
node_hostnames() {
    awk 'split($2, a, ",") >= 2 && a[2] != "" { print a[2] }' "$NODES_CONF" | sort -u
}

if [ -s "$NODES_CONF" ]; then
    deadline=$(( $(date +%s) + WAIT_S ))
    pending=$(node_hostnames)
    map=""
    while [ -n "$pending" ]; do
        left=""
        for host in $pending; do
            ip=$(resolve "$host")
            if [ -n "$ip" ]; then map="$map $host=$ip"; else left="$left $host"; fi
        done
        pending=$left
        [ -z "$pending" ] && break
        if [ "$(date +%s)" -ge "$deadline" ]; then
            echo "redis-cluster-node: not resolved, old addresses kept:$pending" >&2
            break
        fi
        sleep 1
    done
    if [ -n "$map" ]; then
        # field 2 is <ip>:<port>@<cport>,<hostname>[,<aux>=<value>...]: swap the ip only
        awk -v map="$map" '
            BEGIN { n = split(map, kv, " "); for (i = 1; i <= n; i++) { split(kv[i], p, "="); ip[p[1]] = p[2] } }
            split($2, a, ",") >= 2 && (a[2] in ip) && match(a[1], /:[0-9]+@[0-9]+$/) {
                old = substr(a[1], 1, RSTART - 1)
                if (old != ip[a[2]]) {
                    printf "redis-cluster-node: %s %s -> %s\n", a[2], old, ip[a[2]] > "/dev/stderr"
                    $2 = ip[a[2]] substr($2, RSTART)
                }
            }
            { print }' "$NODES_CONF" > "$NODES_CONF.tmp"
        mv "$NODES_CONF.tmp" "$NODES_CONF"
    fi
fi

if [ -n "${REDIS_CLUSTER_ANNOUNCE_HOSTNAME:-}" ]; then
    exec "$@" --cluster-announce-hostname "$REDIS_CLUSTER_ANNOUNCE_HOSTNAME"
fi
exec "$@"
