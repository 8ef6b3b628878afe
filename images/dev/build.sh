#!/usr/bin/env bash
# Builds the ongrid dev image `ongrid/dev:latest` without any container registry:
# debootstrap a minimal Debian bookworm from this machine's Debian mirror, add the packages of
# packages.txt, install JupyterLab from PyPI (jupyter-requirements.txt, hash-checked) into the venv
# /opt/ongrid/jupyter and its launcher as /usr/local/bin/ongrid-jupyter, and `docker import` the
# root filesystem.
#
# The image is cached by tag: the recipe hash (sha256 of this script, packages.txt,
# jupyter-requirements.txt and ongrid-jupyter) names it `ongrid/dev:<hash12>`; when that tag
# exists nothing is rebuilt.
#
# Usage: images/dev/build.sh [--force|--check]
#   --force   rebuild even when the image of this recipe exists
#   --check   only check, quickly, that the image exists or can be built here (exit 1 with the
#             cause otherwise); deploy/quickstart.sh runs it before its long cargo build
# Environment:
#   ONGRID_DEBIAN_MIRROR   Debian mirror to debootstrap from (default: the machine's apt mirror,
#                          else http://deb.debian.org/debian)
#   TMPDIR                 where the root filesystem is assembled (default /var/tmp)
#   PIP_INDEX_URL          a PyPI mirror for the JupyterLab install (default: pypi.org);
#                          http_proxy, https_proxy and no_proxy reach pip as well
#   PIP_CERT               CA bundle pip trusts (default: this machine's
#                          /etc/ssl/certs/ca-certificates.crt, so a TLS-inspecting proxy that this
#                          machine trusts is trusted by the build too)
#
# Needs: root (debootstrap, chroot), debootstrap, a reachable Docker daemon, HTTPS access to PyPI.
set -euo pipefail

readonly IMAGE=ongrid/dev
readonly SUITE=bookworm
readonly DEFAULT_MIRROR=http://deb.debian.org/debian
# C.UTF-8 is built into Debian's libc, so the image needs no `locales` package for it.
readonly IMAGE_ENV_LANG=C.UTF-8
readonly IMAGE_ENV_PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
readonly SCRIPT_DIR
readonly PACKAGE_FILE="$SCRIPT_DIR/packages.txt"
readonly JUPYTER_REQUIREMENTS="$SCRIPT_DIR/jupyter-requirements.txt"
readonly JUPYTER_LAUNCHER="$SCRIPT_DIR/ongrid-jupyter"
# JupyterLab's settings for every user of the image: it never asks to fetch news or check for
# updates, and has no extension manager (each would reach out of the site from the session).
readonly JUPYTER_OVERRIDES="$SCRIPT_DIR/jupyter-overrides.json"
# Where the image has JupyterLab; ongrid-jupyter and Dockerfile.cuda name the same path.
readonly JUPYTER_VENV=/opt/ongrid/jupyter
WORK_DIR=""

say() { printf '==> [%3ds] %s\n' "$SECONDS" "$*"; }
die() {
    printf 'error: %s\n' "$*" >&2
    exit 1
}

# The packages of packages.txt, comments and blank lines dropped, one per line.
package_list() {
    sed -e 's/#.*//' -e 's/[[:space:]]//g' "$PACKAGE_FILE" | grep -v '^$'
}

# sha256 of this script, the package list, the JupyterLab requirements and the launcher:
# changing any of them makes a new image.
recipe_hash() {
    { cat "${BASH_SOURCE[0]}"; package_list; cat "$JUPYTER_REQUIREMENTS" "$JUPYTER_LAUNCHER" "$JUPYTER_OVERRIDES"; } |
        sha256sum | cut -c1-12
}

image_exists() {
    docker image inspect "$1" >/dev/null 2>&1
}

image_id() {
    docker image inspect --format '{{.Id}}' "$1"
}

# The first Debian mirror apt on this machine uses for the main archive (not security).
machine_mirror() {
    local uri=""
    if [[ -r /etc/apt/sources.list.d/debian.sources ]]; then
        # deb822: take the URIs of the first stanza that is not the security archive.
        uri="$(awk '
            /^URIs:/ { for (i = 2; i <= NF; i++) if ($i !~ /security/) { print $i; exit } }
        ' /etc/apt/sources.list.d/debian.sources)"
    fi
    if [[ -z "$uri" && -r /etc/apt/sources.list ]]; then
        # one-line format: deb [options] URI suite components
        uri="$(awk '
            $1 == "deb" {
                for (i = 2; i <= NF; i++) {
                    if ($i ~ /^\[/) { while ($i !~ /\]$/) i++; continue }
                    if ($i !~ /security/) print $i
                    break
                }
            }
        ' /etc/apt/sources.list | head -n1)"
    fi
    printf '%s\n' "${uri:-$DEFAULT_MIRROR}"
}

