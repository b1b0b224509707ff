# Sourced by scripts/test and scripts/demo: makes sure DATABASE_URL points at a PostgreSQL
# server the scripts may create databases on.
#
#   1. DATABASE_URL, when set, wins.
#   2. Otherwise a server on 127.0.0.1:5432 that user postgres logs in to without a password,
#      PostgreSQL 13 or later.
#   3. Otherwise a private cluster from the system's newest PostgreSQL binaries (13 or later),
#      in a folder of its own under target/ on a free port, installing Debian's `postgresql`
#      first when it is missing and we are root. It is stopped and removed when the calling
#      script exits.

. scripts/lib/port.sh

pg_log() { printf '[pg] %s\n' "$*" >&2; }

# The newest major version's server binaries (a dist-upgrade leaves the old ones installed; a
# newer client-only package has no initdb), if it is 13 or later: the migrations need
# gen_random_uuid() and DROP DATABASE … WITH (FORCE).
pg_find_bin() {
    local dir="" candidate major
    for candidate in $(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -Vr); do
        [ -x "$candidate/initdb" ] && { dir=$candidate; break; }
    done
    if [ -z "$dir" ]; then
        command -v initdb >/dev/null 2>&1 || return 1
        dir=$(dirname "$(command -v initdb)")
    fi
    # "initdb (PostgreSQL) 15.20 (Debian 15.20-0+deb12u1)" → 15
    major=$("$dir/initdb" --version | sed -E 's/^[^0-9]*([0-9]+).*/\1/')
    case "$major" in '' | *[!0-9]*) pg_log "cannot tell the version of $dir/initdb"; return 1 ;; esac
    if [ "$major" -lt 13 ]; then
        pg_log "PostgreSQL $major in $dir is too old (13 or later is needed)"
        return 1
    fi
    printf '%s\n' "$dir"
}

pg_stop_private() {
    if [ -n "${PG_PRIVATE_DIR:-}" ] && [ -d "$PG_PRIVATE_DIR/data" ]; then
        pg_log "stopping the private cluster"
        pg_cluster_stop "$PG_PRIVATE_DIR" fast 2>/dev/null || true
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

# Prints a new folder the server's user can write, named $2.XXXXXX: in $1 if it can reach it,
# else in /tmp (the server runs as `postgres`, which may not reach a checkout under a private
# home directory). A folder of its own per run: two runs in one checkout share no cluster.
pg_owned_dir() {
    local dir
    if [ "$(id -u)" = 0 ] && ! id postgres >/dev/null 2>&1; then
        useradd --system --home-dir /var/lib/postgresql --shell /bin/sh postgres
    fi
    mkdir -p "$1"
    # Folders of earlier runs that were killed before they could remove theirs: over an hour
    # old (a run starting now may not have started its server yet), with no server running.
    for dir in $(find "$1" -maxdepth 1 -type d -name "$2.*" -mmin +60 2>/dev/null); do
        if [ ! -f "$dir/data/postmaster.pid" ] || ! kill -0 "$(head -n 1 "$dir/data/postmaster.pid")" 2>/dev/null; then
            rm -rf "$dir"
        fi
    done
    dir=$(mktemp -d "$1/$2.XXXXXX")
    if [ "$(id -u)" = 0 ]; then
        chown postgres "$dir"
        if ! runuser -u postgres -- test -w "$dir"; then
            rmdir "$dir"
            dir=$(mktemp -d "/tmp/$2.XXXXXX")
            chown postgres "$dir"
            pg_log "the postgres user cannot reach $1; using $dir"
        fi
    fi
    printf '%s\n' "$dir"
}

# Starts the cluster in $1/data on port $2 (running initdb first when there is none), with the
# extra server settings $3. Needs PG_BIN (pg_ensure_bin).
pg_cluster_start() {
    local dir=$1 port=$2 settings=${3:-}
    if [ ! -d "$dir/data" ]; then
        pg_as_owner "$PG_BIN/initdb" -D "$dir/data" -U postgres --auth=trust -E UTF8 >"$dir/initdb.log" 2>&1 \
            || { cat "$dir/initdb.log" >&2; return 1; }
    fi
    # TCP only: a socket path under a long or spaced checkout path would not fit or would split.
    pg_as_owner "$PG_BIN/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w \
        -o "-p $port -c unix_socket_directories= -c listen_addresses=127.0.0.1 $settings" \
        start >/dev/null || { cat "$dir/server.log" >&2; return 1; }
}

# Stops the cluster in $1/data: `fast` (clean) or `immediate` (a crash: no checkpoint).
pg_cluster_stop() {
    pg_as_owner "$PG_BIN/pg_ctl" -D "$1/data" -m "$2" -w stop >/dev/null
}

pg_start_private() {
    pg_ensure_bin || return 1
    local root port tries
    root=$(pg_owned_dir "$(pwd)/target" pg-private) || return 1
    PG_PRIVATE_DIR="$root"
    trap pg_stop_private EXIT
    # A port found free may be taken before the server binds it (another run starting at the
    # same moment): then another. Any other failure is final.
    for tries in 1 2 3 4 5; do
        port=$(free_port 55433 55633) || { pg_log "no free port"; return 1; }
        pg_log "starting a private cluster in $root on port $port"
        if pg_cluster_start "$root" "$port" "-c max_connections=300 -c fsync=off"; then
            DATABASE_URL="postgres://postgres@127.0.0.1:$port/postgres"
            return 0
        fi
        grep -q "could not bind" "$root/server.log" 2>/dev/null || return 1
        : >"$root/server.log"
    done
    return 1
}

# Whether the server at URL $1 takes user postgres without a password and is 13 or later.
# Without psql to ask, a listener on 127.0.0.1:5432 (the only server asked) is taken on trust.
pg_usable() {
    if command -v psql >/dev/null 2>&1; then
        [ "$(PGCONNECT_TIMEOUT=5 psql "$1" -X -w -Atqc "SELECT current_setting('server_version_num')::int >= 130000" 2>/dev/null)" = t ]
    else
        (exec 3<>/dev/tcp/127.0.0.1/5432) 2>/dev/null
    fi
}

pg_ensure() {
    local default="postgres://postgres@127.0.0.1:5432/postgres"
    if [ -n "${DATABASE_URL:-}" ]; then
        pg_log "using DATABASE_URL"
    elif pg_usable "$default"; then
        pg_log "using the server on 127.0.0.1:5432"
        DATABASE_URL=$default
    else
        pg_start_private || return 1
    fi
    export DATABASE_URL
}
