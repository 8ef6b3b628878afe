#!/usr/bin/env bash
# Checks the agent's GPU code against this machine's real NVIDIA GPUs, in one go, with binaries
# built beforehand elsewhere and no network. Each step prints one line, PASS, FAIL or SKIPPED,
# with the reason:
#
#   agent        the ongrid-agent binary runs and has the check commands
#   nvidia-smi   nvidia-smi answers
#   gpus         the agent's nvidia-smi backend lists the GPUs nvidia-smi lists
#   discovery    per GPU: UUID, model, compute capability, memory, driver, PCI bus and MIG mode
#                as the agent discovers them (`ongrid-agent gpus`) equal what the script reads
#                from `nvidia-smi --query-gpu` itself
#   mig-support  per GPU: nvidia-smi says it can do MIG exactly when ongrid knows its profiles
#   health       per GPU: the agent's health equals what the script sees: nvidia-smi reaching
#                the GPU, no fatal Xid for it in the kernel log
#   container    with Docker and the NVIDIA container toolkit: a dev container made by the
#                agent's Docker runtime on one GPU sees that GPU and nothing else (nvidia-smi -L)
#   mig          only with --allow-mig-changes, on a GPU that can do MIG, that nothing runs on,
#                and that has no MIG devices: a small layout made by GPU UUID through the agent
#                (`ongrid-agent mig`), its devices listed (mig-devices), a container on one of
#                them (mig-container), and the GPU put back in its original MIG mode
#                (mig-restore) whatever happens: a failing step, an interrupt, SIGTERM
#
# Usage: scripts/gpu-check.sh [options]
#   --agent PATH          ongrid-agent (default: target/release/ongrid-agent of this checkout)
#   --nvidia-smi PATH     nvidia-smi (default: the first on PATH)
#   --kernel-log PATH     where Xid errors are read (default /dev/kmsg)
#   --gpu UUID            the GPU for the container and MIG steps (default: the first fit)
#   --allow-mig-changes   let the check change MIG mode (needs root; nothing may run on the GPU)
#   --mig-layout LAYOUT   the layout to make (default: one instance of the model's smallest
#                         profile, e.g. 1g.18gb*1 on an H200)
#   --image IMAGE         a local image with sh and sleep for the containers (nothing is pulled;
#                         default: the first of ongrid/dev:latest, ubuntu, debian present)
#   --docker PATH         the docker CLI (default: docker)
#   --record DIR          save the raw nvidia-smi outputs seen (fixture names, see below)
#   --record-name NAME    their name (default from the model: h200, h100-80gb-hbm3x8, ...)
#   --budget SECONDS      stop the checks after this long (default 200), then put MIG back
#                         (within about 2 more minutes even when nvidia-smi hangs)
#
# --record DIR holds NAME.query.csv (the agent's own query) and NAME.list.txt (nvidia-smi -L),
# named as in node-agent/tests/fixtures/nvidia-smi/, the same after the MIG layout
# (NAME-mig.*), nvidia-smi -q, the agent's JSON, what nvidia-smi -L printed in the containers,
# the kernel log's Xid lines, every nvidia-smi run of the agent with its output and exit status
# (agent-calls.tsv, agent-call-N.out/.err), and this script's output (gpu-check.txt). A
# command's stderr is FILE.stderr and its exit status FILE.status, when not empty and not 0.
#
# Nothing is compiled and nothing is pulled. Exit status: 0 when no step failed, 1 when one
# did, 2 for a usage error, 128+N after signal N.
set -uo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
readonly REPO_ROOT

# The agent's own GPU query (node-agent/src/gpu/nvidia_smi/parse.rs, Field::ALL): recorded as
# the fixtures' *.query.csv.
readonly AGENT_QUERY=uuid,name,memory.total,compute_cap,driver_version,mig.mode.current,pci.bus_id,utilization.gpu
# The script's own question, in its own order.
readonly CHECK_QUERY=index,uuid,name,compute_cap,memory.total,driver_version,pci.bus_id,mig.mode.current,mig.mode.pending
# Xids that fail a GPU, as NVIDIA's catalogue has them (the agent's list is
# node-agent/src/gpu/health.rs FATAL_XIDS; the script reads the log independently).
readonly FATAL_XIDS=" 48 61 62 63 64 74 79 92 94 95 119 120 "

AGENT="$REPO_ROOT/target/release/ongrid-agent"
NVIDIA_SMI=""
KERNEL_LOG=/dev/kmsg
GPU=""
ALLOW_MIG=0
MIG_LAYOUT=""
IMAGE=""
DOCKER=docker
RECORD_DIR=""
RECORD_NAME=""
BUDGET=200

usage() {
    sed -n '/^# Usage:/,/^#   *(within about/p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
    exit 2
}

