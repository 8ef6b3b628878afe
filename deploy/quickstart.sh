#!/usr/bin/env bash
# ongrid on this one machine, in one command: builds the binaries and the dev image, makes a
# throwaway CA with manager, agent, user and admin certificates, starts ongrid-manager, an
# ongrid-agent with simulated GPUs and the SSH gateway ongrid-gateway, allows 127.0.0.0/8 as
# institute `local`, registers an SSH key, starts a dev session `train1` and logs into it by ssh.
#
# Usage: deploy/quickstart.sh [start|stop|status|clean]
#   start    (default) set up what is missing and (re)start the manager, agent and gateway
#   stop     stop the gateway, the agent and the manager (dev containers keep running)
#   status   show whether they run, and the sessions
#   clean    stop, remove .quickstart/ and the quickstart's ongrid containers and home volumes
#
# Everything lives in .quickstart/ at the repository root: pki/ (CA, keys, certificates),
# certificates/ (the CA in IGTF layout), ssh/ (the user's SSH key, known_hosts), gateway/ (the
# gateway's host keys), configs, tokens, the SQLite database, logs and pid files.
# Re-running is safe: keys and certificates are kept, the services are restarted.
# Needs: cargo and a reachable Docker daemon; the Debian packages of deploy/debian-packages.txt
# (installed by the script when run as root) and root the first time (the dev image build).
# Environment:
#   ONGRID_BIN_DIR   run the binaries of this directory (for instance /usr/bin once the
#                    packages are installed) instead of building target/debug with cargo
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
readonly REPO_ROOT
readonly QS="$REPO_ROOT/.quickstart"
readonly PKI="$QS/pki"
readonly CA_DIR="$QS/certificates"
readonly BIN_DIR="${ONGRID_BIN_DIR:-${CARGO_TARGET_DIR:-$REPO_ROOT/target}/debug}"
readonly DEVCTL_CONFIG="$QS/devctl.toml"
readonly DEVCTL_ADMIN_CONFIG="$QS/devctl-admin.toml"
readonly GATEWAY_TOKEN="$QS/gateway-token"
readonly HOST_KEY_DIR="$QS/gateway"
# The user's SSH key and known_hosts, relative to the repository root (the script runs there),
# as the printed ssh command names them.
readonly SSH_KEY=.quickstart/ssh/id_ed25519
readonly KNOWN_HOSTS=.quickstart/ssh/known_hosts
# Where the person who ran the script is, to print paths that work from there.
readonly CALLER_PWD="$PWD"

readonly DN_BASE="/DC=org/DC=ongrid-quickstart"
readonly CA_SUBJECT="$DN_BASE/CN=ongrid quickstart CA"
readonly ADMIN_SUBJECT="$DN_BASE/CN=Site Admin"
# Each service takes the first free port of its range on 127.0.0.1.
readonly MANAGER_PORTS=(8443 8453)
readonly STREAM_PORTS=(8444 8454)
readonly SSH_PORTS=(2222 2232)
readonly SESSION_NAME=train1
# The institute whose networks may reach the gateway: this machine's loopback.
readonly INSTITUTE=local
readonly INSTITUTE_NETWORKS=(127.0.0.0/8 ::1/128)
readonly DEV_IMAGE=ongrid/dev:latest

# How long to wait, in seconds.
readonly START_TIMEOUT=60
readonly NODE_ONLINE_TIMEOUT=60
readonly STOP_TIMEOUT=15
readonly SSH_TIMEOUT=60
# How many times the first ssh is tried while the gateway waits for its allowlist (1 s apart).
readonly SSH_ATTEMPTS=10

say() { printf '\n==> %s\n' "$*"; }
info() { printf '    %s\n' "$*"; }
die() {
    printf '\nerror: %s\n' "$*" >&2
    exit 1
}

usage() {
    sed -n '2,21p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
}

# ---------------------------------------------------------------------------------------------
# Checks

# Every prerequisite, checked (and the Debian packages installed when run as root) before the
# long build, so a missing one stops the quickstart at once with the command that fixes it.
check_prerequisites() {
    "$REPO_ROOT/deploy/install-packages.sh" quickstart
    [[ -n "${ONGRID_BIN_DIR:-}" ]] || command -v cargo >/dev/null ||
        die "cargo not found: install a stable Rust toolchain (1.88 or newer) with rustup, then run $0 again"
    command -v docker >/dev/null ||
        die "docker not found: install Docker Engine (Debian: apt-get install docker.io) and start it (systemctl start docker)"
    check_docker_daemon
    "$REPO_ROOT/images/dev/build.sh" --check ||
        die "the dev image $DEV_IMAGE cannot be built here (cause above)"
}

# What `stop`, `status` and `clean` need: no build, no package installation.
check_tools() {
    command -v docker >/dev/null || die "docker not found: the quickstart's containers are Docker containers"
    check_docker_daemon
}

check_docker_daemon() {
    docker info >/dev/null 2>&1 ||
        die "cannot reach the Docker daemon (docker info failed): start it (systemctl start docker), or run as a user in the docker group"
}

# ---------------------------------------------------------------------------------------------
# Values derived from this machine

