#!/usr/bin/env bash
# kvturn on several "hosts" on one Linux machine: each engine and the gateway in a network
# namespace of its own, with its own address on a bridge, talking over TCP only.
#
#   deploy/several_hosts.sh up DIR      # 1 prefill + 2 decode engines and a gateway; waits
#   deploy/several_hosts.sh cut NAME    # unplug a host (p, d1, d2 or gw): its link goes down
#   deploy/several_hosts.sh mend NAME   # plug it back in
#   deploy/several_hosts.sh down DIR    # stop everything `up` started, remove the namespaces
#
# Needs root (ip netns) and kvturn's set-up (.venv). Each host does what a real one would:
# `kvturn engine` binds to and advertises the host's own address (the API, NIXL's side channel,
# the decode's lease control server), and the gateway finds the engines through a deployment
# file that lists each engine once (decode control servers by convention: port 8300 of the
# engine's host). NIXL moves KV over UCX's TCP transport only (UCX_TLS=tcp), and each host has
# its own System V IPC and /dev/shm besides its own network: no shared-memory shortcut between
# "hosts" that happen to share a kernel.
#
#   bridge kvh-br 10.231.0.1 (this shell: clients, tests)
#     kvh-gw  10.231.0.10   kvturn serve      :8000
#     kvh-p   10.231.0.11   prefill engine    :8000  side channel :5600
#     kvh-d1  10.231.0.12   decode engine     :8000  side channel :5600  control :8300
#     kvh-d2  10.231.0.13   decode engine     :8000  side channel :5600  control :8300
#
# Settings (environment): KVTURN_HOSTS_TAG (name prefix, default kvh), KVTURN_HOSTS_NET (the
# /24, default 10.231.0), KVTURN_HOSTS_MODEL (default tiny), KVTURN_HOSTS_ENGINE_FLAGS (more
# `kvturn engine` flags), PYTHON (default .venv/bin/python). Any KVTURN_* gateway setting in
# the environment reaches the gateway.
set -Eeuo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
TAG="${KVTURN_HOSTS_TAG:-kvh}"
NET="${KVTURN_HOSTS_NET:-10.231.0}"
MODEL="${KVTURN_HOSTS_MODEL:-tiny}"
HOSTS=(gw p d1 d2)
declare -A ADDRESS=([gw]="$NET.10" [p]="$NET.11" [d1]="$NET.12" [d2]="$NET.13")

say() { echo "several_hosts: $*" >&2; }

# One host: a namespace, a veth pair (one end on the bridge, the other its eth0), an address.
add_host() {
    local name=$1 ns="$TAG-$1"
    ip netns add "$ns"
    ip link add "$ns" type veth peer name eth0 netns "$ns"
    ip link set "$ns" master "$TAG-br" up
    ip netns exec "$ns" ip link set lo up
    ip netns exec "$ns" ip addr add "${ADDRESS[$name]}/24" dev eth0
    ip netns exec "$ns" ip link set eth0 up
}

# Start a command on a host, in a session of its own (so `down` can end its whole process
# group), with the host's own IPC namespace and /dev/shm, its output in DIR/NAME.log and its pid
# in DIR/NAME.pid (every step execs the next: the pid is the command's).
start_on() {
    local dir=$1 name=$2
    shift 2
    ip netns exec "$TAG-$name" unshare --ipc --mount --propagation private \
        sh -c 'mount -t tmpfs -o mode=1777 shm /dev/shm && exec setsid "$@"' host "$@" \
        >"$dir/$name.log" 2>&1 </dev/null &
    echo $! >"$dir/$name.pid"
}

wait_healthy() {
    local dir=$1 name=$2 url=$3 deadline=$((SECONDS + ${4:-900}))
    until curl -sf -o /dev/null -m 2 "$url/health"; do
        if ! kill -0 "$(cat "$dir/$name.pid")" 2>/dev/null; then
            say "$name exited while starting; last lines of $dir/$name.log:"
            tail -n 30 "$dir/$name.log" >&2
            return 1
        fi
        if ((SECONDS > deadline)); then
            say "$name not healthy in time ($url)"
            return 1
        fi
        sleep 2
    done
    say "$name ready at $url"
}

