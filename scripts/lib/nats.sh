# Sourced by scripts/test, scripts/demo and scripts/soak: makes sure NATS_URL points at a NATS
# server with JetStream.
#
#   1. NATS_URL, when set, wins.
#   2. Otherwise a private `nats-server -js` on a free port, its store in a folder of its own
#      under target/, installing Debian's `nats-server` first when it is missing and we are
#      root. It is stopped and its folder removed when the calling script exits.
#
# The tests use streams of their own (unique names) and delete them, so a shared server is
# fine as NATS_URL; the private one only keeps a clean clone free of any setup.

. scripts/lib/port.sh

nats_log() { printf '[nats] %s\n' "$*" >&2; }

# Sets NATS_BIN, installing Debian's package when it is missing and we are root.
nats_ensure_bin() {
    NATS_BIN=$(command -v nats-server 2>/dev/null || true)
    [ -n "$NATS_BIN" ] && return 0
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        nats_log "installing Debian's nats-server package"
        DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nats-server >/dev/null
        NATS_BIN=$(command -v nats-server 2>/dev/null || true)
        [ -n "$NATS_BIN" ] && return 0
    fi
    nats_log "no nats-server found (apt-get install nats-server)"
    return 1
}

# Adds "$1" to the EXIT trap without replacing what is there (pg.sh sets one too).
nats_on_exit() {
    local prev
    prev=$(trap -p EXIT | sed -E "s/^trap -- '(.*)' EXIT$/\1/")
    trap "${prev:+$prev; }$1" EXIT
}

# Starts a server on port $2 with its store in $1 (kept across restarts of the same folder);
# its pid goes to $1/pid. Waits until it takes connections.
nats_server_start() {
    local dir=$1 port=$2 i
    # In a subshell, so that it is no job of the calling shell (which would report its kill).
    ("$NATS_BIN" -js -a 127.0.0.1 -p "$port" -sd "$dir/store" >>"$dir/server.log" 2>&1 &
        echo $! >"$dir/pid")
    for i in $(seq 1 200); do
        (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && return 0
        kill -0 "$(cat "$dir/pid")" 2>/dev/null || break
        sleep 0.05
    done
    nats_log "nats-server did not start on port $port:"
    tail -n 20 "$dir/server.log" >&2
    return 1
}

# Stops the server whose folder is $1: `TERM` (clean) or `KILL`.
nats_server_stop() {
    local pid
    pid=$(cat "$1/pid" 2>/dev/null) || return 0
    kill "-${2:-TERM}" "$pid" 2>/dev/null || true
    for _ in $(seq 1 100); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.05
    done
    rm -f "$1/pid"
}

nats_stop_private() {
    if [ -n "${NATS_PRIVATE_DIR:-}" ] && [ -d "$NATS_PRIVATE_DIR" ]; then
        nats_log "stopping the private nats-server"
        nats_server_stop "$NATS_PRIVATE_DIR" TERM
        rm -rf "$NATS_PRIVATE_DIR"
    fi
}

nats_start_private() {
    nats_ensure_bin || return 1
    local tries port
    mkdir -p target
    # Folders of killed earlier runs: over an hour old, with no server running.
    for dir in $(find target -maxdepth 1 -type d -name 'nats-private.*' -mmin +60 2>/dev/null); do
        if [ ! -f "$dir/pid" ] || ! kill -0 "$(cat "$dir/pid")" 2>/dev/null; then
            rm -rf "$dir"
        fi
    done
    NATS_PRIVATE_DIR=$(mktemp -d "$(pwd)/target/nats-private.XXXXXX")
    nats_on_exit nats_stop_private
    for tries in 1 2 3 4 5; do
        port=$(free_port 54222 54422) || { nats_log "no free port"; return 1; }
        nats_log "starting a private nats-server -js on port $port (store in $NATS_PRIVATE_DIR)"
        if nats_server_start "$NATS_PRIVATE_DIR" "$port"; then
            NATS_PORT=$port
            NATS_URL="nats://127.0.0.1:$port"
            return 0
        fi
        grep -q "address already in use" "$NATS_PRIVATE_DIR/server.log" 2>/dev/null || return 1
        : >"$NATS_PRIVATE_DIR/server.log"
    done
    return 1
}

nats_ensure() {
    if [ -n "${NATS_URL:-}" ]; then
        nats_log "using NATS_URL"
        # The tests that restart NATS run servers of their own from this binary.
        nats_ensure_bin || nats_log "the tests that restart NATS will fail without nats-server"
    else
        nats_start_private || return 1
    fi
    export NATS_URL
    if [ -n "${NATS_BIN:-}" ]; then
        export NATS_SERVER_BIN=$NATS_BIN
    fi
}
