#!/usr/bin/env bash
# Runs the ongrid-x509 fuzz targets (cargo-fuzz, libFuzzer) for a bounded time each, starting
# from seeds made at run time with gridca.sh, grid-proxy-init and voms-proxy-fake (proxies
# expire, so no seed is committed). A crash fails the run; libFuzzer leaves the input in
# x509/fuzz/artifacts/<target>/.
#
# Usage: x509/fuzz/run.sh [SECONDS]    (per target; default 30)
#        x509/fuzz/run.sh --build-only   (builds the targets, runs none)
# The build goes to target/fuzz/x509/, or to x509/ under $ONGRID_FUZZ_TARGET_DIR when set: a
# directory of its own, since fuzz/'s targets share dependencies with these but are built
# without AddressSanitizer, and one build's flags would make the other compile them again.
# Needs: cargo-fuzz (cargo install cargo-fuzz --locked), openssl, grid-proxy-init,
# voms-proxy-fake. The stable toolchain is used with RUSTC_BOOTSTRAP=1 (cargo-fuzz passes
# nightly-only -Z flags to rustc).
set -euo pipefail

FUZZ_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
readonly FUZZ_DIR
readonly REPO_ROOT="$FUZZ_DIR/../.."
readonly GRIDCA="$FUZZ_DIR/../scripts/gridca.sh"
readonly TARGET_DIR="${ONGRID_FUZZ_TARGET_DIR:-$REPO_ROOT/target/fuzz}/x509"
readonly VO=fuzzvo
readonly VOMS_HOST=voms.ongrid-test.org
readonly VOMS_AC_OID=1.3.6.1.4.1.8005.100.100.5

die() {
    printf 'fuzz/run.sh: error: %s\n' "$*" >&2
    exit 1
}

command -v cargo-fuzz >/dev/null || die "cargo-fuzz not found: cargo install cargo-fuzz --locked"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# Writes each certificate of the PEM file $1 as DER to $2.0, $2.1, ...
split_pem() {
    local n=0 block
    while IFS= read -r -d '' block; do
        printf '%s\n' "$block" | openssl x509 -outform DER -out "$2.$n"
        n=$((n + 1))
    done < <(awk '/-----BEGIN CERTIFICATE-----/{p=1} p{print} /-----END CERTIFICATE-----/{p=0; printf "%c", 0}' "$1")
}

# The verify_chain input for the PEM file $1: a flag byte, then each certificate as a 2-byte
# big-endian length and its DER bytes.
chain_seed() {
    local der len
    split_pem "$1" "$work/split"
    printf '\x00'
    for der in "$work"/split.*; do
        len=$(stat -c %s "$der")
        # shellcheck disable=SC2059 # the format is built from the length on purpose
        printf "\\x$(printf %02x $((len >> 8)))\\x$(printf %02x $((len & 255)))"
        cat "$der"
    done
    rm -f "$work"/split.*
}

# The VOMS AC extension value of the first certificate of the PEM file $1, as DER.
voms_seed() {
    local offset
    openssl x509 -in "$1" -outform DER -out "$work/leaf.der"
    offset=$(openssl asn1parse -inform DER -in "$work/leaf.der" |
        awk -v oid="$VOMS_AC_OID" 'found && /OCTET STRING/ {sub(/:.*/, ""); print $1; exit} index($0, ":" oid) {found=1}')
    [[ -n "$offset" ]] || die "no VOMS extension in $1"
    openssl asn1parse -inform DER -in "$work/leaf.der" -strparse "$offset" -noout -out "$2"
}

make_seeds() {
    local ca="$work/ca" p="$work/proxies"
    mkdir -p "$p" "$work/corpus/verify_chain" "$work/corpus/voms_ac"
    "$GRIDCA" ca "$ca" >/dev/null
    "$GRIDCA" user "$ca" alice >/dev/null
    "$GRIDCA" voms "$ca" "$VO" "$VOMS_HOST" >/dev/null
    "$GRIDCA" proxy "$ca" alice "$p/rfc.pem"
    "$GRIDCA" proxy "$ca" "$p/rfc.pem" "$p/rfc_2nd.pem" -limited
    "$GRIDCA" proxy "$ca" alice "$p/independent.pem" -independent -path-length 2
    "$GRIDCA" vomsproxy "$ca" alice "$VO" "$VOMS_HOST" "$p/voms.pem" \
        -fqan "/$VO/Role=NULL/Capability=NULL" -fqan "/$VO/prod/Role=admin/Capability=NULL"
    cp "$ca/users/alice/usercert.pem" "$p/plain.pem"
    local file
    for file in "$p"/*.pem; do
        chain_seed "$file" >"$work/corpus/verify_chain/$(basename "$file" .pem)"
    done
    voms_seed "$p/voms.pem" "$work/corpus/voms_ac/voms"
    export ONGRID_FUZZ_CA_DIR="$ca/certificates"
    export ONGRID_FUZZ_VOMSDIR="$ca/vomsdir"
    ONGRID_FUZZ_NOW=$(date +%s)
    export ONGRID_FUZZ_NOW
}

main() {
    cd "$FUZZ_DIR"
    export RUSTC_BOOTSTRAP=1
    printf '==> building the X.509 fuzz targets\n'
    cargo fuzz build --target-dir "$TARGET_DIR" || die "building the X.509 fuzz targets failed"
    [[ "${1:-}" != --build-only ]] || return 0
    local seconds_per_target=${1:-30} target
    make_seeds
    for target in verify_chain voms_ac; do
        printf '==> fuzzing %s for %ss\n' "$target" "$seconds_per_target"
        local log="$work/$target.log" status=0
        cargo fuzz run --target-dir "$TARGET_DIR" "$target" "$work/corpus/$target" \
            -- -max_total_time="$seconds_per_target" -print_final_stats=1 >"$log" 2>&1 || status=$?
        grep -E '^(INFO: seed|#[0-9]+ +DONE|stat::number_of_executed_units|stat::peak_rss_mb)' "$log" || true
        if ((status != 0)); then
            tail -40 "$log" >&2
            die "fuzz target $target failed (input saved under $FUZZ_DIR/artifacts/$target/)"
        fi
    done
}

main "$@"
