# Sourced by scripts/test and scripts/demo: makes sure DATABASE_URL points at a PostgreSQL
# server the scripts may create databases on.
#
#   1. DATABASE_URL, when set, wins.
#   2. Otherwise a server already listening on 127.0.0.1:5432 (user postgres, trust auth).
#   3. Otherwise a private cluster from the system's PostgreSQL binaries, in target/pg-private
#      on a free port, installing Debian's `postgresql` first when it is missing and we are
#      root. It is stopped and removed when the calling script exits.

pg_log() { printf '[pg] %s\n' "$*" >&2; }

pg_find_bin() {
    local dir
    for dir in /usr/lib/postgresql/*/bin; do
        [ -x "$dir/initdb" ] && { printf '%s\n' "$dir"; return 0; }
    done
    command -v initdb >/dev/null 2>&1 && { dirname "$(command -v initdb)"; return 0; }
    return 1
}

pg_free_port() {
    local port
    for port in $(seq 55433 55633); do
        if ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
            printf '%s\n' "$port"
            return 0
        fi
    done
    return 1
}

pg_stop_private() {
    if [ -n "${PG_PRIVATE_DIR:-}" ] && [ -d "$PG_PRIVATE_DIR/data" ]; then
        pg_log "stopping the private cluster"
        pg_as_owner "$PG_BIN/pg_ctl" -D "$PG_PRIVATE_DIR/data" -m fast -w stop >/dev/null 2>&1 || true
        rm -rf "$PG_PRIVATE_DIR"
    fi
}

# initdb and postgres refuse to run as root: run them as the `postgres` system user then.
pg_as_owner() {
    if [ "$(id -u)" = 0 ]; then
        runuser -u postgres -- "$@"
    else
        "$@"
    fi
}

# Sets PG_BIN to the system's PostgreSQL binaries, installing Debian's package first when they
# are missing and we are root.
pg_ensure_bin() {
    PG_BIN=$(pg_find_bin) || {
        if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
            pg_log "installing Debian's postgresql package"
            DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
            PG_BIN=$(pg_find_bin) || { pg_log "no PostgreSQL binaries after install"; return 1; }
        else
            pg_log "no PostgreSQL binaries found (apt-get install postgresql)"
            return 1
        fi
    }
}

pg_start_private() {
    pg_ensure_bin || return 1
    if [ "$(id -u)" = 0 ] && ! id postgres >/dev/null 2>&1; then
        useradd --system --home-dir /var/lib/postgresql --shell /bin/sh postgres
    fi
    local root port
    root="$(pwd)/target/pg-private"
    port=$(pg_free_port) || { pg_log "no free port"; return 1; }
    rm -rf "$root"
    mkdir -p "$root"
    if [ "$(id -u)" = 0 ]; then
        chown postgres "$root"
        # The server runs as `postgres`, which may not be able to reach a checkout under a
        # private home directory; fall back to a temporary folder then.
        if ! runuser -u postgres -- test -w "$root"; then
            rmdir "$root"
            root=$(mktemp -d /tmp/actix-outbox-pg.XXXXXX)
            chown postgres "$root"
            pg_log "target/ is not reachable by the postgres user; using $root"
        fi
    fi
    PG_PRIVATE_DIR="$root"
    trap pg_stop_private EXIT
    pg_log "starting a private cluster in target/pg-private on port $port"
    pg_as_owner "$PG_BIN/initdb" -D "$root/data" -U postgres --auth=trust -E UTF8 >"$root/initdb.log" 2>&1 \
        || { cat "$root/initdb.log" >&2; return 1; }
    pg_as_owner "$PG_BIN/pg_ctl" -D "$root/data" -l "$root/server.log" -w \
        -o "-p $port -k $root -c listen_addresses=127.0.0.1 -c max_connections=300 -c fsync=off" start >/dev/null \
        || { cat "$root/server.log" >&2; return 1; }
    DATABASE_URL="postgres://postgres@127.0.0.1:$port/postgres"
}

pg_ensure() {
    if [ -n "${DATABASE_URL:-}" ]; then
        pg_log "using DATABASE_URL"
    elif pg_isready -q -h 127.0.0.1 -p 5432 -U postgres 2>/dev/null \
        || (exec 3<>/dev/tcp/127.0.0.1/5432) 2>/dev/null; then
        pg_log "using the server on 127.0.0.1:5432"
        DATABASE_URL="postgres://postgres@127.0.0.1:5432/postgres"
    else
        pg_start_private || return 1
    fi
    export DATABASE_URL
}