while (($#)); do
    case "$1" in
    --agent) AGENT="${2:?--agent needs a path}" && shift ;;
    --nvidia-smi) NVIDIA_SMI="${2:?--nvidia-smi needs a path}" && shift ;;
    --kernel-log) KERNEL_LOG="${2?--kernel-log needs a path}" && shift ;;
    --gpu) GPU="${2:?--gpu needs a UUID}" && shift ;;
    --allow-mig-changes) ALLOW_MIG=1 ;;
    --mig-layout) MIG_LAYOUT="${2:?--mig-layout needs a layout}" && shift ;;
    --image) IMAGE="${2:?--image needs an image}" && shift ;;
    --docker) DOCKER="${2:?--docker needs a path}" && shift ;;
    --record) RECORD_DIR="${2:?--record needs a directory}" && shift ;;
    --record-name) RECORD_NAME="${2:?--record-name needs a name}" && shift ;;
    --budget) BUDGET="${2:?--budget needs seconds}" && shift ;;
    -h | --help) usage ;;
    *)
        printf 'gpu-check: unknown option %s\n' "$1" >&2
        usage
        ;;
    esac
    shift
done
[[ $BUDGET =~ ^[0-9]+$ ]] || {
    printf 'gpu-check: --budget %s is not a number of seconds\n' "$BUDGET" >&2
    exit 2
}
if [[ -n $RECORD_DIR ]] && ! mkdir -p "$RECORD_DIR"; then
    printf 'gpu-check: cannot make the record directory %s\n' "$RECORD_DIR" >&2
    exit 2
fi

PASSED=0 FAILED=0 SKIPPED=0
# The verdicts go to the script's own output (fd 3) even from inside a redirected command, where
# a signal's trap may run.
exec 3>&1 4>&2

# One step's verdict: `PASS step: reason`.
verdict() {
    local word=$1 step=$2 reason=$3
    case "$word" in
    PASS) PASSED=$((PASSED + 1)) ;;
    FAIL) FAILED=$((FAILED + 1)) ;;
    SKIPPED) SKIPPED=$((SKIPPED + 1)) ;;
    esac
    # One line, whatever a reason holds.
    reason=${reason//$'\n'/ }
    printf '%s %s: %s\n' "$word" "$step" "$reason" >&3
    if [[ -n $RECORD_DIR ]]; then
        printf '%s %s: %s\n' "$word" "$step" "$reason" >>"$RECORD_DIR/gpu-check.txt"
    fi
}
pass() { verdict PASS "$@"; }
fail() { verdict FAIL "$@"; }
skip() { verdict SKIPPED "$@"; }

# The last non-empty line of a file, for a failure's reason.
last_line() { grep -v '^[[:space:]]*$' "$1" 2>/dev/null | tail -n 1; }
# The agent's error in its log: the last line, without the program's name.
agent_error() {
    local line
    line=$(last_line "$1")
    printf '%s' "${line#ongrid-agent: }"
}

WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")" || exit 1
readonly WORK
SMI_TIMEOUT=30
# Container names and the home volume: unique, so only what this run made is removed.
SUFFIX="$(od -An -N4 -tx4 /dev/urandom | tr -d ' ')"
readonly NODE="gpu-check-$SUFFIX" LOGIN="gc$SUFFIX"
CONTAINERS_MADE=0
# The GPU whose MIG mode is to be put back, with its original mode and index; empty when none.
MIG_RESTORE_GPU="" MIG_ORIGINAL="" MIG_INDEX=""
WATCHDOG=""
# 128+N once signal N arrived; else the exit status follows the verdicts.
EXIT_STATUS=""

# nvidia-smi, killed when it hangs.
smi() { timeout -k 5 "$SMI_TIMEOUT" "$NVIDIA_SMI" "$@"; }

# The agent with the nvidia-smi recorder in front of nvidia-smi.
agent_gpus() {
    timeout -k 5 120 "$AGENT" gpus --nvidia-smi "$WORK/nvidia-smi" --timeout "$SMI_TIMEOUT seconds" \
        --kernel-log "$KERNEL_LOG" "$@"
}
# `ongrid-agent mig` killed after $1 seconds.
agent_mig() {
    local limit=$1
    shift
    timeout -k 5 "$limit" "$AGENT" mig --nvidia-smi "$WORK/nvidia-smi" --timeout "30 seconds" \
        --kernel-log "$KERNEL_LOG" "$@"
}

# Runs nvidia-smi, keeping its outputs under FILE (and FILE.stderr when it printed any) and its
# exit status in FILE.status; prints nothing.
smi_into() {
    local file=$1
    shift
    local status=0
    smi "$@" >"$file" 2>"$file.stderr" || status=$?
    printf '%s\n' "$status" >"$file.status"
    [[ -s $file.stderr ]] || rm -f "$file.stderr"
    return "$status"
}

# Copies FILE to the record under NAME, with what it printed on stderr (NAME.stderr) and its
# exit status (NAME.status) when there are any.
record() {
    [[ -n $RECORD_DIR ]] || return 0
    cp "$1" "$RECORD_DIR/$2"
    if [[ -e $1.stderr ]]; then cp "$1.stderr" "$RECORD_DIR/$2.stderr"; fi
    if [[ -e $1.status && $(cat "$1.status") != 0 ]]; then cp "$1.status" "$RECORD_DIR/$2.status"; fi
}