up() {
    local dir=$1
    mkdir -p "$dir"
    dir="$(cd "$dir" && pwd)"
    trap 'say "up failed: stopping what it started"; down "$dir"' ERR
    ip link add "$TAG-br" type bridge
    ip addr add "$NET.1/24" dev "$TAG-br"
    ip link set "$TAG-br" up
    for name in "${HOSTS[@]}"; do add_host "$name"; done

    # Every decode and the gateway share the control channel's secret; callers need an API key
    # (the gateway listens on a routable address).
    local secret key
    secret="$("$PYTHON" -c 'import secrets; print(secrets.token_urlsafe(32))')"
    key="sk-$("$PYTHON" -c 'import secrets; print(secrets.token_urlsafe(24))')"
    (umask 077 && echo "$key hosts-demo" >"$dir/api-keys" && echo "$secret" >"$dir/control-secret")

    local cpus
    cpus=$(nproc)
    local -A role=([p]=prefill [d1]=decode [d2]=decode) core=([p]=0 [d1]=$((1 % cpus)) [d2]=0)
    for name in p d1 d2; do
        # shellcheck disable=SC2086  # the extra flags are words
        start_on "$dir" "$name" env UCX_TLS=tcp KVTURN_CONTROL_SECRET="$secret" \
            "$PYTHON" -m kvturn.gateway.ops.cli engine --role "${role[$name]}" --model "$MODEL" \
            --host "${ADDRESS[$name]}" --port 8000 --side-channel-port 5600 \
            --control-port 8300 --cpu "${core[$name]}" ${KVTURN_HOSTS_ENGINE_FLAGS:-}
    done

    cat >"$dir/deploy.toml" <<EOF
host = "${ADDRESS[gw]}"
port = 8000

[gateway]
decode_control_port = 8300   # each decode's control server: port 8300 of its own host

[auth]
api_keys_file = "$dir/api-keys"

[[prefill]]
url = "http://${ADDRESS[p]}:8000"

[[decode]]
url = "http://${ADDRESS[d1]}:8000"

[[decode]]
url = "http://${ADDRESS[d2]}:8000"
EOF
    for name in p d1 d2; do wait_healthy "$dir" "$name" "http://${ADDRESS[$name]}:8000"; done
    start_on "$dir" gw env KVTURN_CONTROL_SECRET="$secret" \
        "$PYTHON" -m kvturn.gateway.ops.cli serve --config "$dir/deploy.toml"
    wait_healthy "$dir" gw "http://${ADDRESS[gw]}:8000" 60

    local model_name
    model_name="$(curl -sf -H "Authorization: Bearer $key" "http://${ADDRESS[gw]}:8000/v1/models" |
        "$PYTHON" -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')"
    cat >"$dir/hosts.json" <<EOF
{"gateway": "http://${ADDRESS[gw]}:8000/v1", "api_key": "$key", "model": "$model_name",
 "prefill": ["http://${ADDRESS[p]}:8000"],
 "decode": ["http://${ADDRESS[d1]}:8000", "http://${ADDRESS[d2]}:8000"],
 "decode_control": ["http://${ADDRESS[d1]}:8300", "http://${ADDRESS[d2]}:8300"],
 "hosts": {"gw": "$TAG-gw", "p": "$TAG-p", "d1": "$TAG-d1", "d2": "$TAG-d2"},
 "pids": {"gw": $(cat "$dir/gw.pid"), "p": $(cat "$dir/p.pid"), "d1": $(cat "$dir/d1.pid"),
          "d2": $(cat "$dir/d2.pid")}}
EOF
    say "up: gateway http://${ADDRESS[gw]}:8000/v1, API key in $dir/api-keys; stop with: $0 down $dir"
}

down() {
    local dir=$1 pid
    for name in "${HOSTS[@]}"; do
        [[ -f "$dir/$name.pid" ]] || continue
        pid="$(cat "$dir/$name.pid")"
        kill -TERM -- "-$pid" 2>/dev/null || true
    done
    for name in "${HOSTS[@]}"; do
        [[ -f "$dir/$name.pid" ]] || continue
        pid="$(cat "$dir/$name.pid")"
        for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
        kill -KILL -- "-$pid" 2>/dev/null || true
        rm -f "$dir/$name.pid"
    done
    for name in "${HOSTS[@]}"; do
        ip link del "$TAG-$name" 2>/dev/null || true # the veth pair, both ends
        ip netns del "$TAG-$name" 2>/dev/null || true
    done
    ip link del "$TAG-br" 2>/dev/null || true
    say "down: stopped and removed"
}

case "${1:-}" in
    up) up "${2:?usage: $0 up DIR}" ;;
    down) down "${2:?usage: $0 down DIR}" ;;
    cut) ip link set "$TAG-${2:?usage: $0 cut NAME}" down && say "cut ${2}" ;;
    mend) ip link set "$TAG-${2:?usage: $0 mend NAME}" up && say "mended ${2}" ;;
    *)
        echo "usage: $0 up DIR | down DIR | cut NAME | mend NAME (NAME: gw, p, d1, d2)" >&2
        exit 2
        ;;
esac
