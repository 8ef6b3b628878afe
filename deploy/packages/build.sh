#!/usr/bin/env bash
# Builds the site packages of ongrid from this workspace: ongrid-manager, ongrid-agent,
# ongrid-gateway and devctl, as .deb (Debian, Ubuntu) and .rpm (Enterprise Linux 9: AlmaLinux,
# Rocky, RHEL).
#
# Usage: deploy/packages/build.sh [--format all|deb|rpm] [--profile release|dev] [--revision N]
#                                 [--out DIR] [--no-build] [--sign KEY] [--compression best|fast]
#   --format    which packages (default all): deb needs dpkg-deb and dpkg-shlibdeps (dpkg-dev),
#               rpm needs rpmbuild (rpm on Debian, rpm-build on Enterprise Linux)
#   --profile   the cargo profile of the binaries (default release; the tests package the dev
#               build they already have)
#   --revision  the package revision: 0.1.0-N for Debian, Release N for RPM (default 1)
#   --out       where the packages go (default target/packages)
#   --no-build  package the binaries already built for --profile instead of running cargo
#   --sign      sign the .rpm files with this GnuPG key (rpmsign; name or id of a key in
#               $GNUPGHOME). A .deb is not signed by itself: the repository's Release file is.
#   --compression  best (default: xz for .deb, rpmbuild's own for .rpm) or fast (gzip -1, for
#               tests)
#
# Each package holds its binary (stripped), its systemd unit (the one of deploy/systemd/, with
# the binary in /usr/bin), its example config as /etc/ongrid/<name>.toml (a config file: an
# upgrade never overwrites an edited one), its system user and state directory, the license
# and deploy/README.md. devctl holds its man pages and bash, zsh and fish completions, which it
# generates itself (`devctl manpages DIR`, `devctl completions SHELL`). A service is never
# started by the install: it needs its certificates and tokens first (deploy/README.md); an
# upgrade restarts the ones that run.
#
# The tools are the distributions' own, dpkg-deb and rpmbuild, rather than cargo-deb and
# cargo-generate-rpm: they come from apt or dnf (nothing more to compile on a build machine),
# and one description of the packages here feeds both formats, the maintainer scripts included.
# Binaries built on Debian bookworm run on Enterprise Linux 9: they need glibc 2.34 at most,
# which deploy/packages/test.sh checks.

# The maintainer scripts' own "$1" and "$2" are written in single quotes on purpose.
# shellcheck disable=SC2016
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
readonly REPO_ROOT
readonly PACKAGES=(ongrid-manager ongrid-agent ongrid-gateway devctl)
readonly LICENSE_NAME=Apache-2.0
readonly PACKAGER="${ONGRID_PACKAGER:-ongrid developers <ongrid@localhost>}"

# What each package is, in one place for both formats.
declare -A BINARY=([ongrid-manager]=ongrid-manager [ongrid-agent]=ongrid-agent
    [ongrid-gateway]=ongrid-gateway [devctl]=devctl)
declare -A CONFIG=([ongrid-manager]=manager.toml [ongrid-agent]=agent.toml
    [ongrid-gateway]=gateway.toml)