# The user certificate's common name: the login name, or "Quickstart User" when that is empty or
# root (a login `root` inside dev containers would only confuse). Only characters that need no
# escaping in an OpenSSL subject are kept.
user_common_name() {
    local name="${SUDO_USER:-${USER:-}}"
    name="$(printf '%s' "$name" | tr -cd 'A-Za-z0-9 ._-')"
    if [[ -z "$name" || "$name" == root ]]; then
        name="Quickstart User"
    fi
    printf '%s\n' "$name"
}

# This machine's short host name as a node name: a lower-case DNS label.
node_name() {
    local name
    name="$(cat /proc/sys/kernel/hostname)"
    name="${name%%.*}"
    name="$(printf '%s' "$name" | tr '[:upper:]' '[:lower:]' | tr -c 'a-z0-9-' '-' |
        sed -e 's/--*/-/g' -e 's/^-//' -e 's/-$//')"
    name="${name:0:63}"
    name="${name%-}"
    printf '%s\n' "${name:-node1}"
}

# A TOML basic string holding $1.
toml_string() {
    local value="$1"
    value="${value//\\/\\\\}"
    value="${value//\"/\\\"}"
    printf '"%s"' "$value"
}

# Whether something accepts connections on 127.0.0.1:$1.
port_in_use() {
    timeout 1 bash -c "exec 3<>/dev/tcp/127.0.0.1/$1" 2>/dev/null
}

# first_free_port FIRST LAST [TAKEN...]: the first port of FIRST..LAST that nothing listens on
# and that is not one of TAKEN (ports chosen for services not started yet).
first_free_port() {
    local first="$1" last="$2" port
    shift 2
    for ((port = first; port <= last; port++)); do
        if [[ " $* " != *" $port "* ]] && ! port_in_use "$port"; then
            printf '%s\n' "$port"
            return 0
        fi
    done
    die "ports $first to $last on 127.0.0.1 are all in use: free one, or stop what listens there"
}

# choose_port FILE KEY FIRST LAST [TAKEN...]: the port of `KEY = "HOST:PORT"` in .quickstart/FILE,
# written by an earlier start and kept since (the user may have changed it); the first free one
# of FIRST..LAST (not one of TAKEN) when FILE is not there yet. Dies, saying what to do, when
# something else listens on the kept port now.
choose_port() {
    local file="$QS/$1" key="$2" port
    shift 2
    if [[ ! -f "$file" ]]; then
        first_free_port "$@"
        return
    fi
    port="$(sed -n "s/^$key *= *\"[^\"]*:\([0-9]*\)\".*/\1/p" "$file" | head -n 1)"
    [[ -n "$port" ]] ||
        die "$file has no $key = \"HOST:PORT\": put it back, or deploy/quickstart.sh clean to start over"
    ! port_in_use "$port" ||
        die "port $port ($key in $file) is in use by another program: stop it, or change the port there and in the files that name it (grep -l $port $QS/*.toml), or deploy/quickstart.sh clean to start over"
    printf '%s\n' "$port"
}

# A path relative to the repository root as the caller can use it: unchanged when they are at the
# root, else absolute.
caller_path() {
    if [[ "$CALLER_PWD" == "$REPO_ROOT" ]]; then
        printf '%s\n' "$1"
    else
        printf '%s\n' "$REPO_ROOT/$1"
    fi
}

# ---------------------------------------------------------------------------------------------
# Build

build_binaries() {
    local binary
    if [[ -n "${ONGRID_BIN_DIR:-}" ]]; then
        say "the binaries of $BIN_DIR (ONGRID_BIN_DIR; nothing is built)"
        for binary in ongrid-manager ongrid-agent ongrid-gateway devctl; do
            [[ -x "$BIN_DIR/$binary" ]] ||
                die "no $BIN_DIR/$binary: install the packages (deploy/README.md), or unset ONGRID_BIN_DIR to build them"
        done
        return 0
    fi
    say "building ongrid-manager, ongrid-agent, ongrid-gateway and devctl (cargo build --workspace --bins)"
    (cd "$REPO_ROOT" && cargo build --workspace --bins) ||
        die "cargo build failed (output above)"
    for binary in ongrid-manager ongrid-agent ongrid-gateway devctl; do
        [[ -x "$BIN_DIR/$binary" ]] || die "cargo built no $BIN_DIR/$binary"
    done
}

build_dev_image() {
    say "dev image $DEV_IMAGE (images/dev/build.sh)"
    "$REPO_ROOT/images/dev/build.sh" ||
        die "building the dev image failed (output above)"
}

# ---------------------------------------------------------------------------------------------
# PKI: a throwaway CA and the certificates signed by it

# Writes a PKCS#8 RSA private key, readable by its owner only.
new_key() {
    openssl genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:2048 -out "$1" 2>/dev/null
    chmod 600 "$1"
}

# Whether certificate $1 exists, was issued by the current CA and is valid for another day.
certificate_usable() {
    [[ -f "$1" ]] &&
        openssl verify -CAfile "$PKI/ca.crt" "$1" >/dev/null 2>&1 &&
        openssl x509 -in "$1" -noout -checkend 86400 >/dev/null
}

