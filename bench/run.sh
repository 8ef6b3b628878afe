#!/usr/bin/env bash
# ongrid's benchmark in one command, on this machine, with release binaries. Prints, in one run,
# each part as it goes and then a table side by side with the reference measured in the same run:
#
# 1. Time to shell: from `devctl session new --wait` to the first command run in the new session
#    through the SSH gateway (`ssh <session>@gateway true`), with a GPU free and the dev image
#    present, over ONGRID_BENCH_SESSIONS sessions one after the other; p50 and p99, and the two
#    parts (tests/examples/time_to_shell.rs).
# 1b. A burst: ONGRID_BENCH_BURST sessions (a class at 9:00) asked for at once on one node whose
#    simulated GPUs are in shared:32 mode, time to shell of each (request to the end of its first
#    command through the gateway) p50/p99/max; beside it, first and in the same run, the floor:
#    as many `docker run -d` of the dev image at once, each followed by one `ssh true` to the
#    plain sshd of 2 (started before the burst); the ratio of the p99s
#    (tests/examples/time_to_shell.rs --burst).
# 2. SSH through the gateway against OpenSSH's sshd (Debian's openssh-server), which this script
#    starts on a free loopback port with its own config, host key and test user `ongrid-bench`
#    (MaxStartups raised so 50 logins at once are not dropped), the same cipher on both
#    (chacha20-poly1305@openssh.com): throughput each way of ONGRID_BENCH_SSH_MIB MiB of random
#    bytes through `cat`, login time one at a time (p50) and 50 at once; ONGRID_BENCH_ACTIVE
#    connections at once each moving 4 MiB, with the gateway's and the agent's highest resident
#    memory meanwhile; then their resident memory with ONGRID_BENCH_IDLE idle connections
#    (authenticated, a session channel open) (tests/examples/ssh_bench.rs).
# 3. Jupyter: a kernel round trip (execute `1+1` until its execute_reply) p50 and p99 through the
#    manager's web-app proxy (the dashboard's login cookie, wss:// to the manager) against
#    `ssh -L` through the gateway to the same JupyterLab in the same session, ONGRID_BENCH_JUPYTER
#    rounds alternating one by one after 20 warm-up rounds each; and, without a reference, how
#    long JupyterLab's first page took through the manager right after it started
#    (tests/examples/jupyter_bench.rs).
# 4. The scheduler's plan time: a short criterion run of scheduler/benches/plan.rs (1,000 nodes
#    × 8 GPUs against 10,000 pending sessions; 10,000 GPUs against 50,000 sessions and jobs).
# 5. The freeze ratio: images/benches/freeze.sh on ONGRID_BENCH_FREEZE_MIB MiB, one run each.
# 6. The control plane at site scale: a real manager on SQLite, then two replicas on one
#    PostgreSQL database, and ONGRID_FLEET_NODES simulated nodes speaking the agent protocol,
#    ONGRID_FLEET_SESSIONS sessions flowing through (created, placed, reported running, a fifth
#    removed); placement-to-agent latency, API latency, the
#    scheduling round, the /metrics scrape, the manager's memory and the store's size, against
#    the issue's targets (no reference: the targets are absolute) (tests/examples/fleet.rs).
#
# The sites of 1, 2 and 3 (manager, an agent with a simulated GPU, the gateway) are brought up by
# the end-to-end harness (tests/src/lib.rs) in a temporary directory with a node name of their own,
# so they run beside a quickstart or other sites on the same Docker daemon and leave nothing
# behind. Absolute times are printed, not asserted; the whole run takes about 10 minutes on a
# 2-core machine once built.
#
# Usage: bench/run.sh [--no-build] [--burst N] [--only PART[,PART...]]
#   --burst N: sessions of the burst (ONGRID_BENCH_BURST); --only: run only these parts, of
#   shell, burst, ssh, jupyter, plan, freeze, fleet (default: all).
# Environment (defaults): ONGRID_BENCH_SESSIONS (20), ONGRID_BENCH_BURST (60; 0 skips),
#   ONGRID_BENCH_SSH_MIB (1024), ONGRID_BENCH_JUPYTER (200 rounds; 0 skips),
#   ONGRID_BENCH_ACTIVE (200; 0 skips), ONGRID_BENCH_IDLE (1000), ONGRID_BENCH_FREEZE_MIB (256; 0
#   skips the freeze),
#   ONGRID_BENCH_PLAN (yes; no skips the scheduler), ONGRID_FLEET_NODES (1000; 0 skips the
#   fleet), ONGRID_FLEET_SESSIONS (10000), ONGRID_FLEET_USERS (50), ONGRID_FLEET_SYNC (the
#   manager's sync_interval in seconds, 5), ONGRID_FLEET_RATE (unset: 32 API requests at once;
#   set: creates and submits sent at that many a second, however many are unanswered; the
#   removals still 32 at once).
#
# Needs: root (the agent installs iptables rules; the test user; the freeze bench), cargo, Docker
# with the image ongrid/dev:latest (images/dev/build.sh), OpenSSH's ssh, ssh-keygen and sshd
# (openssh-client, openssh-server), ss (iproute2), and what images/benches/freeze.sh needs.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
readonly REPO_ROOT
readonly TARGET_DIR="${CARGO_TARGET_DIR:-$REPO_ROOT/target}"
readonly SESSIONS="${ONGRID_BENCH_SESSIONS:-20}"
BURST="${ONGRID_BENCH_BURST:-60}"
readonly SSH_MIB="${ONGRID_BENCH_SSH_MIB:-1024}"
readonly IDLE="${ONGRID_BENCH_IDLE:-1000}"
readonly ACTIVE="${ONGRID_BENCH_ACTIVE:-200}"
readonly JUPYTER="${ONGRID_BENCH_JUPYTER:-200}"
readonly FREEZE_MIB="${ONGRID_BENCH_FREEZE_MIB:-256}"
readonly PLAN="${ONGRID_BENCH_PLAN:-yes}"
readonly SSHD_USER=ongrid-bench
readonly SSHD=/usr/sbin/sshd

