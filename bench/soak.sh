#!/usr/bin/env bash
# Soak benchmark: many SSH connections held open and busy while sessions start and go away.
#
# Usage: bench/soak.sh [--debug] [--no-build] [--minutes 10] [--connections 200] [--starts-per-minute 50]
#                      [--interval 60] [--quiet-starts 10]
#
# Brings up a site of its own with the end-to-end harness (tests/src/lib.rs: manager, one agent
# with four simulated A100s in shared:64 mode, the SSH gateway; a temporary directory and a node
# name of its own, so it runs beside a quickstart or tests on the same Docker daemon), then runs
# tests/examples/soak.rs: --connections OpenSSH clients held open on long-lived sessions, each
# echoing a line every 2 s and reconnecting after 30-90 s, while a second user starts (and
# removes) --starts-per-minute sessions a minute. First, on the idle site, --quiet-starts sessions
# are started one at a time: the quiet reference each interval's start p50 is printed against at
# the end. Every --interval seconds it prints the logins, echoes, starts and removals with their
# p50/p95/p99, the errors by kind, and the resident memory of manager, agent and gateway. Exits
# non-zero on any error. Release binaries unless --debug (what ./scripts/test has already built);
# --no-build runs the binaries already there.
#
# Whatever ends the run (its end, a failure, Ctrl-C, SIGTERM), the site's processes, containers,
# networks, home volumes and directory are removed.
#
# Needs: cargo, Docker with ongrid/dev:latest (images/dev/build.sh), OpenSSH's ssh and
# ssh-keygen, root (the agent installs iptables rules), as the end-to-end tests do.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
readonly REPO_ROOT
readonly TARGET_DIR="${CARGO_TARGET_DIR:-$REPO_ROOT/target}"

die() {
    printf 'error: %s\n' "$*" >&2
    exit 1
}

profile=release
build=yes
args=()
for arg in "$@"; do
    case "$arg" in
    --debug) profile=debug ;;
    --no-build) build=no ;;
    *) args+=("$arg") ;;
    esac
done

command -v docker >/dev/null || die "docker not found: install Docker Engine and start it"
docker image inspect ongrid/dev:latest >/dev/null 2>&1 ||
    die "the image ongrid/dev:latest is missing: build it with images/dev/build.sh"
command -v ssh >/dev/null || die "ssh not found: apt-get install openssh-client"

cd "$REPO_ROOT"
if [[ "$build" == yes ]]; then
    printf '==> building the %s binaries\n' "$profile"
    cargo_profile=()
    [[ "$profile" == release ]] && cargo_profile=(--release)
    cargo build "${cargo_profile[@]}" --quiet -p ongrid-manager -p ongrid-agent -p devctl -p ongrid-gateway
    cargo build "${cargo_profile[@]}" --quiet -p ongrid-e2e --example soak
fi
[[ -x "$TARGET_DIR/$profile/examples/soak" ]] ||
    die "$TARGET_DIR/$profile/examples/soak is missing: run without --no-build"

state="$(mktemp -t ongrid-soak.XXXXXX)"
driver=""

# The pids of processes whose command line names the site's directory: its manager, agent,
# gateway and the ssh clients using its keys.
site_pids() {
    local dir="$1" pid words
    for pid in /proc/[0-9]*; do
        { mapfile -d '' words <"$pid/cmdline"; } 2>/dev/null || continue
        if [[ "${words[*]}" == *"$dir"* ]]; then
            printf '%s\n' "${pid#/proc/}"
        fi
    done
    return 0
}

# The four hex digits naming node $1 in the agent's chains and interfaces: FNV-1a (32 bits) of
# the name, its low 16 bits (node_tag in node-agent/src/network/mod.rs).
node_tag() {
    local name="$1" hash=2166136261 i c
    for ((i = 0; i < ${#name}; i++)); do
        printf -v c '%d' "'${name:i:1}"
        hash=$(((hash ^ c) * 16777619 & 0xffffffff))
    done
    printf '%04x\n' $((hash & 0xffff))
}

# The agent's iptables chains for the node tag $1 (it leaves them when it stops, so that
# containers stay blocked); removed once the agent and its containers are gone.
remove_firewall() {
    local tag="$1"
    local table from chain table_from_chain
    for table_from_chain in "filter INPUT ONGRID-IN-$tag" "mangle FORWARD ONGRID-FWD-$tag"; do
        read -r table from chain <<<"$table_from_chain"
        iptables -w -t "$table" -D "$from" -i "ong$tag+" -j "$chain" 2>/dev/null || true
        if iptables -w -t "$table" -F "$chain" 2>/dev/null; then
            iptables -w -t "$table" -X "$chain" 2>/dev/null || true
        fi
    done
}

cleanup() {
    local status=$? node="" dir="" tag="" pids=() i
    trap - EXIT INT TERM
    if [[ -n "$driver" ]] && kill -0 "$driver" 2>/dev/null; then
        kill -TERM "$driver" 2>/dev/null || true
        wait "$driver" 2>/dev/null || true
    fi
    if [[ -s "$state" ]]; then
        { read -r node && read -r dir; } <"$state" || true
    fi
    if [[ -n "$dir" && -d "$dir" ]]; then
        printf '==> removing what the soak left: %s\n' "$dir"
        mapfile -t pids < <(site_pids "$dir")
        if ((${#pids[@]} > 0)); then
            kill -TERM "${pids[@]}" 2>/dev/null || true
            for ((i = 0; i < 150; i++)); do
                mapfile -t pids < <(site_pids "$dir")
                ((${#pids[@]} == 0)) && break
                sleep 0.1
            done
            if ((${#pids[@]} > 0)); then
                kill -KILL "${pids[@]}" 2>/dev/null || true
            fi
        fi
        rm -rf -- "$dir"
    fi
    if [[ -n "$node" ]]; then
        docker ps -aq --filter "label=ongrid.node=$node" | xargs -r docker rm -f >/dev/null
        docker network ls -q --filter "label=ongrid.node=$node" | xargs -r docker network rm >/dev/null
        docker volume ls -q --filter label=ongrid.managed=true | grep -F -- "-${node#e2e-}" |
            xargs -r docker volume rm -f >/dev/null || true
    fi
    if [[ -n "$node" ]]; then
        tag="$(node_tag "$node")"
        remove_firewall "$tag"
        printf '==> removed the site: its containers, networks, volumes, chains ONGRID-*-%s\n' "$tag"
    fi
    rm -f -- "$state"
    exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

ONGRID_SOAK_STATE="$state" "$TARGET_DIR/$profile/examples/soak" "${args[@]}" &
driver=$!
wait "$driver"
