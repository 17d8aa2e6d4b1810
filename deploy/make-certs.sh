#!/usr/bin/env bash
# Make a self-signed CA and a SuperLink server certificate signed by it (openssl only).
#
#   deploy/make-certs.sh [--force] [--owner USER[:GROUP]] DIR [HOST ...]
#
# Writes into DIR:
#   ca.crt                   the CA certificate: goes to every SuperNode and to the machine
#                            that runs `flwr run`
#   ca/ca.key                the CA's private key, in a directory of its own (mode 0700) so
#                            that DIR can be copied to the server without it: move ca/ to
#                            offline storage once the server certificate is made
#   server.crt / server.key  the SuperLink's (and the fleet proxy's) certificate and key; the
#                            certificate's subjectAltName holds localhost, 127.0.0.1, ::1 and
#                            every HOST (an IPv4/IPv6 address becomes an IP entry, anything
#                            else a DNS one)
#   server.csr, server.ext   intermediate files (kept for inspection)
#
# HOST is each name or address SuperNodes use in `--superlink HOST:PORT`, e.g. the server's
# LAN address 192.168.1.10 or superlink.local.
#
# An existing CA is kept: re-running the script (e.g. to add a HOST) issues a new server
# certificate with the same CA, so the devices' ca.crt stays valid. That needs the CA's key,
# DIR/ca/ca.key or the file named by CA_KEY (env). --force makes a new CA instead (every
# device then needs the new ca.crt).
#
#   --owner USER[:GROUP]  chown server.key and server.crt to the account the SuperLink runs
#                         as (the kit's unit: flwr); ca/ca.key stays with the caller
#
# Keys are EC P-256, mode 0600. Validity: DAYS (env, default 365). openssl's own messages
# are shown when a step fails.
set -euo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
die() { echo "make-certs.sh: $1" >&2; exit "${2:-1}"; }

force=0 owner=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        -h | --help) usage; exit 0 ;;
        --force) force=1; shift ;;
        --owner) [[ $# -ge 2 ]] || die "--owner needs USER[:GROUP]" 2; owner=$2; shift 2 ;;
        --*) die "unknown option $1 (see --help)" 2 ;;
        *) break ;;
    esac
done
[[ $# -ge 1 ]] || { usage >&2; exit 2; }
command -v openssl >/dev/null || die "openssl not found (Debian/Raspberry Pi OS: apt-get install openssl)"

dir=$1
shift
days=${DAYS:-365}
[[ "$days" =~ ^[0-9]+$ ]] || die "DAYS must be a whole number of days, got '$days'" 2
if [[ -n "$owner" ]]; then
    id -u "${owner%%:*}" > /dev/null 2>&1 || die "--owner: no user '${owner%%:*}'" 2
fi
# DIR itself readable (it holds ca.crt for everyone), the keys and ca/ not
if [[ ! -d "$dir" ]]; then
    mkdir -p "$dir"
    chmod 755 "$dir"
fi
umask 077
mkdir -p "$dir/ca"
chmod 700 "$dir/ca"
ca_key=${CA_KEY:-$dir/ca/ca.key}

# openssl with its stderr kept, and shown (with the step) if it fails
ossl() {
    local err
    if ! err=$(openssl "$@" 2>&1 > /dev/null); then
        echo "make-certs.sh: 'openssl $1' failed:" >&2
        echo "$err" >&2
        exit 1
    fi
}

san="DNS:localhost,IP:127.0.0.1,IP:::1"
for host in "$@"; do
    if [[ "$host" =~ ^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$ || "$host" == *:* ]]; then
        san+=",IP:$host"
    else
        san+=",DNS:$host"
    fi
done

if [[ -f "$dir/ca.crt" && $force -eq 0 ]]; then
    [[ -f "$ca_key" ]] || die "$dir/ca.crt exists (the devices trust it) but its key $ca_key \
is not here: set CA_KEY=/path/to/ca.key to issue a server certificate with that CA, or pass \
--force to make a new CA (every device then needs the new ca.crt)"
    ossl x509 -in "$dir/ca.crt" -noout
    echo "kept the CA $dir/ca.crt (--force makes a new one)"
else
    [[ $force -eq 0 ]] || echo "--force: making a new CA; copy the new ca.crt to every device"
    ossl ecparam -name prime256v1 -genkey -noout -out "$ca_key"
    ossl req -x509 -new -sha256 -days "$days" -key "$ca_key" -out "$dir/ca.crt" \
        -subj "/CN=fmtl-flower deployment CA" \
        -addext "basicConstraints=critical,CA:TRUE" \
        -addext "keyUsage=critical,keyCertSign,cRLSign"
fi

ossl ecparam -name prime256v1 -genkey -noout -out "$dir/server.key"
ossl req -new -sha256 -key "$dir/server.key" -out "$dir/server.csr" -subj "/CN=${1:-localhost}"
cat > "$dir/server.ext" <<EXT
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=$san
EXT
ossl x509 -req -sha256 -days "$days" -in "$dir/server.csr" -CA "$dir/ca.crt" \
    -CAkey "$ca_key" -CAcreateserial -CAserial "$dir/ca/ca.srl" -out "$dir/server.crt" \
    -extfile "$dir/server.ext"
# certificates are public; keys stay 0600
chmod 644 "$dir/ca.crt" "$dir/server.crt"
ossl verify -CAfile "$dir/ca.crt" "$dir/server.crt"
if [[ -n "$owner" ]]; then
    chown "$owner" "$dir/server.key" "$dir/server.crt"
fi

echo "CA:          $dir/ca.crt (its key: $ca_key; keep it offline)"
echo "server cert: $dir/server.crt (subjectAltName: $san)"
echo "server key:  $dir/server.key${owner:+ (owner $owner)}"
