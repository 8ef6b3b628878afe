#!/usr/bin/env bash
# Installs the Debian packages of deploy/debian-packages.txt that are missing: the one install
# step shared by deploy/quickstart.sh and .ci/run.
#
# Usage: deploy/install-packages.sh quickstart|tests
#   quickstart   what deploy/quickstart.sh needs to bring ongrid up on this machine
#   tests        that, and what ./scripts/test needs on top
#
# Does nothing (and needs neither root nor the network) when every package is installed. Else,
# as root on Debian, runs apt-get update and apt-get install for the missing ones; otherwise
# stops at once with the exact command to run.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
readonly REPO_ROOT
readonly PACKAGE_LIST="$REPO_ROOT/deploy/debian-packages.txt"

die() {
    printf '\nerror: %s\n' "$*" >&2
    exit 1
}

# packages_for ROLE: the package names ROLE needs, one a line (`tests` includes `quickstart`).
packages_for() {
    local role="$1"
    awk -v role="$role" '
        /^[[:space:]]*(#|$)/ { next }
        $2 == "quickstart" || (role == "tests" && $2 == "tests") { print $1 }
    ' "$PACKAGE_LIST"
}

# missing_packages NAME...: those of NAME... that dpkg does not list as installed.
missing_packages() {
    local name status
    for name in "$@"; do
        status="$(dpkg-query -W -f '${db:Status-Status}' "$name" 2>/dev/null || true)"
        [[ "$status" == installed ]] || printf '%s\n' "$name"
    done
}

main() {
    local role="${1:-}"
    case "$role" in
    quickstart | tests) ;;
    *) die "usage: $0 quickstart|tests" ;;
    esac
    [[ -r "$PACKAGE_LIST" ]] || die "$PACKAGE_LIST is missing: restore it from the repository"
    command -v dpkg-query >/dev/null ||
        die "dpkg-query not found: this script installs Debian packages; on another system install the packages listed in $PACKAGE_LIST by hand"

    local wanted=() missing=()
    mapfile -t wanted < <(packages_for "$role")
    mapfile -t missing < <(missing_packages "${wanted[@]}")
    if ((${#missing[@]} == 0)); then
        printf 'Debian packages for %s: all %d installed\n' "$role" "${#wanted[@]}"
        return 0
    fi

    local command="apt-get update && apt-get install -y --no-install-recommends ${missing[*]}"
    if [[ "$(id -u)" -ne 0 ]]; then
        die "missing Debian packages: ${missing[*]}. Install them as root: sudo sh -c '$command'"
    fi
    command -v apt-get >/dev/null ||
        die "apt-get not found: install these packages with your system's package manager: ${missing[*]}"

    printf '==> installing Debian packages for %s: %s\n' "$role" "${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q || die "apt-get update failed (output above): check the machine's apt sources and network, then run: $command"
    apt-get install -y -q --no-install-recommends --no-upgrade "${missing[@]}" ||
        die "apt-get install failed (output above); once the cause is fixed, run: $command"
    mapfile -t missing < <(missing_packages "${wanted[@]}")
    ((${#missing[@]} == 0)) || die "still not installed after apt-get install: ${missing[*]}"
}

main "$@"
