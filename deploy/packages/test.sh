#!/usr/bin/env bash
# Tests the packages of deploy/packages/build.sh, built from the binaries already in target/:
#   - the .rpm files are signed (by a throwaway key), pass rpmlint without errors, need glibc
#     2.34 at most (Enterprise Linux 9), mark their configs, make their users and hold what they
#     should (units, man pages, completions);
#   - the .deb files install with dpkg into a fresh Debian bookworm root (a container of the dev
#     image, which is debootstrap's bookworm; no network), make their users and directories, and
#     each service's --check-config passes on its installed example config once the files it
#     names (certificates, tokens) are in place, as an admin puts them; an upgrade from the
#     previous revision keeps an edited config; the bash completion works; removal and purge
#     leave no unit and no config behind;
#   - `man devctl` and `man devctl-session-new` find the packaged pages; fish completes with the
#     packaged completion and zsh parses its own;
#   - the installed binaries are copied to --installed-bin DIR, for ./scripts/test to run the
#     quickstart with them.
#
# Usage: deploy/packages/test.sh [--profile dev|release] [--installed-bin DIR]
# Needs: dpkg-dev, rpm, rpmlint, gnupg, man-db, openssl, Docker and the dev image
# (images/dev/build.sh).
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
readonly REPO_ROOT
readonly IMAGE=ongrid/dev:latest
# The newest glibc an Enterprise Linux 9 machine has.
readonly EL9_GLIBC=2.34

PROFILE=dev
INSTALLED_BIN=""
WORK=""

say() { printf '==> %s\n' "$*"; }
fail() {
    printf 'error: %s\n' "$*" >&2
    exit 1
}
# The test's gpg-agent (started by gpg for the throwaway key) goes with its GNUPGHOME.
cleanup() {
    [[ -n "$WORK" ]] || return 0
    if [[ -d "$WORK/gnupg" ]]; then
        GNUPGHOME="$WORK/gnupg" gpgconf --kill all 2>/dev/null || true
    fi
    rm -rf "$WORK"
}
trap cleanup EXIT

parse_args() {
    while (($# > 0)); do
        case "$1" in
        --profile) PROFILE="${2:?--profile needs dev or release}" && shift ;;
        --installed-bin) INSTALLED_BIN="${2:?--installed-bin needs a directory}" && shift ;;
        *) fail "unknown argument '$1'" ;;
        esac
        shift
    done
}

# A throwaway GnuPG key in the test's own GNUPGHOME, to sign the .rpm files as a site signs
# what it publishes.
readonly SIGNING_KEY="ongrid package test <package-test@localhost>"
make_signing_key() {
    export GNUPGHOME="$WORK/gnupg"
    mkdir -m 0700 "$GNUPGHOME"
    gpg --batch --quiet --passphrase '' --quick-generate-key "$SIGNING_KEY" rsa2048 sign 1d
    gpg --batch --quiet --armor --export "$SIGNING_KEY" >"$WORK/signing-key.asc"
}

build() {
    say "building the packages of revisions 1 (.deb) and 2 (.deb, signed .rpm) from the $PROFILE binaries"
    local common=(--profile "$PROFILE" --no-build --compression fast)
    "$REPO_ROOT/deploy/packages/build.sh" "${common[@]}" --format deb --revision 1 --out "$WORK/r1"
    "$REPO_ROOT/deploy/packages/build.sh" "${common[@]}" --revision 2 --sign "$SIGNING_KEY" \
        --out "$WORK/r2"
}

# ---------------------------------------------------------------------------------------------
# .rpm

# rpm_has RPM QUERY LINE: the rpm -qp QUERY output of RPM has LINE, whole.
rpm_has() {
    local rpm="$1" query="$2" line="$3"
    rpm -qp "$query" "$rpm" 2>/dev/null | grep -xF -- "$line" >/dev/null ||
        fail "$(basename "$rpm"): rpm -qp $query lacks '$line'; it has: $(rpm -qp "$query" "$rpm" 2>/dev/null | tr '\n' ' ')"
}