# The system user a service runs as (the agent runs as root: it drives Docker), and its home,
# which is the service's state directory.
declare -A SERVICE_USER=([ongrid-manager]=ongrid [ongrid-gateway]=ongrid-gateway)
declare -A STATE_DIR=([ongrid-manager]=/var/lib/ongrid [ongrid-gateway]=/var/lib/ongrid-gateway)
# Owner and group only (the group is the user's own), as the units' StateDirectoryMode.
readonly STATE_MODE=0750
declare -A SUMMARY=(
    [ongrid-manager]="ongrid manager: control plane of interactive GPU dev sessions"
    [ongrid-agent]="ongrid node agent: dev containers and batch jobs on a GPU node"
    [ongrid-gateway]="ongrid SSH gateway: ssh <session>@gateway into GPU dev containers"
    [devctl]="ongrid command line: GPU dev sessions, images and jobs on the grid"
)
declare -A DESCRIPTION=(
    [ongrid-manager]="The manager keeps the sessions, users, SSH keys, institutes, images and
batch jobs of an ongrid site (SQLite or PostgreSQL), schedules its GPUs and
serves the HTTPS API that devctl, the node agents and the gateways use."
    [ongrid-agent]="One agent runs on each GPU node: it discovers the GPUs (nvidia-smi), splits
them into MIG devices, runs the dev containers and batch jobs of the sessions
placed on the node with Docker, and freezes sessions into SIF images."
    [ongrid-gateway]="The SSH front door of an ongrid site: it admits connections from allowed
institutes' networks, authenticates users by the SSH keys they registered
with their grid credential, and streams every channel (shell, exec, scp,
sftp, port forwarding) into the user's container."
    [devctl]="devctl asks an ongrid site for interactive development sessions on GPUs,
registers SSH keys, freezes sessions into Apptainer images and runs them as
batch jobs, with the user's X.509 grid certificate or proxy."
)
declare -A DEB_SECTION=([ongrid-manager]=admin [ongrid-agent]=admin [ongrid-gateway]=net
    [devctl]=utils)
# Enterprise Linux no longer reads the Group tag; rpmlint still asks for one.
declare -A RPM_GROUP=([ongrid-manager]="System Environment/Daemons"
    [ongrid-agent]="System Environment/Daemons" [ongrid-gateway]="System Environment/Daemons"
    [devctl]="Applications/System")
declare -A DEB_RECOMMENDS=(
    [ongrid-agent]="docker.io | docker-ce, iptables, squashfs-tools-ng, openssh-sftp-server"
)
# Enterprise Linux names the same packages differently; Docker comes from Docker's repository.
declare -A RPM_RECOMMENDS=([ongrid-agent]="iptables-nft squashfs-tools-ng openssh-server")

FORMAT=all
PROFILE=release
REVISION=1
OUT_DIR="$REPO_ROOT/target/packages"
BUILD=1
SIGN_KEY=""
COMPRESSION=best
WORK_DIR=""

say() { printf '==> %s\n' "$*"; }
die() {
    printf 'error: %s\n' "$*" >&2
    exit 1
}
cleanup() { [[ -z "$WORK_DIR" ]] || rm -rf "$WORK_DIR"; }
trap cleanup EXIT

usage() { sed -n '2,/^$/ s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; }

parse_args() {
    while (($# > 0)); do
        case "$1" in
        --format) FORMAT="${2:?--format needs all, deb or rpm}" && shift ;;
        --profile) PROFILE="${2:?--profile needs release or dev}" && shift ;;
        --revision) REVISION="${2:?--revision needs a number}" && shift ;;
        --out) OUT_DIR="${2:?--out needs a directory}" && shift ;;
        --no-build) BUILD=0 ;;
        --sign) SIGN_KEY="${2:?--sign needs a GnuPG key name or id}" && shift ;;
        --compression) COMPRESSION="${2:?--compression needs best or fast}" && shift ;;
        -h | --help) usage && exit 0 ;;
        *) die "unknown argument '$1' (deploy/packages/build.sh --help)" ;;
        esac
        shift
    done
    [[ "$FORMAT" =~ ^(all|deb|rpm)$ ]] || die "--format $FORMAT: choose all, deb or rpm"
    [[ "$PROFILE" =~ ^(release|dev)$ ]] || die "--profile $PROFILE: choose release or dev"
    [[ "$REVISION" =~ ^[1-9][0-9]*$ ]] || die "--revision $REVISION: a number from 1"
    [[ "$COMPRESSION" =~ ^(best|fast)$ ]] || die "--compression $COMPRESSION: choose best or fast"
}

wants() { [[ "$FORMAT" == all || "$FORMAT" == "$1" ]]; }