# Unmounts whatever is mounted below a directory, deepest first. debootstrap mounts proc and sys
# in the target (and bind-mounts the host's /dev inside some containers) and unmounts them when
# it succeeds; after a failure they may remain, and neither tar nor rm may walk into them.
unmount_below() {
    local mount_point
    awk -v dir="$1/" 'index($5, dir) == 1 { print $5 }' /proc/self/mountinfo |
        sort -r |
        while read -r mount_point; do
            umount -l "$mount_point" 2>/dev/null || true
        done
}

cleanup() {
    [[ -n "$WORK_DIR" && -d "$WORK_DIR" ]] || return 0
    unmount_below "$WORK_DIR"
    rm -rf --one-file-system "$WORK_DIR"
}

check_docker() {
    command -v docker >/dev/null || die "docker not found: install Docker and start its daemon"
    docker info >/dev/null 2>&1 ||
        die "cannot reach the Docker daemon (docker info failed): start it (systemctl start docker) or check DOCKER_HOST and your permissions"
}

check_can_build() {
    [[ "$(id -u)" -eq 0 ]] ||
        die "building the dev image needs root (debootstrap creates device nodes and chroots): run sudo $0"
    command -v debootstrap >/dev/null ||
        die "debootstrap not found: install it with deploy/install-packages.sh quickstart (or apt-get install debootstrap)"
    check_recipe_files
}

check_recipe_files() {
    local file
    for file in "$PACKAGE_FILE" "$JUPYTER_REQUIREMENTS" "$JUPYTER_LAUNCHER"; do
        [[ -r "$file" ]] || die "$file not found: it is part of the image recipe, restore it from git"
    done
}