die() {
    printf 'error: %s\n' "$*" >&2
    exit 1
}

readonly USAGE="usage: bench/run.sh [--no-build] [--burst N] [--only PART[,PART...]]"
build=yes
only="shell,burst,ssh,jupyter,plan,freeze,fleet"
while (($# > 0)); do
    case "$1" in
    --no-build) build=no ;;
    --burst)
        (($# > 1)) || die "--burst needs a number of sessions ($USAGE)"
        BURST="$2"
        shift
        ;;
    --only)
        (($# > 1)) || die "--only needs parts, like burst or shell,ssh ($USAGE)"
        only="$2"
        shift
        ;;
    *) die "unknown argument $1 ($USAGE)" ;;
    esac
    shift
done
readonly BURST only
for part in ${only//,/ }; do
    case "$part" in
    shell | burst | ssh | jupyter | plan | freeze | fleet) ;;
    *) die "--only: unknown part $part (shell, burst, ssh, jupyter, plan, freeze, fleet)" ;;
    esac
done
# Whether the part $1 runs.
wanted() {
    [[ ",$only," == *",$1,"* ]]
}

for var in SESSIONS SSH_MIB; do
    [[ "${!var}" =~ ^[1-9][0-9]*$ ]] || die "ONGRID_BENCH_$var=${!var} must be a whole number above 0"
done
for var in IDLE ACTIVE FREEZE_MIB BURST JUPYTER; do
    [[ "${!var}" =~ ^[0-9]+$ ]] || die "ONGRID_BENCH_$var=${!var} must be a whole number"
done
[[ "$(id -u)" -eq 0 ]] || die "run as root: the agent installs iptables rules, and the sshd needs a test user"
command -v docker >/dev/null || die "docker not found: install Docker Engine and start it"
docker image inspect ongrid/dev:latest >/dev/null 2>&1 ||
    die "the image ongrid/dev:latest is missing: build it with images/dev/build.sh"
command -v ssh >/dev/null || die "ssh not found: apt-get install openssh-client"
[[ -x "$SSHD" ]] || die "$SSHD not found: apt-get install openssh-server (the reference)"
command -v ss >/dev/null || die "ss not found: apt-get install iproute2"

# The idle connections are file descriptors of the driver (and of the gateway, a child).
fds_needed=$((IDLE + 1024))
if (($(ulimit -n) < fds_needed)); then
    ulimit -n "$fds_needed" 2>/dev/null ||
        die "ulimit -n is $(ulimit -n) (hard limit $(ulimit -Hn)): $IDLE idle connections need $fds_needed; raise the hard limit or lower ONGRID_BENCH_IDLE"
fi

work="$(mktemp -d -t ongrid-bench.XXXXXX)"
chmod 0755 "$work"
readonly work
readonly summary="$work/summary"
sshd_pid=""
user_made=no

cleanup() {
    local status=$?
    trap - EXIT INT TERM
    if [[ -n "$sshd_pid" ]]; then
        kill -TERM "$sshd_pid" 2>/dev/null || true
        wait "$sshd_pid" 2>/dev/null || true
    fi
    if [[ "$user_made" == yes ]]; then
        userdel "$SSHD_USER" 2>/dev/null || true
    fi
    rm -rf -- "$work"
    exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

cd "$REPO_ROOT"
if [[ "$build" == yes ]]; then
    printf '==> building the release binaries\n'
    cargo build --release --quiet -p ongrid-manager -p ongrid-agent -p devctl -p ongrid-gateway
    cargo build --release --quiet -p ongrid-e2e --example time_to_shell --example ssh_bench \
        --example jupyter_bench --example fleet
fi
# The examples of the parts that run.
examples=()
if wanted shell || wanted burst; then
    examples+=(time_to_shell)
fi
if wanted ssh; then
    examples+=(ssh_bench)
fi
if wanted jupyter; then
    examples+=(jupyter_bench)
fi
if wanted fleet; then
    examples+=(fleet)
fi
for example in "${examples[@]}"; do
    [[ -x "$TARGET_DIR/release/examples/$example" ]] ||
        die "$TARGET_DIR/release/examples/$example is missing: run without --no-build"
done

# A loopback port nothing listens on.
free_port() {
    local port
    for _ in $(seq 1 100); do
        port=$((20000 + RANDOM % 40000))
        if [[ -z "$(ss -Htln "sport = :$port")" ]]; then
            printf '%s\n' "$port"
            return 0
        fi
    done
    die "found no free loopback port"
}

# The reference: sshd on a loopback port, its own host key and config, the test user's key.
start_sshd() {
    local dir="$work/sshd" home="$work/home" port
    mkdir -p "$dir" /run/sshd
    if ! id "$SSHD_USER" >/dev/null 2>&1; then
        useradd --system --no-create-home --home-dir "$home" --shell /bin/bash "$SSHD_USER"
        user_made=yes
    fi
    # A usable account (a locked one, `!`, is refused by sshd) without a password.
    usermod --home "$home" --password '*' "$SSHD_USER"
    mkdir -p "$home/.ssh"
    ssh-keygen -q -t ed25519 -N '' -C ongrid-bench -f "$dir/client_key"
    cp "$dir/client_key.pub" "$home/.ssh/authorized_keys"
    chown -R "$SSHD_USER:" "$home"
    chmod 0700 "$home/.ssh"
    ssh-keygen -q -t ed25519 -N '' -C ongrid-bench-host -f "$dir/host_key"
    port="$(free_port)"
    cat >"$dir/sshd_config" <<EOF
Port $port
ListenAddress 127.0.0.1
HostKey $dir/host_key
PidFile $dir/sshd.pid
AllowUsers $SSHD_USER
AuthorizedKeysFile .ssh/authorized_keys
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
PermitRootLogin no
# 50 logins at once must not be dropped (the default starts refusing at 10).
MaxStartups 200:30:400
Ciphers chacha20-poly1305@openssh.com
UseDNS no
PrintMotd no
PrintLastLog no
LogLevel ERROR
EOF
    "$SSHD" -t -f "$dir/sshd_config" || die "sshd refused its config $dir/sshd_config"
    "$SSHD" -D -f "$dir/sshd_config" -E "$dir/sshd.log" &
    sshd_pid=$!
    local i
    for ((i = 0; i < 100; i++)); do
        [[ -n "$(ss -Htln "sport = :$port")" ]] && break
        kill -0 "$sshd_pid" 2>/dev/null || die "sshd exited: $(cat "$dir/sshd.log")"
        sleep 0.1
    done
    ssh -F /dev/null -p "$port" -i "$dir/client_key" -o IdentitiesOnly=yes -o BatchMode=yes \
        -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR \
        "$SSHD_USER@127.0.0.1" true ||
        die "cannot log into the reference sshd on port $port: $(cat "$dir/sshd.log")"
    printf 'sshd (%s) on 127.0.0.1:%s for user %s\n' "$("$SSHD" -V 2>&1 | head -n1)" "$port" "$SSHD_USER"
    export ONGRID_BENCH_SSHD_PORT="$port" ONGRID_BENCH_SSHD_USER="$SSHD_USER"
    export ONGRID_BENCH_SSHD_KEY="$dir/client_key" ONGRID_BENCH_WORK="$work"
}

export ONGRID_BENCH_SUMMARY="$summary"
if wanted shell; then
    printf '\n==> time to shell, %s sessions\n' "$SESSIONS"
    "$TARGET_DIR/release/examples/time_to_shell" "$SESSIONS"
fi

if wanted ssh || { wanted burst && ((BURST > 0)); }; then
    start_sshd
fi

if wanted burst && ((BURST > 0)); then
    printf '\n==> burst: %s sessions at once, beside docker run -d + sshd\n' "$BURST"
    "$TARGET_DIR/release/examples/time_to_shell" --burst "$BURST"
fi

if wanted ssh; then
    printf '\n==> SSH: the gateway against OpenSSH sshd\n'
    "$TARGET_DIR/release/examples/ssh_bench" --mib "$SSH_MIB" --active "$ACTIVE" --idle "$IDLE"
fi

if wanted jupyter && ((JUPYTER > 0)); then
    printf '\n==> Jupyter: a kernel round trip through ongrid against ssh -L\n'
    "$TARGET_DIR/release/examples/jupyter_bench" --rounds "$JUPYTER"
fi

if wanted plan && [[ "$PLAN" != no ]]; then
    printf '\n==> scheduler plan time (a short criterion run)\n'
    cargo bench --quiet -p ongrid-scheduler --bench plan -- --noplot --warm-up-time 1 \
        --measurement-time 3 --sample-size 10 \
        '^plan/(site_1000x8/pending_10000|mixed_site_1250x8/pending_50000)$' | tee "$work/plan.out"
    # "plan/NAME", then (on the same line or the next) "time:   [low mid high]": the middle.
    awk '/^plan\// { name = $1 } /time:/ && name != "" {
            gsub(/[][]/, ""); sub(/.*time: */, "");
            printf "scheduler %s|%s %s|-|-\n", name, $3, $4; name = "" }' \
        "$work/plan.out" >>"$summary"
fi

if wanted fleet && ((${ONGRID_FLEET_NODES:-1000} > 0)); then
    printf '\n==> the control plane at site scale: simulated nodes against a real manager\n'
    # One connection per node's long-poll, and as many for its syncs.
    ulimit -n "$(ulimit -Hn)"
    printf -- '--> one manager on SQLite\n'
    ONGRID_FLEET_STORE=sqlite "$TARGET_DIR/release/examples/fleet"
    printf -- '--> two managers on one PostgreSQL database\n'
    ONGRID_FLEET_STORE=postgres "$TARGET_DIR/release/examples/fleet"
fi

if wanted freeze && ((FREEZE_MIB > 0)); then
    printf '\n==> freeze, ~%s MiB of mixed files, one run each\n' "$FREEZE_MIB"
    ONGRID_BENCH_MIB="$FREEZE_MIB" ONGRID_BENCH_RUNS=1 "$REPO_ROOT/images/benches/freeze.sh" |
        tee "$work/freeze.out"
    awk '/^ours \(export/ { ours = $(NF - 2) } /^reference \(export/ { ref = $(NF - 2) }
         /^ratio ours/ { sub(/.*wall time: */, ""); ratio = $1 }
         END { printf "freeze wall time (%s MiB), s|%s|%s|%s\n", mib, ours, ref, ratio }' \
        mib="$FREEZE_MIB" "$work/freeze.out" >>"$summary"
fi

printf '\n==> summary (load average %s)\n' "$(cut -d' ' -f1-3 /proc/loadavg)"
{
    printf 'measure|ongrid|reference|ratio\n'
    cat "$summary"
} | column -t -s '|'
