# shellcheck shell=sh
# Starts a throwaway PostgreSQL server for tests (session-manager's store tests through
# test_server.rs, the end-to-end tests through tests/src/postgres.rs): `$1` is the directory of
# initdb and pg_ctl. It prints `ready <socket dir>` once the server accepts connections on a Unix
# socket in that directory only, or `failed: <why>`, then reads its standard input until it
# closes and stops the server and removes the directory.
set -u
bin=$1
dir=$(mktemp -d /tmp/ongrid-pg.XXXXXX) || { echo "failed: mktemp"; exit 1; }
cd "$dir" || { echo "failed: cd $dir"; exit 1; }
# PostgreSQL refuses to run as root: root runs it as the postgres user, anyone else as themselves.
if [ "$(id -u)" = 0 ]; then
    as_postgres() { setpriv --reuid=postgres --regid=postgres --init-groups -- "$@"; }
    chown postgres: "$dir" || { rm -rf "$dir"; echo "failed: chown postgres $dir"; exit 1; }
else
    as_postgres() { "$@"; }
fi
stop() {
    as_postgres "$bin/pg_ctl" -D "$dir/data" -m immediate stop >/dev/null 2>&1
    rm -rf "$dir"
}
trap stop EXIT
if ! as_postgres "$bin/initdb" -D "$dir/data" --auth=trust --username=postgres \
        --encoding=UTF8 >"$dir/initdb.log" 2>&1; then
    echo "failed: initdb: $(tail -n 5 "$dir/initdb.log" | tr '\n' ' ')"
    exit 1
fi
if ! as_postgres "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 \
        -o "-k $dir -c listen_addresses= -c fsync=off -c max_connections=300" \
        start >/dev/null 2>&1; then
    echo "failed: pg_ctl start: $(tail -n 5 "$dir/server.log" | tr '\n' ' ')"
    exit 1
fi
echo "ready $dir"
cat >/dev/null