# Removes what an image does not need: downloaded packages, apt lists, logs, translations and
# documentation (the copyright files stay), the build host's name and resolver (Docker provides
# both at run time).
slim_rootfs() {
    local rootfs="$1"
    find "$rootfs/usr/share/doc" -xdev -type f ! -name copyright -delete
    find "$rootfs/usr/share/doc" -xdev -mindepth 1 -type d -empty -delete
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb \
        "$rootfs"/var/cache/apt/*.bin \
        "$rootfs"/var/lib/apt/lists/* \
        "$rootfs"/var/log/* \
        "$rootfs"/usr/share/locale/* \
        "$rootfs"/usr/share/man/* \
        "$rootfs"/usr/share/info/* \
        "$rootfs"/var/cache/debconf/*-old \
        "$rootfs"/tmp/* "$rootfs"/var/tmp/*
    rm -f "$rootfs/etc/hostname" "$rootfs/etc/resolv.conf"
    : >"$rootfs/etc/machine-id"
}

# Installs JupyterLab into the venv $JUPYTER_VENV of the root filesystem (pip in a chroot,
# every package hash-checked) and the launcher ongrid-jupyter. The venv sees the image's system
# packages (--system-site-packages), so its kernel can import what researchers apt-get install.
install_jupyter() {
    local rootfs="$1" started=$SECONDS name
    local ca_bundle="${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}"
    local -a env=(PATH="$IMAGE_ENV_PATH" LANG="$IMAGE_ENV_LANG" HOME=/root
        PIP_CERT=/tmp/build-ca-certificates.crt)
    for name in PIP_INDEX_URL http_proxy https_proxy no_proxy HTTP_PROXY HTTPS_PROXY NO_PROXY; do
        if [[ -n "${!name:-}" ]]; then
            env+=("$name=${!name}")
        fi
    done

    # pip resolves pypi.org inside the chroot; slim_rootfs removes this resolver again.
    rm -f "$rootfs/etc/resolv.conf"
    cp -L /etc/resolv.conf "$rootfs/etc/resolv.conf"
    install -m 0644 "$JUPYTER_REQUIREMENTS" "$rootfs/tmp/jupyter-requirements.txt"
    # The build trusts the CAs this machine trusts; the image keeps its own (slim_rootfs empties /tmp).
    [[ -r "$ca_bundle" ]] || die "CA bundle $ca_bundle not found: install ca-certificates or set PIP_CERT"
    install -m 0644 "$ca_bundle" "$rootfs/tmp/build-ca-certificates.crt"
    mount -t proc proc "$rootfs/proc"
    mount --bind /dev "$rootfs/dev"

    say "installing JupyterLab into $JUPYTER_VENV (pip, hash-checked)"
    if ! (
        umask 022
        chroot "$rootfs" /usr/bin/env -i "${env[@]}" \
            /usr/bin/python3 -m venv --system-site-packages "$JUPYTER_VENV" &&
            chroot "$rootfs" /usr/bin/env -i "${env[@]}" \
                "$JUPYTER_VENV/bin/pip" install --no-cache-dir --disable-pip-version-check \
                --require-hashes -r /tmp/jupyter-requirements.txt
    ) >"$WORK_DIR/pip.log" 2>&1; then
        tail -n 30 "$WORK_DIR/pip.log" >&2
        die "installing JupyterLab failed (log above): check that pypi.org is reachable (or set PIP_INDEX_URL, https_proxy); a hash mismatch means jupyter-requirements.txt needs regenerating"
    fi
    unmount_below "$rootfs"
    say "JupyterLab installed in $((SECONDS - started))s ($(du -sh "$rootfs$JUPYTER_VENV" | cut -f1))"

    install -m 0755 "$JUPYTER_LAUNCHER" "$rootfs/usr/local/bin/ongrid-jupyter"
    install -D -m 0644 "$JUPYTER_OVERRIDES" \
        "$rootfs$JUPYTER_VENV/share/jupyter/lab/settings/overrides.json"
}

build_image() {
    local hash="$1" mirror packages rootfs started
    mirror="${ONGRID_DEBIAN_MIRROR:-$(machine_mirror)}"
    packages="$(package_list | paste -sd, -)"
    WORK_DIR="$(mktemp -d "${TMPDIR:-/var/tmp}/ongrid-dev-image.XXXXXX")"
    rootfs="$WORK_DIR/rootfs"
    started=$SECONDS

    say "debootstrap --variant=minbase $SUITE from $mirror"
    say "packages: $packages"
    if ! debootstrap --variant=minbase --include="$packages" "$SUITE" "$rootfs" "$mirror" \
        >"$WORK_DIR/debootstrap.log" 2>&1; then
        tail -n 30 "$WORK_DIR/debootstrap.log" >&2
        [[ -f "$rootfs/debootstrap/debootstrap.log" ]] &&
            tail -n 30 "$rootfs/debootstrap/debootstrap.log" >&2
        die "debootstrap failed (log above): check that $mirror is reachable, or set ONGRID_DEBIAN_MIRROR"
    fi
    say "debootstrap done in $((SECONDS - started))s"

    unmount_below "$rootfs"
    install_jupyter "$rootfs"
    slim_rootfs "$rootfs"

    say "importing the root filesystem as $IMAGE:$hash"
    tar -C "$rootfs" --numeric-owner --xattrs \
        --exclude='./dev/*' --exclude='./proc/*' --exclude='./sys/*' -cf - . |
        docker import \
            --change 'CMD ["/bin/bash"]' \
            --change "ENV LANG=$IMAGE_ENV_LANG" \
            --change "ENV PATH=$IMAGE_ENV_PATH" \
            --change "LABEL org.ongrid.recipe=$hash" \
            --change "LABEL org.ongrid.base=debian-$SUITE" \
            --message "ongrid dev image, recipe $hash" \
            - "$IMAGE:$hash" >/dev/null
    retag_latest "$hash"
    say "built $IMAGE:latest = $IMAGE:$hash ($(docker image inspect --format '{{.Size}}' "$IMAGE:$hash" | numfmt --to=iec)) in $((SECONDS - started))s"
}

# Points `latest` at the image of this recipe and drops the tags of earlier recipes (an image a
# container still uses stays until that container is removed).
retag_latest() {
    local hash="$1" tag
    docker tag "$IMAGE:$hash" "$IMAGE:latest"
    for tag in $(docker image ls --format '{{.Tag}}' "$IMAGE"); do
        if [[ "$tag" =~ ^[0-9a-f]{12}$ && "$tag" != "$hash" ]]; then
            docker image rm "$IMAGE:$tag" >/dev/null 2>&1 || true
        fi
    done
}

# True (and `latest` points at it) when the image of this recipe exists.
up_to_date() {
    local hash="$1"
    image_exists "$IMAGE:$hash" || return 1
    if ! image_exists "$IMAGE:latest" || [[ "$(image_id "$IMAGE:latest")" != "$(image_id "$IMAGE:$hash")" ]]; then
        retag_latest "$hash"
        say "tagged $IMAGE:$hash as $IMAGE:latest"
    fi
    say "$IMAGE:latest is up to date (recipe $hash)"
}

main() {
    local force=false lock_fd
    case "${1:-}" in
    "") ;;
    --force) force=true ;;
    --check)
        check_docker
        check_recipe_files
        up_to_date "$(recipe_hash)" >/dev/null && return 0
        check_can_build
        return 0
        ;;
    -h | --help)
        sed -n '2,26p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
        return 0
        ;;
    *) die "unknown argument '$1' (usage: $0 [--force|--check])" ;;
    esac

    check_docker
    check_recipe_files
    local hash
    hash="$(recipe_hash)"
    if ! $force && up_to_date "$hash"; then
        return 0
    fi

    check_can_build
    # One build at a time on this machine; a build that waited for another may find it done.
    exec {lock_fd}>"${TMPDIR:-/var/tmp}/ongrid-dev-image.lock"
    if ! flock -n "$lock_fd"; then
        say "another build of $IMAGE is running: waiting for it"
        flock "$lock_fd"
        if ! $force && up_to_date "$hash"; then
            return 0
        fi
    fi
    trap cleanup EXIT
    trap 'exit 130' INT TERM
    say "building $IMAGE:latest (recipe $hash)"
    build_image "$hash"
}

main "$@"
