#!/usr/bin/env bash
# Installs the Debian packages of deploy/debian-packages.txt that are missing: the one install
# step shared by deploy/quickstart.sh and .ci/run. For `tests`, also the Python packages of
# deploy/python-requirements.txt (with Debian's python3 and pip).
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
readonly PYTHON_REQUIREMENTS="$REPO_ROOT/deploy/python-requirements.txt"

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

# python_requirements_met: whether python3 already has everything deploy/python-requirements.txt
# asks for (pip resolves it against what is installed only, downloading nothing).
python_requirements_met() {
    PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --no-index --dry-run --quiet \
        -r "$PYTHON_REQUIREMENTS" >/dev/null 2>&1
}

# install_python_requirements: the tests' Python packages, system-wide for python3. Debian marks
# its Python as externally managed (PEP 668); these packages go to /usr/local, beside Debian's,
# which is what PIP_BREAK_SYSTEM_PACKAGES allows on a test machine.
install_python_requirements() {
    [[ -r "$PYTHON_REQUIREMENTS" ]] || die "$PYTHON_REQUIREMENTS is missing: restore it from the repository"
    if python_requirements_met; then
        printf 'Python packages for tests: all installed\n'
        return 0
    fi
    local command="PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install -r $PYTHON_REQUIREMENTS"
    [[ "$(id -u)" -eq 0 ]] || die "missing Python packages of $PYTHON_REQUIREMENTS. Install them as root: sudo sh -c '$command'"
    printf '==> installing Python packages for tests: %s\n' "$PYTHON_REQUIREMENTS"
    PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --quiet -r "$PYTHON_REQUIREMENTS" ||
        die "pip install failed (output above); once the cause is fixed, run: $command"
    python_requirements_met || die "still not installed after pip install: see $PYTHON_REQUIREMENTS"
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
        [[ "$role" != tests ]] || install_python_requirements
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
    [[ "$role" != tests ]] || install_python_requirements
}

main "$@"