ensure_ca() {
    if [[ -f "$PKI/ca.crt" && -f "$PKI/ca.key" ]] &&
        openssl x509 -in "$PKI/ca.crt" -noout -checkend 86400 >/dev/null; then
        info "CA: $CA_SUBJECT (kept)"
    else
        new_key "$PKI/ca.key"
        cat >"$PKI/ca.cnf" <<'EOF'
[req]
distinguished_name = dn
prompt = no
[dn]
[ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
EOF
        openssl req -new -x509 -config "$PKI/ca.cnf" -extensions ca -key "$PKI/ca.key" \
            -subj "$CA_SUBJECT" -days 3650 -sha256 -out "$PKI/ca.crt"
        # Certificates of an earlier CA are no longer valid: issue them again.
        rm -f "$PKI"/*.srl "$PKI/manager.crt" "$PKI/agent.crt" "$PKI/user.crt" "$PKI/admin.crt" \
            "$PKI/index.txt" "$PKI/crlnumber"
        info "CA: $CA_SUBJECT (new)"
    fi
    # IGTF layout: the CA as <subject hash>.0, the only CA the quickstart trusts.
    local hash
    hash="$(openssl x509 -in "$PKI/ca.crt" -noout -subject_hash)"
    rm -f "$CA_DIR"/*.0 "$CA_DIR"/*.r0
    cp "$PKI/ca.crt" "$CA_DIR/$hash.0"
    write_crl "$CA_DIR/$hash.r0"
    info "trusted CA directory: $CA_DIR/$hash.0 and its CRL $hash.r0"
}

# write_crl FILE: the CA's (empty) CRL, valid for 30 days, renewed at every start as fetch-crl
# does on a real site: the manager refuses the users of a CA whose CRL is out of date.
write_crl() {
    cat >"$PKI/crl.cnf" <<EOF
[ca]
default_ca = quickstart
[quickstart]
database = $PKI/index.txt
crlnumber = $PKI/crlnumber
default_md = sha256
default_crl_days = 30
EOF
    [[ -f "$PKI/index.txt" ]] || : >"$PKI/index.txt"
    [[ -f "$PKI/crlnumber" ]] || echo 1000 >"$PKI/crlnumber"
    openssl ca -gencrl -config "$PKI/crl.cnf" -keyfile "$PKI/ca.key" -cert "$PKI/ca.crt" \
        -out "$1" 2>/dev/null
}

# Whether private key $1 belongs to certificate $2.
key_matches() {
    local key_public cert_public
    key_public="$(openssl pkey -in "$1" -pubout 2>/dev/null)" || return 1
    cert_public="$(openssl x509 -in "$2" -noout -pubkey 2>/dev/null)" || return 1
    [[ "$key_public" == "$cert_public" ]]
}

# issue NAME SUBJECT EXTENSIONS: a key and a certificate signed by the CA, unless a usable one
# with this subject exists.
issue() {
    local name="$1" subject="$2" extensions="$3"
    local cert="$PKI/$name.crt" key="$PKI/$name.key"
    if certificate_usable "$cert" && key_matches "$key" "$cert" &&
        [[ "$(openssl x509 -in "$cert" -noout -subject -nameopt compat)" == "subject=$subject" ]]; then
        info "$name: $subject (kept)"
        return 0
    fi
    new_key "$key"
    printf '%s\n' "$extensions" >"$PKI/$name.ext"
    openssl req -new -config "$PKI/ca.cnf" -key "$key" -subj "$subject" -out "$PKI/$name.csr"
    openssl x509 -req -in "$PKI/$name.csr" -CA "$PKI/ca.crt" -CAkey "$PKI/ca.key" \
        -CAserial "$PKI/ca.srl" -CAcreateserial -days 365 -sha256 \
        -extfile "$PKI/$name.ext" -out "$cert" 2>/dev/null
    rm -f "$PKI/$name.csr"
    info "$name: $subject (new)"
}

ensure_pki() {
    say "certificates in $PKI"
    ensure_ca
    local server_extensions="basicConstraints = critical, CA:FALSE
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth
subjectAltName = IP:127.0.0.1, DNS:localhost"
    issue manager "$DN_BASE/CN=localhost" "$server_extensions"
    # The agent's stream endpoint (wss://127.0.0.1:PORT), which the gateway connects to.
    issue agent "$DN_BASE/CN=127.0.0.1" "$server_extensions"
    local client_extensions="basicConstraints = critical, CA:FALSE
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = clientAuth"
    issue user "$DN_BASE/CN=$(user_common_name)" "$client_extensions"
    issue admin "$ADMIN_SUBJECT" "$client_extensions"
}

# ---------------------------------------------------------------------------------------------
# Configuration

# A random bearer token in file $1, made once.
ensure_token() {
    if [[ ! -s "$1" ]]; then
        openssl rand -hex 32 >"$1"
        chmod 600 "$1"
    fi
}

# write_configs MANAGER_PORT NODE STREAM_PORT SSH_PORT
write_configs() {
    local port="$1" node="$2" stream_port="$3" ssh_port="$4" url="https://127.0.0.1:$1"
    say "configuration in $QS (manager on 127.0.0.1:$port, node $node, agent streams on 127.0.0.1:$stream_port, SSH gateway on 127.0.0.1:$ssh_port)"
    ensure_token "$QS/node-token"
    # One token for the gateway: it presents it to the manager and to the agent.
    ensure_token "$GATEWAY_TOKEN"
    {
        printf '# Written by deploy/quickstart.sh: the quickstart node and its token.\n'
        printf '%s %s\n' "$node" "$(cat "$QS/node-token")"
    } >"$QS/agent-tokens"
    chmod 600 "$QS/agent-tokens"

    if [[ ! -f "$QS/simulated-gpus.toml" ]]; then
        cp "$REPO_ROOT/deploy/examples/simulated-gpus.toml" "$QS/simulated-gpus.toml"
    fi

    [[ -f "$QS/manager.toml" ]] || cat >"$QS/manager.toml" <<EOF
# Written by deploy/quickstart.sh at its first start; see deploy/examples/manager.toml.
# Yours to edit: later starts keep this file as it is (deploy/quickstart.sh clean starts over).
listen = $(toml_string "127.0.0.1:$port")
database = $(toml_string "$QS/manager.db")
tls_cert = $(toml_string "$PKI/manager.crt")
tls_key = $(toml_string "$PKI/manager.key")
ca_dir = $(toml_string "$CA_DIR")
admins = [$(toml_string "$ADMIN_SUBJECT")]
agent_tokens_file = $(toml_string "$QS/agent-tokens")
gateway_token_file = $(toml_string "$GATEWAY_TOKEN")
default_image = $(toml_string "$DEV_IMAGE")
first_uid = 20000
node_timeout = "30 seconds"
sync_interval = "2 seconds"
schedule_interval = "1 second"
# Frozen images (devctl freeze): the same directory as the agent's [images] store.
image_store = $(toml_string "$QS/images")

[session_limits]
cpus = "2"
memory = "4GiB"
pids = 4096

# The site's defaults (deploy/examples/manager.toml explains each key).
[lifecycle]
connect_deadline = "20 minutes"
idle_timeout = "2 hours"
max_duration = "7 days"

# No [policy]: every user of the quickstart's own CA (the only one in ca_dir) is admitted, in
# accounting group "default". Fair share by GPU cost (devctl share), usage halving every day.
[fairshare]
half_life = "1 day"
cost = { A100 = 1.0, H100 = 2.0 }
EOF

    [[ -f "$QS/agent.toml" ]] || cat >"$QS/agent.toml" <<EOF
# Written by deploy/quickstart.sh at its first start; see deploy/examples/agent.toml.
# Yours to edit: later starts keep this file as it is (deploy/quickstart.sh clean starts over).
node_name = $(toml_string "$node")
manager_url = $(toml_string "$url")
ca_dir = $(toml_string "$CA_DIR")
token_file = $(toml_string "$QS/node-token")

[gpu]
backend = "simulated"
# Edit this file to add, remove or fail GPUs: the agent re-reads it.
file = $(toml_string "$QS/simulated-gpus.toml")

# Where devctl freeze writes SIF images (the manager's image_store).
[images]
store = $(toml_string "$QS/images")

# The endpoint the SSH gateway opens streams to (shells, commands, sftp in the containers).
[streams]
listen = $(toml_string "127.0.0.1:$stream_port")
url = $(toml_string "wss://127.0.0.1:$stream_port")
tls_cert = $(toml_string "$PKI/agent.crt")
tls_key = $(toml_string "$PKI/agent.key")
gateway_token_file = $(toml_string "$GATEWAY_TOKEN")
EOF

    [[ -f "$QS/gateway.toml" ]] || cat >"$QS/gateway.toml" <<EOF
# Written by deploy/quickstart.sh at its first start; see deploy/examples/gateway.toml.
# Yours to edit: later starts keep this file as it is (deploy/quickstart.sh clean starts over).
listen = $(toml_string "127.0.0.1:$ssh_port")
# Host keys, made by the gateway at its first start.
host_key_dir = $(toml_string "$HOST_KEY_DIR")
manager_url = $(toml_string "$url")
ca_dir = $(toml_string "$CA_DIR")
token_file = $(toml_string "$GATEWAY_TOKEN")
allowlist_refresh = "2 seconds"
EOF

    [[ -f "$DEVCTL_CONFIG" ]] || write_devctl_config "$DEVCTL_CONFIG" "$url" user
    [[ -f "$DEVCTL_ADMIN_CONFIG" ]] || write_devctl_config "$DEVCTL_ADMIN_CONFIG" "$url" admin
}

write_devctl_config() {
    local file="$1" url="$2" identity="$3"
    cat >"$file" <<EOF
# Written by deploy/quickstart.sh: devctl as the quickstart's $identity.
# Use it with: export ONGRID_DEVCTL_CONFIG=$file
manager_url = $(toml_string "$url")
cert = $(toml_string "$PKI/$identity.crt")
key = $(toml_string "$PKI/$identity.key")
ca_dir = $(toml_string "$CA_DIR")
EOF
    # devctl refuses a config file (it names the key) that others may read.
    chmod 600 "$file"
}

# ---------------------------------------------------------------------------------------------
# Processes

# The pid in .quickstart/NAME.pid when that process runs and is the quickstart's ongrid-NAME.
running_pid() {
    local name="$1" pid
    [[ -f "$QS/$name.pid" ]] || return 1
    pid="$(cat "$QS/$name.pid")"
    [[ "$pid" =~ ^[0-9]+$ ]] || return 1
    kill -0 "$pid" 2>/dev/null || return 1
    # Guards against a reused pid: the process must be an ongrid-NAME (built here or installed:
    # a start with another ONGRID_BIN_DIR stops it too) running with the quickstart's config.
    local exe
    exe="$(readlink "/proc/$pid/exe" 2>/dev/null)" || return 1
    [[ "${exe##*/}" == "ongrid-$name"* ]] || return 1
    tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "$QS/$name.toml" || return 1
    printf '%s\n' "$pid"
}