check_rpms() {
    local rpm package newest
    say "rpmlint, signatures and the contents of the .rpm files"
    # The signing key's public half, in an rpm database of the test's own.
    rpm --dbpath "$WORK/rpmdb" --initdb
    rpm --dbpath "$WORK/rpmdb" --import "$WORK/signing-key.asc"
    # rpmlint checks signatures against the rpm database of ~/.rpmmacros: the test's own.
    mkdir -p "$WORK/home"
    printf '%%_dbpath %s\n' "$WORK/rpmdb" >"$WORK/home/.rpmmacros"
    for rpm in "$WORK"/r2/*.rpm; do
        rpm --dbpath "$WORK/rpmdb" --checksig "$rpm" | grep ': digests signatures OK$' >/dev/null ||
            fail "$(basename "$rpm") is not signed by the test's key: $(rpm --dbpath "$WORK/rpmdb" --checksig "$rpm")"
        package="$(rpm -qp --queryformat '%{NAME}' "$rpm" 2>/dev/null)"
        # rpmlint exits non-zero on errors; warnings (no signature, no URL, ...) are printed.
        HOME="$WORK/home" rpmlint --info "$rpm" || fail "rpmlint found errors in $(basename "$rpm") (above)"
        newest="$(rpm -qp --requires "$rpm" 2>/dev/null | sed -n 's/^libc\.so\.6(GLIBC_\([0-9.]*\)).*/\1/p' |
            sort -V | tail -1)"
        [[ -n "$newest" ]] || fail "$(basename "$rpm") requires no libc.so.6 version: did rpmbuild read the binary's dependencies?"
        [[ "$(printf '%s\n%s\n' "$newest" "$EL9_GLIBC" | sort -V | tail -1)" == "$EL9_GLIBC" ]] ||
            fail "$(basename "$rpm") needs glibc $newest, newer than Enterprise Linux 9's $EL9_GLIBC: build it on an older system"
        rpm_has "$rpm" --list "/usr/bin/$package"
        rpm_has "$rpm" --list "/usr/share/doc/$package/LICENSE"
        case "$package" in
        devctl)
            rpm_has "$rpm" --list /usr/share/man/man1/devctl.1.gz
            rpm_has "$rpm" --list /usr/share/man/man1/devctl-session-new.1.gz
            rpm_has "$rpm" --list /usr/share/bash-completion/completions/devctl
            rpm_has "$rpm" --list /usr/share/zsh/site-functions/_devctl
            rpm_has "$rpm" --list /usr/share/fish/vendor_completions.d/devctl.fish
            ;;
        *)
            rpm_has "$rpm" --configfiles "/etc/ongrid/${package#ongrid-}.toml"
            rpm_has "$rpm" --list "/usr/lib/systemd/system/$package.service"
            ;;
        esac
        case "$package" in
        ongrid-manager | ongrid-gateway)
            rpm -qp --scripts "$rpm" 2>/dev/null | grep 'useradd --system' >/dev/null ||
                fail "$(basename "$rpm") makes no system user"
            ;;
        esac
        printf '%s: glibc %s at most, files and scripts as expected\n' "$(basename "$rpm")" "$newest"
    done
}

# ---------------------------------------------------------------------------------------------
# .deb, in a fresh Debian root

# A CA, and certificates of the manager and the agent's stream endpoint, as a site has them.
make_site_files() {
    local dir="$WORK/site" name hash
    mkdir -p "$dir/certificates"
    openssl req -x509 -newkey rsa:2048 -nodes -keyout "$dir/ca.key" -out "$dir/ca.crt" \
        -subj "/DC=org/DC=ongrid-test/CN=package test CA" -days 2 \
        -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign 2>/dev/null
    hash="$(openssl x509 -in "$dir/ca.crt" -noout -subject_hash)"
    cp "$dir/ca.crt" "$dir/certificates/$hash.0"
    for name in manager agent; do
        openssl req -new -newkey rsa:2048 -nodes -keyout "$dir/$name.key" -out "$dir/$name.csr" \
            -subj "/DC=org/DC=ongrid-test/CN=$name.test" 2>/dev/null
        openssl x509 -req -in "$dir/$name.csr" -CA "$dir/ca.crt" -CAkey "$dir/ca.key" \
            -CAcreateserial -days 2 -out "$dir/$name.crt" \
            -extfile <(printf 'subjectAltName=DNS:%s.test\nextendedKeyUsage=serverAuth\n' "$name") 2>/dev/null
    done
}

check_debs() {
    make_site_files
    local installed="$WORK/installed"
    mkdir -p "$installed"
    say "the .deb files in a container of $IMAGE (no network)"
    docker run --rm --network none --user root \
        -v "$WORK/r1:/packages/r1:ro" -v "$WORK/r2:/packages/r2:ro" -v "$WORK/site:/site:ro" \
        -v "$REPO_ROOT/deploy/packages/test-in-root.sh:/test-in-root.sh:ro" \
        -v "$installed:/installed" "$IMAGE" bash /test-in-root.sh ||
        fail "installing, checking or upgrading the .deb files failed (output above)"
    # On this machine: man(1) finds and renders the pages the package holds, fish completes with
    # its completion, and zsh reads its own.
    local devctl_root="$WORK/devctl-root"
    dpkg-deb -x "$WORK"/r2/devctl_*.deb "$devctl_root"
    fish --no-config -c "source $devctl_root/usr/share/fish/vendor_completions.d/devctl.fish
        complete -C 'devctl session '" | grep -x 'new.*' >/dev/null ||
        fail "fish does not complete 'devctl session ' to new with the packaged completion"
    zsh -n "$devctl_root/usr/share/zsh/vendor-completions/_devctl" ||
        fail "zsh cannot parse the packaged completion _devctl"
    # man looks the pages up by name in the package's man directory, as in /usr/share/man.
    MANWIDTH=80 man -M "$devctl_root/usr/share/man" devctl 2>/dev/null |
        grep 'devctl - devctl: develop on the grid' >/dev/null ||
        fail "man devctl does not find or render the packaged devctl.1.gz"
    MANWIDTH=80 man -M "$devctl_root/usr/share/man" devctl-session-new 2>/dev/null |
        grep -- '--min-capability' >/dev/null ||
        fail "man devctl-session-new does not describe --min-capability"
    if [[ -n "$INSTALLED_BIN" ]]; then
        mkdir -p "$INSTALLED_BIN"
        cp "$installed"/* "$INSTALLED_BIN/"
        say "the installed binaries are in $INSTALLED_BIN"
    fi
}

main() {
    parse_args "$@"
    docker image inspect "$IMAGE" >/dev/null 2>&1 || fail "no $IMAGE: run images/dev/build.sh first"
    WORK="$(mktemp -d "${TMPDIR:-/tmp}/ongrid-package-test.XXXXXX")"
    make_signing_key
    build
    check_rpms
    check_debs
    say "packages tested"
}

main "$@"
