#!/usr/bin/env bash
# Throwaway grid credentials for tests: a CA in IGTF layout with a CRL, user, host and VOMS
# server certificates, RFC 3820 proxies (grid-proxy-init) and VOMS proxies (voms-proxy-fake).
# Nothing made here is meant to be committed: proxies expire, keys are unencrypted.
#
# Usage: x509/scripts/gridca.sh COMMAND OUTDIR ...
#   ca OUTDIR [CN]                    CA /DC=org/DC=ongrid-test/CN=CN (default "ongrid test CA"),
#                                     valid from yesterday: OUTDIR/ca/ca.pem + ca.key,
#                                     OUTDIR/certificates/<hash>.0 and an empty CRL <hash>.r0
#   user OUTDIR NAME [DAYS]           OUTDIR/users/NAME/usercert.pem + userkey.pem (0400),
#                                     subject /DC=org/DC=ongrid-test/OU=People/CN=NAME, valid
#                                     from yesterday for DAYS (default 365) from now
#   host OUTDIR HOSTNAME              OUTDIR/hosts/HOSTNAME/hostcert.pem + hostkey.pem,
#                                     SAN DNS:HOSTNAME, IP:127.0.0.1
#   revoke OUTDIR NAME                revoke user NAME and regenerate the .r0 CRL
#   crl OUTDIR [HOURS]                regenerate the CRL, next update in HOURS (default 720)
#   voms OUTDIR VO HOST               VOMS server OUTDIR/voms/HOST/hostcert.pem + hostkey.pem and
#                                     OUTDIR/vomsdir/VO/HOST.lsc
#   proxy OUTDIR NAME OUTFILE [grid-proxy-init flags...]
#                                     RFC proxy of user NAME (or, when NAME is a path to an
#                                     existing proxy file, a proxy of that proxy), e.g. -valid 0:2,
#                                     -limited, -independent, -path-length 1, -bits 1024
#                                     (-old or -draft instead of -rfc for legacy/draft proxies)
#   vomsproxy OUTDIR NAME VO HOST OUTFILE [voms-proxy-fake flags...]
#                                     RFC proxy with a VOMS AC of VO signed by HOST's VOMS cert,
#                                     e.g. -fqan /VO/prod/Role=admin (default: -fqan /VO),
#                                     -vomslife 1, -pastac 2:00
#
# Environment: GRIDCA_STARTDATE / GRIDCA_ENDDATE (YYYYMMDDHHMMSSZ) override the validity of the
# next user/host/voms certificate (for expired or not-yet-valid test certificates).
# GRIDCA_KEY=FILE makes user/host/voms certificates for a copy of that RSA key instead of a new
# one (key generation is the slow part of a test fixture).
# Needs: openssl; grid-proxy-init (globus-proxy-utils) for `proxy`; voms-proxy-fake
# (voms-clients) for `vomsproxy`.
set -euo pipefail

readonly DN_BASE="/DC=org/DC=ongrid-test"
readonly CA_CN="ongrid test CA"
readonly KEY_BITS=2048
readonly CA_DAYS=3650
readonly DEFAULT_USER_DAYS=365
readonly DEFAULT_CRL_HOURS=720
readonly VOMS_PORT=15000

die() {
    printf 'gridca.sh: error: %s\n' "$*" >&2
    exit 1
}

usage() {
    sed -n '2,34p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
}

# expect_args COUNT MIN MAX USAGE: dies with the usage line unless MIN <= COUNT <= MAX.
expect_args() {
    (($1 >= $2 && $1 <= $3)) || die "usage: gridca.sh $4"
}

need() {
    command -v "$1" >/dev/null || die "$1 not found: $2"
}

new_key() {
    openssl genpkey -algorithm RSA -pkeyopt "rsa_keygen_bits:$KEY_BITS" -out "$1" 2>/dev/null
    chmod 0400 "$1"
}

# The key of a new user/host/VOMS certificate: a copy of $GRIDCA_KEY if set, else a new one.
leaf_key() {
    if [[ -n "${GRIDCA_KEY:-}" ]]; then
        cp "$GRIDCA_KEY" "$1"
        chmod 0400 "$1"
    else
        new_key "$1"
    fi
}