# Whether the process start_service started for NAME still runs. (Right after the start it may
# not be ongrid-NAME yet but the shell about to exec it, so running_pid's check does not apply.)
started_and_alive() {
    kill -0 "$(cat "$QS/$1.pid")" 2>/dev/null
}

stop_service() {
    local name="$1" pid waited=0
    if ! pid="$(running_pid "$name")"; then
        rm -f "$QS/$name.pid"
        return 0
    fi
    info "stopping ongrid-$name (pid $pid)"
    kill -TERM "$pid"
    while kill -0 "$pid" 2>/dev/null; do
        if ((waited >= STOP_TIMEOUT * 10)); then
            info "ongrid-$name did not stop within ${STOP_TIMEOUT}s: killing it"
            kill -KILL "$pid" 2>/dev/null || true
            break
        fi
        sleep 0.1
        waited=$((waited + 1))
    done
    rm -f "$QS/$name.pid"
}

stop_services() {
    # Clients of the manager first: a manager without agents and gateway is harmless, an agent or
    # gateway without its manager retries.
    stop_service gateway
    stop_service agent
    stop_service manager
}

# Fails with the last lines of .quickstart/NAME.log.
fail_with_log() {
    local name="$1" message="$2"
    printf '\n--- last lines of %s ---\n' "$QS/$name.log" >&2
    tail -n 25 "$QS/$name.log" >&2 || true
    printf -- '---\n' >&2
    die "$message (full log: $QS/$name.log)"
}

