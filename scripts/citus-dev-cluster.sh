#!/usr/bin/env bash
# A Citus cluster for development checks (docs/scale-out.md, "A Citus cluster on a development
# machine"): Citus built from its release tag for the machine's PostgreSQL, and a coordinator
# and two workers as three local PostgreSQL clusters. Not for production; CI has no Citus.
#
#   scripts/citus-dev-cluster.sh build     # Citus from the release tag, installed into PostgreSQL
#   scripts/citus-dev-cluster.sh start     # initdb (first time), start, database + workers added
#   scripts/citus-dev-cluster.sh url       # prints CITUS_URL for make test-citus
#   scripts/citus-dev-cluster.sh idem      # the reference server's schema, distributed (the docs' steps 4-5)
#   scripts/citus-dev-cluster.sh stop      # stops the three nodes (their data stays)
#   scripts/citus-dev-cluster.sh status
#   scripts/citus-dev-cluster.sh destroy   # stops them and removes their data
#
# Settings (environment):
#   CITUS_DIR      where the source and the clusters go (default $HOME/citus-dev; as root
#                  /var/tmp/citus-dev, a directory the postgres user can enter)
#   CITUS_VERSION  the release to build (default 13.2.2; the tag is v$CITUS_VERSION)
#   CITUS_GIT      a clone URL or a local git directory holding the tag
#                  (default https://github.com/citusdata/citus.git; offline, a local clone:
#                  git clone --branch v13.2.2 https://github.com/citusdata/citus.git DIR once)
#   CITUS_PORT     the coordinator's port; the workers take the next two (default 9700)
#   CITUS_DB       the database (default idem)
#   PG_CONFIG      the PostgreSQL to build for (default: pg_config on PATH)
#   CITUS_FSYNC    on or off (default on)
#
# Build dependencies on Debian 12 (PostgreSQL 15 from Debian):
#   apt-get update && apt-get install -y postgresql-server-dev-15 libcurl4-openssl-dev liblz4-dev libzstd-dev \
#     libkrb5-dev libssl-dev libselinux1-dev libxslt1-dev libpam0g-dev libreadline-dev \
#     flex bison autoconf make gcc
# `build` installs into PostgreSQL's directories (run it as root, or as their owner). The nodes
# run as the user who runs the script, or as postgres when that is root; they listen on
# 127.0.0.1 only and trust local connections.
set -euo pipefail

# As root the nodes run as postgres, which cannot enter /root: the default is then /var/tmp.
if [ "$(id -u)" = 0 ]; then
    CITUS_DIR=${CITUS_DIR:-/var/tmp/citus-dev}
else
    CITUS_DIR=${CITUS_DIR:-$HOME/citus-dev}
fi
CITUS_VERSION=${CITUS_VERSION:-13.2.2}
CITUS_GIT=${CITUS_GIT:-https://github.com/citusdata/citus.git}
CITUS_PORT=${CITUS_PORT:-9700}
CITUS_DB=${CITUS_DB:-idem}
CITUS_FSYNC=${CITUS_FSYNC:-on}
PG_CONFIG=${PG_CONFIG:-pg_config}
BINDIR=$("$PG_CONFIG" --bindir)
NODES=(coord w1 w2)
REPO=$(cd "$(dirname "$0")/.." && pwd)

# as_pg runs a command as the nodes' owner.
as_pg() {
    if [ "$(id -u)" = 0 ]; then
        runuser -u postgres -- "$@"
    else
        "$@"
    fi
}

port_of() {
    case $1 in
        coord) echo "$CITUS_PORT" ;;
        w1) echo $((CITUS_PORT + 1)) ;;
        w2) echo $((CITUS_PORT + 2)) ;;
    esac
}

psql_on() { # node, database, psql arguments...
    local node=$1 db=$2
    shift 2
    PGOPTIONS='-c client_min_messages=warning' \
        as_pg "$BINDIR/psql" -X -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$(port_of "$node")" -U postgres -d "$db" "$@"
}

url() {
    echo "postgres://postgres@127.0.0.1:$CITUS_PORT/$CITUS_DB?sslmode=disable"
}

build() {
    local src=$CITUS_DIR/src began=$SECONDS
    mkdir -p "$CITUS_DIR"
    rm -rf "$src"
    if [ -d "$CITUS_GIT" ]; then
        mkdir -p "$src"
        git --git-dir="$(git -C "$CITUS_GIT" rev-parse --absolute-git-dir 2>/dev/null || echo "$CITUS_GIT")" \
            archive "v$CITUS_VERSION" | tar -x -C "$src"
    else
        git clone --quiet --depth 1 --branch "v$CITUS_VERSION" "$CITUS_GIT" "$src" || {
            echo "build: cannot clone v$CITUS_VERSION from $CITUS_GIT (offline?): set CITUS_GIT to a local clone that holds the tag," >&2
            echo "  made once while online: git clone --branch v$CITUS_VERSION https://github.com/citusdata/citus.git DIR" >&2
            exit 1
        }
    fi
    # PostgreSQL 15.20 exports have_createdb_privilege() (commands/dbcommands.h), which
    # Citus 13.2.2 defines for PostgreSQL 15 as a static function of its own: the build
    # fails with "static declaration of 'have_createdb_privilege' follows non-static
    # declaration". Where the server's header declares it, drop Citus' copy (the same code).
    if grep -q 'extern bool have_createdb_privilege' "$("$PG_CONFIG" --includedir-server)/commands/dbcommands.h" &&
        grep -q '^have_createdb_privilege(void)' "$src/src/include/pg_version_compat.h"; then
        perl -0pi -e 's/static inline bool\nhave_createdb_privilege\(void\)\n\{.*?\n\}\n//s' "$src/src/include/pg_version_compat.h"
        echo "patched: Citus' own have_createdb_privilege() dropped (PostgreSQL exports it)"
    fi
    (cd "$src" && ./configure PG_CONFIG="$PG_CONFIG" >configure.log && make -j"$(nproc)" >make.log 2>&1 && make install >install.log)
    echo "Citus $CITUS_VERSION built and installed into $("$PG_CONFIG" --pkglibdir) in $((SECONDS - began)) s"
}