ca_hash() {
    openssl x509 -in "$1/ca/ca.pem" -noout -subject_hash
}

require_ca() {
    [[ -f "$1/ca/ca.pem" && -f "$1/ca/ca.cnf" ]] ||
        die "no CA in $1: run gridca.sh ca $1 first"
}

# The openssl ca configuration: one file in OUTDIR/ca, holding the database, so that later
# revocations and CRLs work. Extension sections for each kind of certificate.
write_ca_config() {
    local dir=$1
    cat >"$dir/ca/ca.cnf" <<EOF
[ca]
default_ca = gridca

[gridca]
dir = $dir/ca
database = \$dir/index.txt
new_certs_dir = \$dir/newcerts
serial = \$dir/serial
crlnumber = \$dir/crlnumber
certificate = \$dir/ca.pem
private_key = \$dir/ca.key
default_md = sha256
default_days = $DEFAULT_USER_DAYS
default_crl_hours = $DEFAULT_CRL_HOURS
policy = policy_any
unique_subject = no
preserve = yes
email_in_dn = no
copy_extensions = none

[policy_any]
domainComponent = optional
organizationName = optional
organizationalUnitName = optional
commonName = supplied

[req]
distinguished_name = req_dn
prompt = no

[req_dn]
CN = unused

[ca_ext]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid:always

[user_ext]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature,keyEncipherment
extendedKeyUsage = clientAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid,issuer

[crl_ext]
authorityKeyIdentifier = keyid:always
EOF
}

cmd_ca() {
    local dir=$1 cn=${2:-}
    [[ -e "$dir/ca/ca.pem" ]] && die "$dir/ca/ca.pem exists: use a new OUTDIR"
    mkdir -p "$dir/ca/newcerts" "$dir/certificates"
    dir=$(cd "$dir" && pwd)
    write_ca_config "$dir"
    : >"$dir/ca/index.txt"
    printf '1000\n' >"$dir/ca/serial"
    printf '1000\n' >"$dir/ca/crlnumber"
    new_key "$dir/ca/ca.key"
    # Self-signed through `openssl ca` so that the CA can be valid from yesterday (tests check
    # times before a proxy's notBefore; openssl 3.0 `req -x509` cannot backdate).
    local subject="$DN_BASE/CN=${cn:-$CA_CN}" start
    start=$(date -u -d '1 day ago' +%Y%m%d%H%M%SZ)
    openssl req -new -config "$dir/ca/ca.cnf" -key "$dir/ca/ca.key" -subj "$subject" \
        -out "$dir/ca/ca.csr"
    openssl ca -batch -notext -selfsign -config "$dir/ca/ca.cnf" -extensions ca_ext \
        -keyfile "$dir/ca/ca.key" -in "$dir/ca/ca.csr" -subj "$subject" -startdate "$start" \
        -days "$CA_DAYS" -out "$dir/ca/ca.pem" 2>"$dir/ca/selfsign.log" || {
        cat "$dir/ca/selfsign.log" >&2
        die "openssl ca -selfsign failed"
    }
    rm -f "$dir/ca/ca.csr" "$dir/ca/selfsign.log"
    local hash
    hash=$(ca_hash "$dir")
    cp "$dir/ca/ca.pem" "$dir/certificates/$hash.0"
    gen_crl "$dir" "$DEFAULT_CRL_HOURS"
    printf '%s\n' "$dir/certificates/$hash.0"
}

gen_crl() {
    local dir=$1 hours=$2 hash
    hash=$(ca_hash "$dir")
    openssl ca -batch -config "$dir/ca/ca.cnf" -gencrl -crlexts crl_ext -crlhours "$hours" \
        -out "$dir/certificates/$hash.r0" 2>/dev/null ||
        die "openssl ca -gencrl failed for $dir"
}