# start_service NAME: ongrid-NAME --config .quickstart/NAME.toml in the background, after
# checking its config.
start_service() {
    local name="$1" binary="$BIN_DIR/ongrid-$1" config="$QS/$1.toml"
    if [[ -f "$QS/$name.log" ]]; then
        mv -f "$QS/$name.log" "$QS/$name.log.1"
    fi
    # Logs go to files: no colours.
    NO_COLOR=1 "$binary" --config "$config" --check-config >"$QS/$name.log" 2>&1 ||
        fail_with_log "$name" "ongrid-$name rejected its configuration $config"
    NO_COLOR=1 ONGRID_LOG="${ONGRID_LOG:-info}" nohup "$binary" --config "$config" \
        >>"$QS/$name.log" 2>&1 </dev/null &
    printf '%s\n' "$!" >"$QS/$name.pid"
    info "ongrid-$name started (pid $!, log $QS/$name.log)"
}

# Waits until ongrid-NAME prints its "listening on ADDR" line (manager and gateway do).
wait_for_listening() {
    local name="$1" deadline=$((SECONDS + START_TIMEOUT)) status=0
    until grep -q '^listening on ' "$QS/$name.log" 2>/dev/null; do
        if ! started_and_alive "$name"; then
            wait "$(cat "$QS/$name.pid")" 2>/dev/null || status=$?
            fail_with_log "$name" "ongrid-$name exited during start-up (exit code $status)"
        fi
        ((SECONDS < deadline)) ||
            fail_with_log "$name" "ongrid-$name printed no 'listening on' line within ${START_TIMEOUT}s"
        sleep 0.2
    done
    info "ongrid-$name: $(grep -m1 '^listening on ' "$QS/$name.log")"
}

# devctl's environment variables override its config file; the quickstart's devctl must use
# the quickstart's manager, certificate and CA whatever this shell has set.
readonly DEVCTL_ENV_OVERRIDES=(ONGRID_MANAGER_URL X509_USER_CERT X509_USER_KEY X509_USER_PROXY X509_CERT_DIR)

# devctl_with CONFIG ARGS...: devctl with the quickstart's config file CONFIG.
devctl_with() {
    local config="$1" unset_args=() variable
    shift
    for variable in "${DEVCTL_ENV_OVERRIDES[@]}"; do
        unset_args+=(-u "$variable")
    done
    env "${unset_args[@]}" "$BIN_DIR/devctl" --config "$config" "$@"
}

# devctl as the quickstart user, and as the site admin.
devctl() { devctl_with "$DEVCTL_CONFIG" "$@"; }
devctl_admin() { devctl_with "$DEVCTL_ADMIN_CONFIG" "$@"; }