check_tools() {
    local tool missing=()
    local tools=(strip gzip)
    ! wants deb || tools+=(dpkg-deb dpkg-shlibdeps dpkg-architecture)
    ! wants rpm || tools+=(rpmbuild)
    [[ -z "$SIGN_KEY" ]] || ! wants rpm || tools+=(rpmsign gpg)
    for tool in "${tools[@]}"; do
        command -v "$tool" >/dev/null || missing+=("$tool")
    done
    ((${#missing[@]} == 0)) ||
        die "missing ${missing[*]}: on Debian apt-get install dpkg-dev rpm binutils; on Enterprise Linux dnf install rpm-build binutils (or --format to build one kind only)"
}

# The workspace's version, from Cargo.toml's [workspace.package].
workspace_version() {
    sed -n '/^\[workspace.package\]/,/^\[/ s/^version = "\(.*\)"/\1/p' "$REPO_ROOT/Cargo.toml"
}

binary_dir() {
    local target="${CARGO_TARGET_DIR:-$REPO_ROOT/target}"
    if [[ "$PROFILE" == dev ]]; then printf '%s/debug' "$target"; else printf '%s/release' "$target"; fi
}

build_binaries() {
    if ((BUILD)); then
        say "cargo build --profile $PROFILE --bins --locked"
        (cd "$REPO_ROOT" && cargo build --profile "$PROFILE" --workspace --bins --locked) ||
            die "cargo build failed (output above)"
    fi
    local package
    for package in "${PACKAGES[@]}"; do
        [[ -x "$(binary_dir)/${BINARY[$package]}" ]] ||
            die "no $(binary_dir)/${BINARY[$package]}: build it (drop --no-build) or choose the --profile it was built with"
    done
}

# ---------------------------------------------------------------------------------------------
# The files of a package, laid out under a root as they are installed

# stage PACKAGE ROOT FORMAT: the package's files under ROOT (FORMAT deb or rpm: where systemd
# units and zsh completions go differs).
stage() {
    local package="$1" root="$2" format="$3" unit_dir zsh_dir
    if [[ "$format" == deb ]]; then
        unit_dir=/lib/systemd/system zsh_dir=/usr/share/zsh/vendor-completions
    else
        unit_dir=/usr/lib/systemd/system zsh_dir=/usr/share/zsh/site-functions
    fi
    local binary="${BINARY[$package]}"
    install -D -m 0755 "$(binary_dir)/$binary" "$root/usr/bin/$binary"
    strip --strip-unneeded "$root/usr/bin/$binary"
    install -D -m 0644 "$REPO_ROOT/LICENSE" "$root/usr/share/doc/$package/LICENSE"
    install -D -m 0644 "$REPO_ROOT/deploy/README.md" "$root/usr/share/doc/$package/README.md"
    if [[ -n "${CONFIG[$package]:-}" ]]; then
        install -D -m 0644 "$REPO_ROOT/deploy/examples/${CONFIG[$package]}" \
            "$root/etc/ongrid/${CONFIG[$package]}"
        sed 's#/usr/local/bin/#/usr/bin/#g' "$REPO_ROOT/deploy/systemd/$package.service" |
            install -D -m 0644 /dev/stdin "$root$unit_dir/$package.service"
    fi
    # dpkg owns the state directory (its postinst gives it to the user); rpm does not, since
    # rpmlint allows packaged directories no other mode than 0755: %pre makes it.
    [[ "$format" != deb || -z "${STATE_DIR[$package]:-}" ]] || install -d "$root${STATE_DIR[$package]}"
    if [[ "$package" == ongrid-agent ]]; then
        install -D -m 0644 "$REPO_ROOT/deploy/examples/simulated-gpus.toml" \
            "$root/usr/share/doc/$package/examples/simulated-gpus.toml"
    fi
    if [[ "$package" == devctl ]]; then
        local devctl="$root/usr/bin/devctl"
        "$devctl" manpages "$root/usr/share/man/man1" >/dev/null
        gzip -9n "$root"/usr/share/man/man1/*.1
        install -d "$root/usr/share/bash-completion/completions" "$root$zsh_dir" \
            "$root/usr/share/fish/vendor_completions.d"
        "$devctl" completions bash >"$root/usr/share/bash-completion/completions/devctl"
        "$devctl" completions zsh >"$root$zsh_dir/_devctl"
        "$devctl" completions fish >"$root/usr/share/fish/vendor_completions.d/devctl.fish"
    fi
}

# ---------------------------------------------------------------------------------------------
# Maintainer scripts: the same shell in both formats

# The service's system user and state directory, made when missing.
make_user_script() {
    local package="$1" user="${SERVICE_USER[$1]:-}"
    [[ -n "$user" ]] || return 0
    cat <<EOF
if ! getent passwd $user >/dev/null; then
    useradd --system --user-group --home-dir ${STATE_DIR[$package]} --no-create-home \\
        --shell /usr/sbin/nologin --comment "$package" $user
fi
install -d -o $user -g $user -m $STATE_MODE ${STATE_DIR[$package]}
EOF
}

# After an install or upgrade: systemd learns of the unit; an upgrade restarts a running service
# (UPGRADE is the shell test that is true on an upgrade).
unit_installed_script() {
    local package="$1" upgrade="$2"
    [[ -n "${CONFIG[$package]:-}" ]] || return 0
    cat <<EOF
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload >/dev/null 2>&1 || true
    if $upgrade; then
        systemctl try-restart $package.service >/dev/null 2>&1 || true
    fi
fi
EOF
}

# After the unit file was removed or changed.
unit_reload_script() {
    [[ -z "${CONFIG[$1]:-}" ]] || printf 'if [ -d /run/systemd/system ]; then\n    systemctl daemon-reload >/dev/null 2>&1 || true\nfi\n'
}

# when CONDITION BODY: BODY run only when the shell test CONDITION holds; nothing when BODY is
# empty.
when() {
    local condition="$1" body="$2"
    [[ -n "$body" ]] || return 0
    if [[ "$condition" == true ]]; then
        printf '%s\n' "$body"
    else
        printf 'if %s; then\n%s\nfi\n' "$condition" "$(printf '%s\n' "$body" | sed 's/^/    /')"
    fi
}

# Before the package is removed for good: the service stops and is disabled.
unit_removed_script() {
    local package="$1"
    [[ -n "${CONFIG[$package]:-}" ]] || return 0
    cat <<EOF
if [ -d /run/systemd/system ]; then
    systemctl --no-reload disable --now $package.service >/dev/null 2>&1 || true
fi
EOF
}

# ---------------------------------------------------------------------------------------------
# .deb

# The Depends of the binaries under ROOT, as dpkg-shlibdeps finds them (it needs a
# debian/control to run in).
shared_library_depends() {
    local root="$1" dir
    dir="$(mktemp -d "$WORK_DIR/shlibdeps.XXXXXX")"
    mkdir "$dir/debian"
    printf 'Source: ongrid\n\nPackage: ongrid\nArchitecture: any\n' >"$dir/debian/control"
    (cd "$dir" && dpkg-shlibdeps -O "$root"/usr/bin/*) | sed -n 's/^shlibs:Depends=//p'
}

# maintainer_script FILE BODY: a Debian maintainer script, or none when BODY is empty.
maintainer_script() {
    local file="$1" body="$2"
    [[ -n "$body" ]] || return 0
    printf '#!/bin/sh\nset -e\n%s\n' "$body" >"$file"
    chmod 0755 "$file"
}

build_deb() {
    local package="$1" version="$2" arch root depends
    arch="$(dpkg-architecture -qDEB_HOST_ARCH)"
    root="$WORK_DIR/deb/$package"
    stage "$package" "$root" deb
    mkdir -p "$root/DEBIAN"
    depends="$(shared_library_depends "$root")"
    [[ -z "${SERVICE_USER[$package]:-}" ]] || depends+=", passwd"
    {
        printf 'Package: %s\nVersion: %s-%s\nArchitecture: %s\n' "$package" "$version" "$REVISION" "$arch"
        printf 'Maintainer: %s\nSection: %s\nPriority: optional\n' "$PACKAGER" "${DEB_SECTION[$package]}"
        printf 'Installed-Size: %s\nDepends: %s\n' "$(du -sk --exclude=DEBIAN "$root" | cut -f1)" "$depends"
        [[ -z "${DEB_RECOMMENDS[$package]:-}" ]] || printf 'Recommends: %s\n' "${DEB_RECOMMENDS[$package]}"
        printf 'Description: %s\n' "${SUMMARY[$package]}"
        printf '%s\n' "${DESCRIPTION[$package]}" | sed 's/^/ /'
    } >"$root/DEBIAN/control"
    [[ -z "${CONFIG[$package]:-}" ]] || printf '/etc/ongrid/%s\n' "${CONFIG[$package]}" >"$root/DEBIAN/conffiles"
    maintainer_script "$root/DEBIAN/postinst" "$(when '[ "$1" = configure ]' "$(
        make_user_script "$package"
        unit_installed_script "$package" '[ -n "$2" ]'
    )")"
    maintainer_script "$root/DEBIAN/prerm" "$(when '[ "$1" = remove ]' "$(unit_removed_script "$package")")"
    maintainer_script "$root/DEBIAN/postrm" "$(when true "$(unit_reload_script "$package")")"
    local compression=(-Zxz)
    [[ "$COMPRESSION" == best ]] || compression=(-Zgzip -z1)
    dpkg-deb --root-owner-group "${compression[@]}" --build "$root" \
        "$OUT_DIR/${package}_${version}-${REVISION}_${arch}.deb" >/dev/null
    say "$OUT_DIR/${package}_${version}-${REVISION}_${arch}.deb"
}

# ---------------------------------------------------------------------------------------------
# .rpm

# The %files list of the staged ROOT: configs kept on upgrade, the license and docs marked.
rpm_files() {
    local package="$1" root="$2" path
    (cd "$root" && find . -type f | sed 's#^\.##' | sort) | while read -r path; do
        case "$path" in
        /etc/*) printf '%%config(noreplace) %s\n' "$path" ;;
        */LICENSE) printf '%%license %s\n' "$path" ;;
        /usr/share/doc/*) printf '%%doc %s\n' "$path" ;;
        *) printf '%s\n' "$path" ;;
        esac
    done
    [[ -z "${CONFIG[$package]:-}" ]] || printf '%%dir /etc/ongrid\n'
    [[ "$package" != devctl ]] || printf '%%dir /usr/share/fish\n%%dir /usr/share/fish/vendor_completions.d\n'
}

# The spec of PACKAGE: the staged files are copied in as they are (the binaries are built and
# stripped already, so there is no debuginfo package and no post-install processing).
rpm_spec() {
    local package="$1" version="$2" root="$3"
    cat <<EOF
%global debug_package %{nil}
%global __os_install_post %{nil}
%global _build_id_links none

Name: $package
Version: $version
Release: $REVISION
Summary: ${SUMMARY[$package]}
License: $LICENSE_NAME
Group: ${RPM_GROUP[$package]}
Packager: $PACKAGER
EOF
    if [[ -n "${SERVICE_USER[$package]:-}" ]]; then
        printf 'Requires(pre): shadow-utils\n'
    fi
    local recommend
    for recommend in ${RPM_RECOMMENDS[$package]:-}; do
        printf 'Recommends: %s\n' "$recommend"
    done
    cat <<EOF

%description
${DESCRIPTION[$package]}

%prep

%build

%install
cp -a $root/. %{buildroot}/

%files
$(rpm_files "$package" "$root")
EOF
    if [[ -n "${SERVICE_USER[$package]:-}" ]]; then
        printf '\n%%pre\n%s\n' "$(make_user_script "$package")"
    fi
    if [[ -n "${CONFIG[$package]:-}" ]]; then
        printf '\n%%post\n%s\n' "$(unit_installed_script "$package" false)"
        printf '\n%%preun\n%s\n' "$(when '[ "$1" -eq 0 ]' "$(unit_removed_script "$package")")"
        printf '\n%%postun\n%s\n' "$(unit_installed_script "$package" '[ "$1" -ge 1 ]')"
    fi
    printf '\n%%changelog\n* %s %s - %s-%s\n- %s\n' "$(LC_ALL=C date -u -d "@$(build_time)" '+%a %b %d %Y')" \
        "$PACKAGER" "$version" "$REVISION" "Built from the ongrid workspace$(commit_note)."
}

# When the packaged source was made: the last commit's time (so that the same commit gives the
# same packages), else now.
build_time() {
    git -C "$REPO_ROOT" log -1 --format=%ct 2>/dev/null || date +%s
}

commit_note() {
    local commit
    commit="$(git -C "$REPO_ROOT" rev-parse --short HEAD 2>/dev/null)" || return 0
    printf ', commit %s' "$commit"
}

build_rpm() {
    local package="$1" version="$2" root spec rpm
    root="$WORK_DIR/rpm/$package"
    stage "$package" "$root" rpm
    spec="$WORK_DIR/rpm/$package.spec"
    rpm_spec "$package" "$version" "$root" >"$spec"
    local compression=()
    [[ "$COMPRESSION" == best ]] || compression=(--define '_binary_payload w1.gzdio')
    rpmbuild -bb --quiet --define "_topdir $WORK_DIR/rpmbuild" "${compression[@]}" \
        --define "_rpmdir $OUT_DIR" --define '_build_name_fmt %%{NAME}-%%{VERSION}-%%{RELEASE}.%%{ARCH}.rpm' \
        "$spec" >"$WORK_DIR/rpmbuild.log" 2>&1 || {
        cat "$WORK_DIR/rpmbuild.log" >&2
        die "rpmbuild of $package failed (output above; the spec was $spec)"
    }
    rpm="$OUT_DIR/$package-$version-$REVISION.$(uname -m).rpm"
    [[ -f "$rpm" ]] || die "rpmbuild made no $rpm"
    if [[ -n "$SIGN_KEY" ]]; then
        rpmsign --addsign --define "_gpg_name $SIGN_KEY" --define "__gpg $(command -v gpg)" "$rpm" >"$WORK_DIR/rpmsign.log" 2>&1 || {
            cat "$WORK_DIR/rpmsign.log" >&2
            die "rpmsign could not sign $rpm with the key '$SIGN_KEY' (output above): is it in gpg --list-secret-keys${GNUPGHOME:+ (GNUPGHOME=$GNUPGHOME)}?"
        }
    fi
    say "$rpm"
}

main() {
    parse_args "$@"
    check_tools
    local version package
    version="$(workspace_version)"
    [[ -n "$version" ]] || die "no version in [workspace.package] of $REPO_ROOT/Cargo.toml"
    build_binaries
    mkdir -p "$OUT_DIR"
    OUT_DIR="$(cd "$OUT_DIR" && pwd)"
    WORK_DIR="$(mktemp -d "${TMPDIR:-/tmp}/ongrid-packages.XXXXXX")"
    for package in "${PACKAGES[@]}"; do
        ! wants deb || build_deb "$package" "$version"
        ! wants rpm || build_rpm "$package" "$version"
    done
}

# Sourcing the script (for deploy/packages/test.sh) defines the functions without running them.
if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
    main "$@"
fi