# sign DIR SUBJECT KEY OUT EXTFILE-CONTENT: issues a certificate with `openssl ca` so that it is
# in the CA's database (revocable).
sign() {
    local dir=$1 subject=$2 key=$3 out=$4 extensions=$5 days=$6
    local work
    work=$(mktemp -d)
    # shellcheck disable=SC2064 # expand now: the local is gone when the trap runs
    trap "rm -rf '$work'" RETURN
    printf '%s\n' "$extensions" >"$work/ext.cnf"
    openssl req -new -config "$dir/ca/ca.cnf" -key "$key" -subj "$subject" -out "$work/req.csr"
    # Valid from yesterday unless told otherwise (clocks differ; tests look before proxies).
    local validity=(-startdate "${GRIDCA_STARTDATE:-$(date -u -d '1 day ago' +%Y%m%d%H%M%SZ)}")
    if [[ -n "${GRIDCA_ENDDATE:-}" ]]; then
        validity+=(-enddate "$GRIDCA_ENDDATE")
    else
        validity+=(-days "$days")
    fi
    openssl ca -batch -notext -config "$dir/ca/ca.cnf" -extfile "$work/ext.cnf" \
        -subj "$subject" -in "$work/req.csr" -out "$out" "${validity[@]}" 2>"$work/err" || {
        cat "$work/err" >&2
        die "openssl ca could not sign $subject"
    }
}

cmd_user() {
    local dir=$1 name=$2 days=${3:-$DEFAULT_USER_DAYS}
    require_ca "$dir"
    dir=$(cd "$dir" && pwd)
    local udir="$dir/users/$name"
    [[ -e "$udir/usercert.pem" ]] && die "$udir/usercert.pem exists: pick another NAME"
    mkdir -p "$udir"
    leaf_key "$udir/userkey.pem"
    sign "$dir" "$DN_BASE/OU=People/CN=$name" "$udir/userkey.pem" "$udir/usercert.pem" \
        "basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature,keyEncipherment
extendedKeyUsage = clientAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid,issuer" "$days"
    chmod 0444 "$udir/usercert.pem"
    printf '%s\n' "$udir/usercert.pem"
}

server_cert() {
    local dir=$1 host=$2 out=$3 san=$4
    [[ -e "$out/hostcert.pem" ]] && die "$out/hostcert.pem exists"
    mkdir -p "$out"
    leaf_key "$out/hostkey.pem"
    sign "$dir" "$DN_BASE/CN=$host" "$out/hostkey.pem" "$out/hostcert.pem" \
        "basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature,keyEncipherment
extendedKeyUsage = serverAuth,clientAuth
subjectAltName = $san
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid,issuer" "$DEFAULT_USER_DAYS"
    chmod 0444 "$out/hostcert.pem"
}

cmd_host() {
    local dir=$1 host=$2
    require_ca "$dir"
    dir=$(cd "$dir" && pwd)
    server_cert "$dir" "$host" "$dir/hosts/$host" "DNS:$host,IP:127.0.0.1"
    printf '%s\n' "$dir/hosts/$host/hostcert.pem"
}

cmd_revoke() {
    local dir=$1 name=$2
    require_ca "$dir"
    dir=$(cd "$dir" && pwd)
    local cert="$dir/users/$name/usercert.pem"
    [[ -f "$cert" ]] || die "no user $name in $dir (no $cert)"
    openssl ca -batch -config "$dir/ca/ca.cnf" -revoke "$cert" -crl_reason keyCompromise \
        2>/dev/null || die "openssl ca -revoke failed for $cert"
    gen_crl "$dir" "$DEFAULT_CRL_HOURS"
}

cmd_crl() {
    local dir=$1 hours=${2:-$DEFAULT_CRL_HOURS}
    require_ca "$dir"
    dir=$(cd "$dir" && pwd)
    gen_crl "$dir" "$hours"
}

oneline_dn() {
    openssl x509 -in "$1" -noout "-$2" -nameopt compat | sed 's/^[a-z]*=//'
}

cmd_voms() {
    local dir=$1 vo=$2 host=$3
    require_ca "$dir"
    dir=$(cd "$dir" && pwd)
    local out="$dir/voms/$host"
    server_cert "$dir" "$host" "$out" "DNS:$host"
    mkdir -p "$dir/vomsdir/$vo"
    {
        oneline_dn "$out/hostcert.pem" subject
        oneline_dn "$out/hostcert.pem" issuer
    } >"$dir/vomsdir/$vo/$host.lsc"
    printf '%s\n' "$dir/vomsdir/$vo/$host.lsc"
}