wait_for_node() {
    local node="$1" deadline=$((SECONDS + NODE_ONLINE_TIMEOUT)) gpus=""
    until [[ "$gpus" == *"\"$node\""* ]]; do
        started_and_alive agent ||
            fail_with_log agent "ongrid-agent exited during start-up"
        ((SECONDS < deadline)) ||
            fail_with_log agent "node $node did not show up in 'devctl gpus' within ${NODE_ONLINE_TIMEOUT}s"
        sleep 0.5
        gpus="$(devctl gpus --json 2>/dev/null)" || gpus=""
    done
    info "node $node is registered with its GPUs"
}

# The institute `local` (this machine's loopback networks), added once by the site admin.
ensure_institute() {
    if devctl_admin admin institute show "$INSTITUTE" >/dev/null 2>&1; then
        say "institute $INSTITUTE exists: keeping it"
        devctl_admin admin institute show "$INSTITUTE" | sed 's/^/    /'
        return 0
    fi
    say "devctl admin institute add $INSTITUTE ${INSTITUTE_NETWORKS[*]} (as the site admin)"
    devctl_admin admin institute add "$INSTITUTE" "${INSTITUTE_NETWORKS[@]}" ||
        fail_with_log manager "devctl could not add institute $INSTITUTE (its error is above)"
}

# The simulated A100 that the quickstart partitions into MIG devices (deploy/examples/
# simulated-gpus.toml), and its layout: a session asks for one with --mig 1g.5gb.
readonly MIG_GPU=GPU-0a100000-0000-4000-8000-000000000004
readonly MIG_LAYOUT="mig:3g.20gb*1+2g.10gb*1+1g.5gb*2"

# Puts the MIG GPU in MIG mode, once, as the site admin (a GPU no longer in the simulated file
# is left alone). The agent makes the layout when nothing runs on the GPU.
ensure_mig_gpu() {
    local gpus
    gpus="$(devctl_admin gpus --json 2>/dev/null)" || gpus=""
    [[ "$gpus" == *"$MIG_GPU"* ]] || return 0
    if devctl_admin gpus --json | grep -q "\"mode\": *\"$MIG_LAYOUT\""; then
        say "GPU $MIG_GPU is in $MIG_LAYOUT: keeping it"
        return 0
    fi
    say "devctl admin gpu mode $MIG_GPU $MIG_LAYOUT (as the site admin)"
    devctl_admin admin gpu mode "$MIG_GPU" "$MIG_LAYOUT" ||
        fail_with_log manager "devctl could not put GPU $MIG_GPU in MIG mode (its error is above)"
}

# The quickstart user's SSH key pair, without a passphrase, made once.
ensure_ssh_key() {
    mkdir -p "$(dirname "$SSH_KEY")"
    if [[ -f "$SSH_KEY" && -f "$SSH_KEY.pub" ]]; then
        info "SSH key $SSH_KEY (kept)"
        return 0
    fi
    rm -f "$SSH_KEY" "$SSH_KEY.pub"
    ssh-keygen -q -t ed25519 -N '' -C "ongrid-quickstart" -f "$SSH_KEY" ||
        die "ssh-keygen could not make $SSH_KEY (its error is above)"
    info "SSH key $SSH_KEY (new)"
}

# Registers the key for the quickstart user (again at every start: that renews its expiry).
register_ssh_key() {
    say "devctl key add $SSH_KEY.pub"
    devctl key add "$SSH_KEY.pub" ||
        fail_with_log manager "devctl could not register $SSH_KEY.pub (its error is above)"
}

# The gateway makes its host keys at its first start; a known_hosts from earlier keys would
# make ssh refuse the new ones.
prepare_host_keys() {
    mkdir -p "$HOST_KEY_DIR"
    if [[ ! -f "$HOST_KEY_DIR/ssh_host_ed25519_key" ]]; then
        rm -f "$KNOWN_HOSTS"
    fi
}

start_services() {
    local node="$1"
    say "starting ongrid-manager, ongrid-agent and ongrid-gateway"
    start_service manager
    wait_for_listening manager
    ensure_institute
    start_service agent
    wait_for_node "$node"
    ensure_mig_gpu
    prepare_host_keys
    start_service gateway
    wait_for_listening gateway
}

# ---------------------------------------------------------------------------------------------
# The demo session

# Docker's name of the quickstart session's container, if it exists.
session_container() {
    docker ps -a --filter label=ongrid.managed=true \
        --filter "label=ongrid.session.name=$SESSION_NAME" \
        --format '{{.Names}}\t{{.Label "ongrid.owner"}}' |
        awk -F '\t' -v base="$DN_BASE/" 'index($2, base) == 1 { print $1; exit }'
}

start_session() {
    # A re-run finds the session of the previous run alive (listings leave out ended ones): the
    # restarted agent has adopted its container, so it is kept.
    if devctl session ls --json | grep -Eq "\"name\": *\"$SESSION_NAME\""; then
        say "session $SESSION_NAME exists from an earlier run: keeping it"
        return 0
    fi
    say "devctl session new --name $SESSION_NAME --gpus 1 --min-capability 8.0 --wait"
    # devctl --wait gives up by itself (after 5 minutes) and says why.
    devctl session new --name "$SESSION_NAME" --gpus 1 --min-capability 8.0 --wait ||
        fail_with_log agent "devctl could not start session $SESSION_NAME (its error is above)"
}

