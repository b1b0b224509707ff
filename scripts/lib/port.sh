# Sourced by scripts/lib/pg.sh and scripts/lib/nats.sh.

# free_port FIRST LAST: prints the first port in FIRST..LAST nothing listens on, on 127.0.0.1.
free_port() {
    local port
    for port in $(seq "$1" "$2"); do
        if ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
            printf '%s\n' "$port"
            return 0
        fi
    done
    return 1
}