# Certificate and key of user NAME, or of an existing proxy file when NAME is one.
credential() {
    local dir=$1 name=$2
    if [[ "$name" == */* && -f "$name" ]]; then
        printf '%s\n%s\n' "$name" "$name"
    else
        local udir="$dir/users/$name"
        [[ -f "$udir/usercert.pem" ]] || die "no user $name in $dir: run gridca.sh user $dir $name"
        printf '%s\n%s\n' "$udir/usercert.pem" "$udir/userkey.pem"
    fi
}

cmd_proxy() {
    local dir=$1 name=$2 outfile=$3
    shift 3
    need grid-proxy-init "apt-get install globus-proxy-utils"
    require_ca "$dir"
    local creds
    mapfile -t creds < <(credential "$dir" "$name")
    ((${#creds[@]} == 2)) || exit 1
    # -rfc unless the caller asks for another generation (grid-proxy-init refuses both).
    local generation=(-rfc) arg
    for arg in "$@"; do
        [[ "$arg" == -old || "$arg" == -draft ]] && generation=()
    done
    local log
    log=$(mktemp)
    if ! grid-proxy-init -q "${generation[@]}" -cert "${creds[0]}" -key "${creds[1]}" \
        -certdir "$dir/certificates" -out "$outfile" "$@" </dev/null >"$log" 2>&1; then
        cat "$log" >&2
        rm -f "$log"
        die "grid-proxy-init failed for $name"
    fi
    rm -f "$log"
}

cmd_vomsproxy() {
    local dir=$1 name=$2 vo=$3 host=$4 outfile=$5
    shift 5
    need voms-proxy-fake "apt-get install voms-clients"
    require_ca "$dir"
    local creds
    mapfile -t creds < <(credential "$dir" "$name")
    ((${#creds[@]} == 2)) || exit 1
    local server="$dir/voms/$host"
    [[ -f "$server/hostcert.pem" ]] || die "no VOMS server $host in $dir: run gridca.sh voms $dir $vo $host"
    local extra=("$@") arg has_fqan=no
    for arg in "$@"; do
        [[ "$arg" == -fqan ]] && has_fqan=yes
    done
    [[ "$has_fqan" == yes ]] || extra+=(-fqan "/$vo")
    local log
    log=$(mktemp)
    if ! voms-proxy-fake -q -rfc -cert "${creds[0]}" -key "${creds[1]}" \
        -certdir "$dir/certificates" -hostcert "$server/hostcert.pem" \
        -hostkey "$server/hostkey.pem" -voms "$vo" -uri "$host:$VOMS_PORT" \
        -out "$outfile" "${extra[@]}" </dev/null >"$log" 2>&1; then
        cat "$log" >&2
        rm -f "$log"
        die "voms-proxy-fake failed for $name"
    fi
    rm -f "$log"
}

main() {
    need openssl "apt-get install openssl"
    local command=${1:-}
    [[ -n "$command" ]] || {
        usage
        exit 2
    }
    shift
    case "$command" in
    ca) expect_args $# 1 2 "ca OUTDIR [CN]" && cmd_ca "$@" ;;
    user) expect_args $# 2 3 "user OUTDIR NAME [DAYS]" && cmd_user "$@" ;;
    host) expect_args $# 2 2 "host OUTDIR HOSTNAME" && cmd_host "$@" ;;
    revoke) expect_args $# 2 2 "revoke OUTDIR NAME" && cmd_revoke "$@" ;;
    crl) expect_args $# 1 2 "crl OUTDIR [HOURS]" && cmd_crl "$@" ;;
    voms) expect_args $# 3 3 "voms OUTDIR VO HOST" && cmd_voms "$@" ;;
    proxy)
        expect_args $# 3 1000 "proxy OUTDIR NAME OUTFILE [grid-proxy-init flags...]"
        cmd_proxy "$@"
        ;;
    vomsproxy)
        expect_args $# 5 1000 "vomsproxy OUTDIR NAME VO HOST OUTFILE [voms-proxy-fake flags...]"
        cmd_vomsproxy "$@"
        ;;
    -h | --help | help) usage ;;
    *) die "unknown command $command (ca, user, host, revoke, crl, voms, proxy, vomsproxy)" ;;
    esac
}

main "$@"