# Remembers the login names the quickstart's sessions run as, so that `clean` can remove their
# home volumes even after the containers are gone.
remember_logins() {
    local container="$1" login
    login="$(docker inspect --format '{{index .Config.Labels "ongrid.user"}}' "$container")"
    [[ -n "$login" ]] || return 0
    mkdir -p "$QS"
    touch "$QS/logins"
    grep -qx -- "$login" "$QS/logins" || printf '%s\n' "$login" >>"$QS/logins"
}

show_state() {
    say "devctl session ls"
    devctl session ls
    say "devctl gpus"
    devctl gpus
    say "docker ps --filter label=ongrid.managed=true"
    docker ps --filter label=ongrid.managed=true
}

# ssh_options SSH_PORT: the options of the ssh command that reaches the session, one a line.
ssh_options() {
    printf '%s\n' -i "$(caller_path "$SSH_KEY")" -p "$1" \
        -o "UserKnownHostsFile=$(caller_path "$KNOWN_HOSTS")" -o StrictHostKeyChecking=accept-new
}

# Logs into the session once through the gateway, without a terminal, and shows what ran there.
check_ssh() {
    local ssh_port="$1" options output status=0
    mapfile -t options < <(ssh_options "$ssh_port")
    # For the container's shell: $CUDA_VISIBLE_DEVICES expands there, not here.
    # shellcheck disable=SC2016
    local remote='id -un; echo $CUDA_VISIBLE_DEVICES'
    say "ssh ${options[*]} $SESSION_NAME@127.0.0.1 '$remote'"
    local attempt
    for ((attempt = 1; ; attempt++)); do
        status=0
        # Besides the printed options: no ~/.ssh/config, no other keys from an agent (each costs
        # an authentication attempt), and no prompt.
        output="$(timeout "$SSH_TIMEOUT" ssh -F /dev/null -o IdentitiesOnly=yes -o BatchMode=yes \
            -o ConnectTimeout=15 "${options[@]}" "$SESSION_NAME@127.0.0.1" "$remote" 2>&1)" ||
            status=$?
        # The gateway closes connections before the SSH banner until it has fetched the
        # institute allowlist from the manager, which it does right after it starts listening.
        if ((status == 0 || attempt >= SSH_ATTEMPTS)) || [[ "$output" != *kex_exchange_identification* ]]; then
            break
        fi
        info "(the gateway has no allowlist yet: trying again in a second)"
        sleep 1
    done
    printf '%s\n' "$output" | sed 's/^/    /'
    if ((status != 0)); then
        printf '\n--- last lines of %s ---\n' "$QS/agent.log" >&2
        tail -n 10 "$QS/agent.log" >&2 || true
        fail_with_log gateway "ssh through ongrid-gateway to session $SESSION_NAME failed (exit code $status, its output is above)"
    fi
}

# How to reach the session by ssh: the command, and a ~/.ssh/config entry.
print_ssh_access() {
    local ssh_port="$1" options
    mapfile -t options < <(ssh_options "$ssh_port")
    info "  ssh ${options[*]} $SESSION_NAME@127.0.0.1"
    cat <<EOF

    Or put this in ~/.ssh/config and run ssh ongrid-$SESSION_NAME (scp, sftp, rsync and
    VS Code Remote-SSH use it too):
      Host ongrid-$SESSION_NAME
          HostName 127.0.0.1
          Port $ssh_port
          User $SESSION_NAME
          IdentityFile $REPO_ROOT/$SSH_KEY
          IdentitiesOnly yes
          UserKnownHostsFile $REPO_ROOT/$KNOWN_HOSTS
          StrictHostKeyChecking accept-new

    Or with docker:
EOF
}

