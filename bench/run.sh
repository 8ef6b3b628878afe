#!/usr/bin/env bash
# ongrid's benchmark in one command, on this machine, with release binaries.
#
# Usage: bench/run.sh            (ONGRID_BENCH_SESSIONS: how many sessions, default 20)
#
# Time to shell: from `devctl session new --wait` to the first command run in the new session
# through the SSH gateway (`ssh <session>@gateway true`), with a GPU free and the dev image
# present, over ONGRID_BENCH_SESSIONS sessions one after the other; p50 and p99, and the two
# parts. The site (manager, an agent with a simulated GPU, the gateway) is brought up by the
# end-to-end harness (tests/src/lib.rs) in a temporary directory with a node name of its own,
# so it runs beside a quickstart or other sites on the same Docker daemon and leaves nothing
# behind. Absolute times are printed, not asserted.
#
# Needs: cargo, Docker with the image ongrid/dev:latest (images/dev/build.sh), OpenSSH's ssh and
# ssh-keygen, and root (the agent installs iptables rules), as the end-to-end tests do.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
readonly REPO_ROOT
readonly TARGET_DIR="${CARGO_TARGET_DIR:-$REPO_ROOT/target}"
readonly SESSIONS="${ONGRID_BENCH_SESSIONS:-20}"

die() {
    printf 'error: %s\n' "$*" >&2
    exit 1
}

[[ "$SESSIONS" =~ ^[1-9][0-9]*$ ]] ||
    die "ONGRID_BENCH_SESSIONS=$SESSIONS must be a whole number of sessions, like 20"
command -v docker >/dev/null || die "docker not found: install Docker Engine and start it"
docker image inspect ongrid/dev:latest >/dev/null 2>&1 ||
    die "the image ongrid/dev:latest is missing: build it with images/dev/build.sh"
command -v ssh >/dev/null || die "ssh not found: apt-get install openssh-client"

cd "$REPO_ROOT"
printf '==> building the release binaries\n'
cargo build --release --quiet -p ongrid-manager -p ongrid-agent -p devctl -p ongrid-gateway
cargo build --release --quiet -p ongrid-e2e --example time_to_shell

printf '\n==> time to shell, %s sessions\n' "$SESSIONS"
"$TARGET_DIR/release/examples/time_to_shell" "$SESSIONS"