# A wrapper in front of nvidia-smi for the agent, keeping each run's outputs and status.
write_recorder() {
    mkdir -p "$WORK/calls"
    cat >"$WORK/nvidia-smi" <<EOF
#!/bin/sh
# What the agent runs as nvidia-smi: the real one, with its outputs kept by gpu-check.sh.
n=\$(( \$(cat '$WORK/calls/count' 2>/dev/null || echo 0) + 1 ))
echo "\$n" > '$WORK/calls/count'
'$NVIDIA_SMI' "\$@" > '$WORK/calls/agent-call-'"\$n.out" 2> '$WORK/calls/agent-call-'"\$n.err"
status=\$?
printf '%s\t%s\t%s\n' "\$n" "\$status" "nvidia-smi \$*" >> '$WORK/calls/agent-calls.tsv'
cat '$WORK/calls/agent-call-'"\$n.out"
cat '$WORK/calls/agent-call-'"\$n.err" >&2
[ -s '$WORK/calls/agent-call-'"\$n.err" ] || rm -f '$WORK/calls/agent-call-'"\$n.err"
exit "\$status"
EOF
    chmod +x "$WORK/nvidia-smi"
}

# ---- the agent's view and nvidia-smi's own, read once ----

# `UUID<TAB>FIELD<TAB>VALUE` lines of `ongrid-agent gpus --format fields` in $WORK/agent.fields.
agent_field() {
    awk -F'\t' -v uuid="$1" -v field="$2" '$1 == uuid && $2 == field { print $3 }' "$WORK/agent.fields"
}

# The script's own rows, by UUID: CHECK_QUERY's cells, trimmed.
declare -A SMI_INDEX SMI_NAME SMI_CAP SMI_MEMORY SMI_DRIVER SMI_BUS SMI_MIG SMI_MIG_PENDING
SMI_GPUS=()

read_check_query() {
    local file=$1 index uuid name cap memory driver bus mig pending
    SMI_GPUS=()
    while IFS=, read -r index uuid name cap memory driver bus mig pending; do
        uuid=$(trim "$uuid")
        [[ $uuid == GPU-* ]] || continue
        SMI_GPUS+=("$uuid")
        SMI_INDEX[$uuid]=$(trim "$index")
        SMI_NAME[$uuid]=$(trim "$name")
        SMI_CAP[$uuid]=$(trim "$cap")
        SMI_MEMORY[$uuid]=$(trim "$memory")
        SMI_DRIVER[$uuid]=$(trim "$driver")
        SMI_BUS[$uuid]=$(trim "$bus")
        SMI_MIG[$uuid]=$(trim "$mig")
        SMI_MIG_PENDING[$uuid]=$(trim "$pending")
    done <"$file"
}