print_usage() {
    local container="$1" ssh_port="$2" user=""
    [[ -n "$container" ]] && user="$(docker inspect --format '{{.Config.User}}' "$container")"
    say "ongrid is running"
    cat <<EOF
    Use devctl as the quickstart user:
      export ONGRID_DEVCTL_CONFIG=$DEVCTL_CONFIG
      $BIN_DIR/devctl whoami
      $BIN_DIR/devctl session ls
      $BIN_DIR/devctl session new --name exp2 --gpus 1 --min-capability 9.0 --wait
      $BIN_DIR/devctl session new --name slice1 --mig 1g.5gb --wait    (a MIG device)
      $BIN_DIR/devctl dashboard    (a login link to the web dashboard: it works once; the
        browser warns about the quickstart's own CA: $PKI/ca.crt)
      $BIN_DIR/devctl session web $SESSION_NAME    (JupyterLab of the session in your browser;
        --port P for a web server you started in it)
      $BIN_DIR/devctl session rm $SESSION_NAME
      $BIN_DIR/devctl key ls
    As the site admin: export ONGRID_DEVCTL_CONFIG=$DEVCTL_ADMIN_CONFIG
      $BIN_DIR/devctl admin institute ls
      $BIN_DIR/devctl admin audit --since 1h
EOF
    local variable
    for variable in "${DEVCTL_ENV_OVERRIDES[@]}"; do
        if [[ -n "${!variable:-}" ]]; then
            info "note: $variable is set in this shell and overrides devctl's config file: unset $variable"
        fi
    done
    cat <<EOF

    A shell in session $SESSION_NAME:
EOF
    print_ssh_access "$ssh_port"
    if [[ -n "$container" && -n "$user" ]]; then
        info "  docker exec -it -u ${user%%:*} $container bash"
    elif [[ -n "$container" ]]; then
        info "  docker exec -it $container bash"
    else
        info "  (no container for $SESSION_NAME yet: see devctl session ls)"
    fi
    cat <<EOF

    Simulated GPUs: edit $QS/simulated-gpus.toml (e.g. failed = "fell off the bus").
    Logs: $QS/manager.log, $QS/agent.log, $QS/gateway.log
    Stop: deploy/quickstart.sh stop      Remove everything: deploy/quickstart.sh clean
EOF
}

# ---------------------------------------------------------------------------------------------
# Commands

cmd_start() {
    say "checking prerequisites"
    check_prerequisites
    build_binaries
    build_dev_image
    umask 077
    mkdir -p "$QS" "$PKI" "$CA_DIR"
    ensure_pki

    say "SSH key of the quickstart user"
    ensure_ssh_key

    say "stopping a running quickstart, if any"
    stop_services
    local port stream_port ssh_port node container
    port="$(choose_port manager.toml listen "${MANAGER_PORTS[@]}")"
    stream_port="$(choose_port agent.toml listen "${STREAM_PORTS[@]}" "$port")"
    ssh_port="$(choose_port gateway.toml listen "${SSH_PORTS[@]}")"
    node="$(node_name)"
    write_configs "$port" "$node" "$stream_port" "$ssh_port"
    start_services "$node"
    register_ssh_key

    start_session
    container="$(session_container)"
    [[ -n "$container" ]] && remember_logins "$container"
    show_state
    check_ssh "$ssh_port"
    print_usage "$container" "$ssh_port"
}

cmd_stop() {
    say "stopping the quickstart's ongrid-gateway, ongrid-agent and ongrid-manager"
    stop_services
    info "stopped (dev containers keep running; deploy/quickstart.sh clean removes them)"
}

cmd_status() {
    local name pid
    for name in manager agent gateway; do
        if pid="$(running_pid "$name")"; then
            info "ongrid-$name: running (pid $pid)"
        else
            info "ongrid-$name: not running"
        fi
    done
    if running_pid manager >/dev/null && [[ -x "$BIN_DIR/devctl" ]]; then
        show_state
    fi
}

# The containers of sessions owned by a quickstart identity (other ongrid containers on this
# machine, e.g. of tests or a real deployment, are left alone).
quickstart_containers() {
    docker ps -a --filter label=ongrid.managed=true \
        --format '{{.Names}}\t{{.Label "ongrid.owner"}}' |
        awk -F '\t' -v base="$DN_BASE/" 'index($2, base) == 1 { print $1 }'
}

# The session and job networks the quickstart's agent made (labelled with its node name).
quickstart_networks() {
    docker network ls --filter label=ongrid.managed=true --filter "label=ongrid.node=$(node_name)" \
        --format '{{.Name}}'
}

cmd_clean() {
    check_tools
    # The agent stops last, once the containers are gone: an agent that stops with no container
    # left on its node removes its firewall rules (with containers left it keeps them, so that
    # they stay isolated). Without its manager it changes nothing meanwhile.
    say "stopping the quickstart's ongrid-gateway and ongrid-manager"
    stop_service gateway
    stop_service manager
    say "removing the quickstart's containers and home volumes"
    local container login
    for container in $(quickstart_containers); do
        remember_logins "$container"
        docker rm -f "$container" >/dev/null
        info "removed container $container"
    done
    say "stopping the quickstart's ongrid-agent (it removes its firewall rules)"
    stop_service agent
    # Each session and job had its own network; the stopped agent can no longer remove them.
    local network
    for network in $(quickstart_networks); do
        docker network rm "$network" >/dev/null && info "removed network $network"
    done
    if [[ -f "$QS/logins" ]]; then
        while read -r login; do
            if docker volume inspect "ongrid-home-$login" >/dev/null 2>&1; then
                docker volume rm "ongrid-home-$login" >/dev/null
                info "removed volume ongrid-home-$login"
            fi
            local image
            for image in $(docker image ls --format '{{.Repository}}:{{.Tag}}' "ongrid/$login/*"); do
                docker image rm -f "$image" >/dev/null && info "removed frozen image $image"
            done
        done <"$QS/logins"
    fi
    rm -rf "$QS"
    info "removed $QS"
}

main() {
    cd "$REPO_ROOT"
    case "${1:-start}" in
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    clean) cmd_clean ;;
    -h | --help | help) usage ;;
    *)
        usage >&2
        printf '\nerror: unknown command %s\n' "'$1'" >&2
        exit 2
        ;;
    esac
}

# Sourcing the script (for tests) defines the functions without running anything.
if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
    main "$@"
fi