init_node() {
    local node=$1 dir=$CITUS_DIR/cluster/$1
    [ -f "$dir/PG_VERSION" ] && return
    mkdir -p "$dir"
    [ "$(id -u)" = 0 ] && chown postgres: "$CITUS_DIR/cluster" "$dir"
    as_pg "$BINDIR/initdb" -D "$dir" -U postgres --auth=trust -E UTF8 --locale=C.UTF-8 >/dev/null
    cat >>"$dir/postgresql.conf" <<EOF

# scripts/citus-dev-cluster.sh
port = $(port_of "$node")
listen_addresses = '127.0.0.1'
unix_socket_directories = '$dir'
shared_preload_libraries = 'citus'
wal_level = logical
max_connections = 200
shared_buffers = 256MB
fsync = $CITUS_FSYNC
log_min_messages = warning
EOF
}

start() {
    for node in "${NODES[@]}"; do
        init_node "$node"
        local dir=$CITUS_DIR/cluster/$node
        if ! as_pg "$BINDIR/pg_ctl" -D "$dir" status >/dev/null 2>&1; then
            as_pg "$BINDIR/pg_ctl" -D "$dir" -l "$dir/server.log" -w start >/dev/null
        fi
    done
    for node in "${NODES[@]}"; do
        if [ -z "$(psql_on "$node" postgres -tAc "SELECT 1 FROM pg_database WHERE datname = '$CITUS_DB'")" ]; then
            psql_on "$node" postgres -c "CREATE DATABASE $CITUS_DB"
        fi
        psql_on "$node" "$CITUS_DB" -c "CREATE EXTENSION IF NOT EXISTS citus"
    done
    psql_on coord "$CITUS_DB" -c "SELECT citus_set_coordinator_host('127.0.0.1', $CITUS_PORT)" >/dev/null
    for node in w1 w2; do
        psql_on coord "$CITUS_DB" -c "SELECT citus_add_node('127.0.0.1', $(port_of "$node"))
            WHERE NOT EXISTS (SELECT FROM pg_dist_node WHERE nodeport = $(port_of "$node"))" >/dev/null
    done
    echo "Citus coordinator on 127.0.0.1:$CITUS_PORT, workers on :$(port_of w1) and :$(port_of w2)"
    echo "CITUS_URL=$(url)"
}

# idem: the docs' steps 4-5 for the reference server: server migrate at the coordinator, the
# ledger's tables as reference tables, then sql/citus/distribute.sql.
idem() {
    (cd "$REPO" && DATABASE_URL=$(url) go run ./cmd/server migrate)
    psql_on coord "$CITUS_DB" -c "SELECT create_reference_table(t) FROM unnest(ARRAY['ledger.principals', 'ledger.api_tokens',
        'ledger.accounts', 'ledger.deposits', 'ledger.transfers', 'ledger.payouts', 'ledger.payout_reservations']) AS t
        WHERE NOT EXISTS (SELECT FROM pg_dist_partition WHERE logicalrelid = t::regclass AND partmethod = 'n' AND repmodel = 't')"
    psql_on coord "$CITUS_DB" -f - <"$REPO/sql/citus/distribute.sql"
}

stop() {
    for node in "${NODES[@]}"; do
        local dir=$CITUS_DIR/cluster/$node
        if [ -f "$dir/postmaster.pid" ]; then
            as_pg "$BINDIR/pg_ctl" -D "$dir" -m fast -w stop >/dev/null
        fi
    done
}

status() {
    for node in "${NODES[@]}"; do
        printf '%-6s :%s ' "$node" "$(port_of "$node")"
        if out=$(as_pg "$BINDIR/pg_ctl" -D "$CITUS_DIR/cluster/$node" status 2>/dev/null); then
            head -1 <<<"$out"
        else
            echo "not running"
        fi
    done
}

case ${1:-} in
    build) build ;;
    start) start ;;
    url) url ;;
    idem) idem ;;
    stop) stop ;;
    status) status ;;
    destroy) stop && rm -rf "$CITUS_DIR/cluster" ;;
    *) sed -n '2,12p' "$0" >&2; exit 2 ;;
esac
