#!/usr/bin/env bash
# Make a self-signed CA and a SuperLink server certificate signed by it (openssl only).
#
#   deploy/make-certs.sh DIR [HOST ...]
#
# Writes into DIR:
#   ca.crt / ca.key          the CA (ca.crt goes to every SuperNode and to the machine that
#                            runs `flwr run`; keep ca.key offline)
#   server.crt / server.key  the SuperLink's certificate and key; the certificate's
#                            subjectAltName holds localhost, 127.0.0.1, ::1 and every HOST
#                            (an IPv4/IPv6 address becomes an IP entry, anything else a DNS one)
#   server.csr, server.ext   intermediate files (kept for inspection)
#
# HOST is each name or address SuperNodes use in `--superlink HOST:PORT`, e.g. the server's
# LAN address 192.168.1.10 or superlink.local. Keys are EC P-256. Existing files in DIR are
# overwritten. Validity: DAYS (env, default 365).
set -euo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }

[[ $# -ge 1 ]] || { usage >&2; exit 2; }
if [[ "$1" == "-h" || "$1" == "--help" ]]; then usage; exit 0; fi
command -v openssl >/dev/null || { echo "make-certs.sh: openssl not found" >&2; exit 1; }

dir=$1
shift
days=${DAYS:-365}
mkdir -p "$dir"
umask 077

san="DNS:localhost,IP:127.0.0.1,IP:::1"
for host in "$@"; do
    if [[ "$host" =~ ^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$ || "$host" == *:* ]]; then
        san+=",IP:$host"
    else
        san+=",DNS:$host"
    fi
done

openssl ecparam -name prime256v1 -genkey -noout -out "$dir/ca.key" 2>/dev/null
openssl req -x509 -new -sha256 -days "$days" -key "$dir/ca.key" -out "$dir/ca.crt" \
    -subj "/CN=fmtl-flower deployment CA" \
    -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign"

openssl ecparam -name prime256v1 -genkey -noout -out "$dir/server.key" 2>/dev/null
openssl req -new -sha256 -key "$dir/server.key" -out "$dir/server.csr" \
    -subj "/CN=${1:-localhost}"
cat > "$dir/server.ext" <<EXT
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=$san
EXT
openssl x509 -req -sha256 -days "$days" -in "$dir/server.csr" -CA "$dir/ca.crt" \
    -CAkey "$dir/ca.key" -CAcreateserial -out "$dir/server.crt" -extfile "$dir/server.ext" \
    2>/dev/null
# certificates are public; keys stay 0600
chmod 644 "$dir/ca.crt" "$dir/server.crt"

openssl verify -CAfile "$dir/ca.crt" "$dir/server.crt" >/dev/null
echo "CA:          $dir/ca.crt"
echo "server cert: $dir/server.crt (subjectAltName: $san)"
echo "server key:  $dir/server.key"