trim() {
    local value=$1
    value="${value#"${value%%[![:space:]]*}"}"
    printf '%s' "${value%"${value##*[![:space:]]}"}"
}

# Whether nvidia-smi printed a placeholder ([N/A], [Not Supported], ...) instead of a value.
placeholder() { [[ -z $1 || $1 == "N/A" || $1 == \[*\] ]]; }

# MIG devices of GPU $2 in an `nvidia-smi -L` output $1: `UUID PROFILE` lines.
listed_mig_devices() {
    awk -v gpu="$2" '
        /^GPU [0-9]+: / { mine = index($0, "(UUID: " gpu ")") > 0; next }
        mine && /^[[:space:]]*MIG / {
            uuid = $0; sub(/.*\(UUID: /, "", uuid); sub(/\).*/, "", uuid)
            print uuid, $2
        }' "$1"
}

# `3b:00` with its domain, as the agent's PciAddress compares them: 00000000:3B:00.0 (nvidia-smi)
# and 0000:3b:00 (the kernel log) are the same GPU.
pci_key() {
    local address=${1%.*} domain bus device
    IFS=: read -r domain bus device <<<"$address"
    [[ $domain =~ ^[0-9a-fA-F]+$ && -n $bus && -n $device ]] || return 1
    printf '%x:%s:%s' "$((16#$domain))" "${bus,,}" "${device,,}"
}

# ---- steps ----

check_agent() {
    if [[ ! -x $AGENT ]]; then
        fail agent "no executable ongrid-agent at $AGENT: build it on another machine (cargo build --release --bin ongrid-agent) and give it with --agent PATH"
        return 1
    fi
    local version
    if ! version=$("$AGENT" --version 2>&1); then
        fail agent "$AGENT --version failed: $version"
        return 1
    fi
    if ! "$AGENT" gpus --help >/dev/null 2>&1; then
        fail agent "$version at $AGENT has no \`gpus\` command: build the agent of this checkout"
        return 1
    fi
    pass agent "$version ($AGENT)"
}

check_nvidia_smi() {
    if [[ -z $NVIDIA_SMI ]]; then
        NVIDIA_SMI=$(command -v nvidia-smi) || {
            fail nvidia-smi "nvidia-smi not found on PATH: install the NVIDIA driver, or give --nvidia-smi PATH"
            return 1
        }
    fi
    if [[ ! -x $NVIDIA_SMI ]]; then
        fail nvidia-smi "$NVIDIA_SMI is not an executable file"
        return 1
    fi
    write_recorder
    if ! smi_into "$WORK/list.txt" -L; then
        fail nvidia-smi "nvidia-smi -L failed (exit status $(cat "$WORK/list.txt.status")): $(last_line "$WORK/list.txt.stderr")$(last_line "$WORK/list.txt")"
        record "$WORK/list.txt" "${RECORD_NAME:-gpu-check}.list.txt"
        return 1
    fi
    local status=0
    smi_into "$WORK/check.csv" "--query-gpu=$CHECK_QUERY" --format=csv,noheader,nounits || status=$?
    if ((status != 0)); then
        fail nvidia-smi "nvidia-smi --query-gpu=$CHECK_QUERY failed (exit status $status): $(last_line "$WORK/check.csv.stderr")$(last_line "$WORK/check.csv")"
        return 1
    fi
    read_check_query "$WORK/check.csv"
    if ((${#SMI_GPUS[@]} == 0)); then
        fail nvidia-smi "nvidia-smi lists no GPU: $(last_line "$WORK/list.txt")"
        return 1
    fi
    local first=${SMI_GPUS[0]}
    if [[ -z $RECORD_NAME ]]; then
        RECORD_NAME=$(model_slug "${SMI_NAME[$first]}")
        if ((${#SMI_GPUS[@]} > 1)); then RECORD_NAME+="x${#SMI_GPUS[@]}"; fi
    fi
    smi_into "$WORK/query.csv" "--query-gpu=$AGENT_QUERY" --format=csv,noheader,nounits
    smi_into "$WORK/q.txt" -q
    record "$WORK/query.csv" "$RECORD_NAME.query.csv"
    record "$WORK/list.txt" "$RECORD_NAME.list.txt"
    record "$WORK/check.csv" "$RECORD_NAME.check-query.csv"
    record "$WORK/q.txt" "$RECORD_NAME.q.txt"
    pass nvidia-smi "$NVIDIA_SMI answers: ${#SMI_GPUS[@]} GPU(s), driver ${SMI_DRIVER[$first]}"
}

# `NVIDIA H100 80GB HBM3` -> `h100-80gb-hbm3`.
model_slug() {
    local slug=${1,,}
    slug=${slug#nvidia }
    slug=${slug#tesla }
    slug=$(printf '%s' "$slug" | tr -c 'a-z0-9' '-' | tr -s '-')
    slug=${slug#-}
    printf '%s' "${slug%-}"
}

check_discovery() {
    local status=0
    agent_gpus --format fields >"$WORK/agent.fields" 2>"$WORK/agent.log" || status=$?
    agent_gpus --format json >"$WORK/agent.json" 2>/dev/null
    record "$WORK/agent.json" "$RECORD_NAME.agent.json"
    if ((status != 0)); then
        fail gpus "ongrid-agent gpus failed (exit status $status): $(agent_error "$WORK/agent.log")"
        return 1
    fi
    local agent_uuids smi_uuids
    agent_uuids=$(awk -F'\t' '$2 == "uuid" { print $3 }' "$WORK/agent.fields" | sort)
    smi_uuids=$(printf '%s\n' "${SMI_GPUS[@]}" | sort)
    if [[ $agent_uuids == "$smi_uuids" ]]; then
        pass gpus "the agent lists the ${#SMI_GPUS[@]} GPU(s) nvidia-smi lists"
    else
        fail gpus "the agent lists [$(echo "$agent_uuids" | tr '\n' ' ')], nvidia-smi [$(echo "$smi_uuids" | tr '\n' ' ')]"
    fi
    local uuid
    for uuid in "${SMI_GPUS[@]}"; do
        compare_gpu "$uuid"
        compare_mig_support "$uuid"
    done
}

# Field by field: the agent's value, nvidia-smi's, and where they differ.
compare_gpu() {
    local uuid=$1 differ=() compared=()
    if [[ -z $(agent_field "$uuid" uuid) ]]; then
        fail "discovery $uuid" "nvidia-smi lists it (${SMI_NAME[$uuid]}), the agent does not"
        return
    fi
    same() {
        local what=$1 agent=$2 smi=$3
        if placeholder "$smi"; then
            compared+=("$what not said by nvidia-smi ($smi)")
        elif [[ $agent == "$smi" ]]; then
            compared+=("$what $agent")
        else
            differ+=("$what: agent $agent, nvidia-smi $smi")
        fi
    }
    same model "$(agent_field "$uuid" model)" "${SMI_NAME[$uuid]}"
    same "compute capability" "$(agent_field "$uuid" compute_capability)" "${SMI_CAP[$uuid]}"
    same "memory MiB" "$(agent_field "$uuid" memory_mib)" "${SMI_MEMORY[$uuid]}"
    same driver "$(agent_field "$uuid" driver_version)" "${SMI_DRIVER[$uuid]}"
    same "PCI bus" "$(agent_field "$uuid" pci_bus_id)" "${SMI_BUS[$uuid]}"
    local mig=${SMI_MIG[$uuid]} enabled=false mig_word
    [[ $mig == Enabled ]] && enabled=true
    if placeholder "$mig"; then mig_word=false; else mig_word=$enabled; fi
    same "MIG enabled" "$(agent_field "$uuid" mig_enabled)" "$mig_word"
    if ((${#differ[@]})); then
        fail "discovery $uuid" "$(join_by '; ' "${differ[@]}")"
    else
        pass "discovery $uuid" "$(join_by ', ' "${compared[@]}")"
    fi
}

join_by() {
    local separator=$1 first=$2
    shift 2
    printf '%s' "$first" "${@/#/$separator}"
}

compare_mig_support() {
    local uuid=$1
    local mig=${SMI_MIG[$uuid]} known
    known=$(agent_field "$uuid" mig_model)
    [[ -n $known ]] || return 0
    local model=${SMI_NAME[$uuid]}
    if placeholder "$mig" && [[ $known == - ]]; then
        pass "mig-support $uuid" "no MIG (nvidia-smi's MIG mode is $mig), and ongrid offers none for $model"
    elif ! placeholder "$mig" && [[ $known != - ]]; then
        pass "mig-support $uuid" "MIG capable (mode $mig), and ongrid knows the profiles of $model ($known)"
    elif placeholder "$mig"; then
        fail "mig-support $uuid" "ongrid offers the MIG profiles of $known for $model, but nvidia-smi says MIG is not supported ($mig): core/src/mig.rs MigModel::of matches this model wrongly"
    else
        fail "mig-support $uuid" "nvidia-smi says $model can do MIG (mode $mig), but ongrid knows no MIG profiles for it (core/src/mig.rs MigModel): an admin cannot give it a mig: layout"
    fi
}

# The kernel log's Xid lines, in $WORK/xid.txt; returns 1 when the log cannot be read.
read_xids() {
    : >"$WORK/xid.txt"
    [[ -n $KERNEL_LOG && -r $KERNEL_LOG ]] || return 1
    # /dev/kmsg blocks at its end without O_NONBLOCK; dd stops there (EAGAIN).
    timeout 10 dd if="$KERNEL_LOG" iflag=nonblock bs=65536 status=none 2>/dev/null |
        grep -a 'NVRM: Xid (PCI:' >"$WORK/xid.txt"
    record "$WORK/xid.txt" "$RECORD_NAME.xid.txt"
    return 0
}

# The PCI address in a line of nvidia-smi or the kernel log, as pci_key has it; nothing when none.
address_in() {
    local address
    address=$(grep -oE '[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}' <<<"$1" | head -n 1)
    [[ -n $address ]] && pci_key "$address"
}

check_health() {
    local log_note
    if read_xids; then
        log_note="$(wc -l <"$WORK/xid.txt") Xid line(s) in $KERNEL_LOG"
    else
        log_note="kernel log ${KERNEL_LOG:-(none)} not readable: Xids not checked"
    fi
    # Lines in which nvidia-smi says it cannot reach a GPU.
    cat "$WORK/list.txt" "$WORK/check.csv" "$WORK/list.txt.stderr" "$WORK/check.csv.stderr" 2>/dev/null |
        grep -iE 'unable to determine the device handle|gpu is lost|fallen off the bus' >"$WORK/problems.txt"
    local uuid
    for uuid in "${SMI_GPUS[@]}"; do
        local agent key line code seen=()
        agent=$(agent_field "$uuid" health)
        [[ -n $agent ]] || continue
        key=$(pci_key "${SMI_BUS[$uuid]}") || key=""
        while IFS= read -r line; do
            [[ -n $key && $(address_in "$line") == "$key" ]] || continue
            code=$(sed -n 's/.*NVRM: Xid (PCI:[^)]*): *\([0-9]*\).*/\1/p' <<<"$line")
            if [[ $FATAL_XIDS == *" $code "* ]]; then seen+=("fatal Xid $code: $line"); fi
        done <"$WORK/xid.txt"
        while IFS= read -r line; do
            local named
            named=$(address_in "$line") || named=""
            if [[ -z $named || $named == "$key" ]]; then seen+=("nvidia-smi: $line"); fi
        done <"$WORK/problems.txt"
        if ((${#seen[@]} == 0)) && [[ $agent == healthy ]]; then
            pass "health $uuid" "healthy: nvidia-smi reaches it, no fatal Xid for it ($log_note)"
        elif ((${#seen[@]} == 0)); then
            fail "health $uuid" "the agent says $agent, but nvidia-smi reaches it and the kernel log has no fatal Xid for it ($log_note)"
        elif [[ $agent == healthy ]]; then
            fail "health $uuid" "the agent says healthy, but the script sees: $(join_by '; ' "${seen[@]}")"
        else
            fail "health $uuid" "not healthy, as the agent says ($agent); the script sees: $(join_by '; ' "${seen[@]}")"
        fi
    done
}

# ---- containers ----

CONTAINER_WHY=""

# Whether a container can be given a GPU here; CONTAINER_WHY says why not.
containers_possible() {
    [[ -z $CONTAINER_WHY ]] || return 1
    if ! command -v "$DOCKER" >/dev/null 2>&1; then
        CONTAINER_WHY="docker not found ($DOCKER)"
        return 1
    fi
    local info
    if ! info=$(timeout 20 "$DOCKER" info --format '{{json .Runtimes}}' 2>&1); then
        CONTAINER_WHY="the Docker daemon does not answer: $info"
        return 1
    fi
    if ! command -v nvidia-container-runtime-hook >/dev/null 2>&1 &&
        ! command -v nvidia-container-cli >/dev/null 2>&1 && [[ $info != *nvidia* ]]; then
        CONTAINER_WHY="the NVIDIA container toolkit is not installed (no nvidia-container-runtime-hook or nvidia-container-cli, no nvidia runtime in docker info): Docker cannot give a container a GPU"
        return 1
    fi
    local candidate
    if [[ -n $IMAGE ]]; then
        if ! timeout 20 "$DOCKER" image inspect "$IMAGE" >/dev/null 2>&1; then
            CONTAINER_WHY="image $IMAGE is not on this machine (nothing is pulled): load it first (docker load)"
            return 1
        fi
    else
        for candidate in ongrid/dev:latest ubuntu:24.04 ubuntu:22.04 ubuntu:latest debian:12 debian:latest; do
            if timeout 20 "$DOCKER" image inspect "$candidate" >/dev/null 2>&1; then
                IMAGE=$candidate
                break
            fi
        done
        if [[ -z $IMAGE ]]; then
            CONTAINER_WHY="no image to run (nothing is pulled): give --image NAME of a local image with sh and sleep"
            return 1
        fi
    fi
}

# A dev container on device $3 (a GPU or MIG UUID) whose `nvidia-smi -L` must show GPU $4 and,
# for a MIG device, that device alone; what it printed is recorded as NAME-$2.list.txt.
container_on() {
    local step=$1 recorded=$2 device=$3 parent=$4 name status=0
    CONTAINERS_MADE=1
    name=$(timeout -k 5 120 "$AGENT" gpu-container --node "$NODE" --user "$LOGIN" --gpu "$device" \
        --image "$IMAGE" 2>"$WORK/container.log") || status=$?
    if ((status != 0)); then
        fail "$step" "the agent's Docker runtime could not start a container on $device: $(agent_error "$WORK/container.log")"
        return
    fi
    status=0
    timeout -k 5 60 "$DOCKER" exec "$name" nvidia-smi -L >"$WORK/inside.txt" 2>&1 || status=$?
    record "$WORK/inside.txt" "$RECORD_NAME-$recorded.list.txt"
    if ((status != 0)); then
        fail "$step" "nvidia-smi -L in container $name (image $IMAGE) failed (exit status $status): $(last_line "$WORK/inside.txt")"
        remove_containers
        return
    fi
    local gpus migs want_migs=""
    gpus=$(sed -n 's/^GPU [0-9]*: .* (UUID: \(GPU-[^)]*\))$/\1/p' "$WORK/inside.txt" | tr '\n' ' ')
    migs=$(sed -n 's/^[[:space:]]*MIG .*(UUID: \(MIG-[^)]*\))$/\1/p' "$WORK/inside.txt" | tr '\n' ' ')
    [[ $device == MIG-* ]] && want_migs="$device "
    if [[ $gpus == "$parent " && $migs == "$want_migs" ]]; then
        pass "$step" "container $name (image $IMAGE) sees $device and nothing else"
    else
        fail "$step" "container $name was given $device but nvidia-smi -L in it lists GPUs [${gpus% }] and MIG devices [${migs% }]"
    fi
    remove_containers
}

# Removes this run's containers (by their node label) and home volume.
remove_containers() {
    ((CONTAINERS_MADE)) || return 0
    local ids
    ids=$(timeout 30 "$DOCKER" ps -aq --filter "label=ongrid.node=$NODE" 2>/dev/null)
    if [[ -n $ids ]]; then
        # shellcheck disable=SC2086 # one word per container id
        timeout 60 "$DOCKER" rm -f -v $ids >/dev/null 2>&1
    fi
    timeout 30 "$DOCKER" volume rm -f "ongrid-home-$LOGIN" >/dev/null 2>&1
    return 0
}

check_container() {
    local uuid=${GPU:-${SMI_GPUS[0]}}
    if [[ $uuid == MIG-* ]] || [[ -z ${SMI_INDEX[$uuid]:-} ]]; then
        fail "container $uuid" "--gpu $uuid is not one of the GPUs nvidia-smi lists"
        return
    fi
    if ! containers_possible; then
        skip "container $uuid" "$CONTAINER_WHY"
        return
    fi
    container_on "container $uuid" container "$uuid" "$uuid"
}

# ---- MIG ----

# One instance of the model's smallest profile (NVIDIA's MIG user guide).
default_layout() {
    local model=${1^^} memory=$2
    case "$model" in
    *A100*) if ((memory > 50000)); then echo '1g.10gb*1'; else echo '1g.5gb*1'; fi ;;
    *A30*) echo '1g.6gb*1' ;;
    *H100*NVL* | *H100*94GB* | *H100*96GB* | *GH200*96GB*) echo '1g.12gb*1' ;;
    *H100*) echo '1g.10gb*1' ;;
    *H200*) echo '1g.18gb*1' ;;
    *B200*) echo '1g.23gb*1' ;;
    *) return 1 ;;
    esac
}

# The GPU's MIG mode as nvidia-smi says now: `CURRENT PENDING`.
mig_mode_now() {
    smi "--query-gpu=$CHECK_QUERY" --format=csv,noheader,nounits >"$WORK/mode.csv" 2>/dev/null
    read_check_query "$WORK/mode.csv"
    printf '%s %s' "${SMI_MIG[$1]:-unknown}" "${SMI_MIG_PENDING[$1]:-unknown}"
}

check_mig() {
    if ((!ALLOW_MIG)); then
        skip mig "MIG mode is changed only with --allow-mig-changes (needs root, and nothing running on the GPU)"
        return
    fi
    local uuid="" candidate
    if [[ -n $GPU ]]; then
        uuid=$GPU
        if [[ -z ${SMI_INDEX[$uuid]:-} ]]; then
            fail "mig $uuid" "--gpu $uuid is not one of the GPUs nvidia-smi lists"
            return
        fi
    else
        for candidate in "${SMI_GPUS[@]}"; do
            if ! placeholder "${SMI_MIG[$candidate]}"; then
                uuid=$candidate
                break
            fi
        done
    fi
    if [[ -z $uuid ]]; then
        skip mig "no GPU here can do MIG (nvidia-smi's mig.mode.current is not Enabled or Disabled for any)"
        return
    fi
    local mode=${SMI_MIG[$uuid]:-} pending=${SMI_MIG_PENDING[$uuid]:-}
    if placeholder "$mode"; then
        skip "mig $uuid" "nvidia-smi says this GPU cannot do MIG (MIG mode $mode)"
        return
    fi
    if [[ $mode != "$pending" ]] && ! placeholder "$pending"; then
        skip "mig $uuid" "a MIG mode change is pending (current $mode, pending $pending): reset the GPU first"
        return
    fi
    local apps
    smi --query-compute-apps=gpu_uuid,pid,process_name --format=csv,noheader >"$WORK/apps.csv" 2>&1
    apps=$(grep -F "$uuid" "$WORK/apps.csv" | tr '\n' ';')
    if [[ -n $apps ]]; then
        skip "mig $uuid" "processes run on it: ${apps%;}"
        return
    fi
    if [[ -n $(listed_mig_devices "$WORK/list.txt" "$uuid") ]]; then
        skip "mig $uuid" "it has MIG devices already; the check leaves them alone"
        return
    fi
    local layout=$MIG_LAYOUT
    if [[ -z $layout ]] && ! layout=$(default_layout "${SMI_NAME[$uuid]}" "${SMI_MEMORY[$uuid]}"); then
        skip "mig $uuid" "no default layout for ${SMI_NAME[$uuid]}: give --mig-layout"
        return
    fi

    # From here on the GPU is put back, whatever happens.
    MIG_RESTORE_GPU=$uuid MIG_ORIGINAL=$mode MIG_INDEX=${SMI_INDEX[$uuid]}
    local status=0
    agent_mig 120 --gpu "$uuid" --layout "$layout" --format fields >"$WORK/mig.fields" 2>"$WORK/mig.log" || status=$?
    if ((status != 0)); then
        fail "mig $uuid" "the agent could not make $layout: $(agent_error "$WORK/mig.log")"
        restore_mig
        return
    fi
    pass "mig $uuid" "layout $layout made by GPU UUID through the agent (MIG mode was $mode)"

    smi_into "$WORK/mig-list.txt" -L
    smi_into "$WORK/mig-query.csv" "--query-gpu=$AGENT_QUERY" --format=csv,noheader,nounits
    record "$WORK/mig-list.txt" "$RECORD_NAME-mig.list.txt"
    record "$WORK/mig-query.csv" "$RECORD_NAME-mig.query.csv"
    agent_gpus --format json >"$WORK/mig-agent.json" 2>/dev/null
    record "$WORK/mig-agent.json" "$RECORD_NAME-mig.agent.json"
    local listed reported
    listed=$(listed_mig_devices "$WORK/mig-list.txt" "$uuid" | sort)
    reported=$(awk -F'\t' -v uuid="$uuid" '$1 == uuid && $2 == "mig_device" { print $3 }' "$WORK/mig.fields" | sort)
    if [[ -z $listed ]]; then
        fail "mig-devices $uuid" "nvidia-smi -L lists no MIG device of the GPU after the layout was made"
    elif [[ $listed != "$reported" ]]; then
        fail "mig-devices $uuid" "nvidia-smi -L lists [$(echo "$listed" | tr '\n' ';')], the agent [$(echo "$reported" | tr '\n' ';')]"
    else
        pass "mig-devices $uuid" "nvidia-smi -L and the agent list the same: $(echo "$listed" | tr '\n' ';' | sed 's/;$//')"
    fi

    if [[ -z $listed ]]; then
        :
    elif containers_possible; then
        container_on mig-container mig-container "${listed%% *}" "$uuid"
    else
        skip mig-container "$CONTAINER_WHY"
    fi
    restore_mig
}

# Puts the GPU back into its original MIG mode without devices: through the agent (MIG mode
# off), else with nvidia-smi by index; says which, or what to do. Once.
restore_mig() {
    [[ -n $MIG_RESTORE_GPU ]] || return 0
    local uuid=$MIG_RESTORE_GPU how
    MIG_RESTORE_GPU=""
    # A container on a MIG device holds it.
    remove_containers
    if [[ $MIG_ORIGINAL == Disabled ]]; then
        how="the agent turned MIG mode off"
        agent_mig 60 --gpu "$uuid" --off --format fields >/dev/null 2>"$WORK/restore.log" ||
            how="the agent could not ($(agent_error "$WORK/restore.log"))"
    else
        how="nvidia-smi destroyed the instances"
        smi mig -i "$uuid" -dci >/dev/null 2>&1
        smi mig -i "$uuid" -dgi >/dev/null 2>&1
    fi
    if restored "$uuid"; then
        pass mig-restore "GPU $uuid is back in MIG mode $MIG_ORIGINAL without MIG devices ($how)"
        return
    fi
    # By index, in case the UUID is what failed.
    smi mig -i "$MIG_INDEX" -dci >/dev/null 2>&1
    smi mig -i "$MIG_INDEX" -dgi >/dev/null 2>&1
    if [[ $MIG_ORIGINAL == Disabled ]]; then
        smi -i "$MIG_INDEX" -mig 0 >"$WORK/restore-index.log" 2>&1
    fi
    if restored "$uuid"; then
        pass mig-restore "GPU $uuid is back in MIG mode $MIG_ORIGINAL without MIG devices (by index $MIG_INDEX with nvidia-smi, after: $how)"
    else
        fail mig-restore "GPU $uuid is in MIG mode $(mig_mode_now "$uuid") (current, pending), was $MIG_ORIGINAL ($how; by index: $(last_line "$WORK/restore-index.log")): put it back with nvidia-smi -i $MIG_INDEX -mig $([[ $MIG_ORIGINAL == Disabled ]] && echo 0 || echo 1), then nvidia-smi -i $MIG_INDEX --gpu-reset if it stays pending"
    fi
}

# Whether the GPU is in its original MIG mode (current and pending) with no MIG device.
restored() {
    local now
    now=$(mig_mode_now "$1")
    smi -L >"$WORK/restore-list.txt" 2>/dev/null
    [[ $now == "$MIG_ORIGINAL $MIG_ORIGINAL" || $now == "$MIG_ORIGINAL [N/A]" ]] &&
        [[ -z $(listed_mig_devices "$WORK/restore-list.txt" "$1") ]]
}

# ---- the run ----

# On every exit: the MIG mode put back, the containers removed, the verdicts counted.
cleanup() {
    # Putting things back must not be cut short by a second signal.
    trap '' INT TERM
    # A trap can run inside a command whose output goes to a file.
    exec 1>&3 2>&4
    if [[ -n $WATCHDOG ]]; then kill "$WATCHDOG" 2>/dev/null; fi
    restore_mig
    remove_containers
    if [[ -n $RECORD_DIR && -d $WORK/calls ]]; then
        cp "$WORK"/calls/agent-call* "$RECORD_DIR/" 2>/dev/null
    fi
    rm -rf "$WORK"
    printf 'gpu-check: %s passed, %s failed, %s skipped\n' "$PASSED" "$FAILED" "$SKIPPED"
    if [[ -n $EXIT_STATUS ]]; then exit "$EXIT_STATUS"; fi
    if ((FAILED > 0)); then exit 1; fi
    exit 0
}

on_signal() {
    EXIT_STATUS=$2
    if [[ -e $WORK/budget-spent ]]; then
        fail interrupted "the check took longer than its budget of $BUDGET s (--budget): putting back what it changed"
    else
        fail interrupted "SIG$1 received: putting back what the check changed"
    fi
    exit "$2"
}

trap cleanup EXIT
trap 'on_signal INT 130' INT
trap 'on_signal TERM 143' TERM
# The whole check within the budget: SIGTERM to this shell at its end. The wait is a builtin
# read's timeout, so killing the watchdog leaves no process behind.
mkfifo "$WORK/watchdog"
(
    trap - INT TERM
    read -r -t "$BUDGET" _ <>"$WORK/watchdog"
    : >"$WORK/budget-spent"
    kill -TERM "$$" 2>/dev/null
) &
WATCHDOG=$!

check_agent || exit
check_nvidia_smi || exit
if check_discovery; then
    check_health
    check_container
    check_mig
else
    skip health "the agent's discovery failed"
fi
