#!/usr/bin/env bash
# Make SuperNode authentication key pairs (EC P-384, OpenSSH format, as flwr expects).
#
#   deploy/make-node-keys.sh [--owner USER[:GROUP]] DIR N [FIRST]
#
# Writes DIR/node-<t> (private key: stays on device t, passed to
# `flower-supernode --auth-supernode-private-key`) and DIR/node-<t>.pub (public key:
# registered on the SuperLink with `flwr supernode register DIR/node-<t>.pub <connection>`)
# for t = FIRST .. FIRST+N-1 (FIRST defaults to 0). The command can be re-run to add devices:
# it never overwrites or deletes a key. An existing pair is kept; a private key without its
# .pub gets the .pub derived from it; a .pub without its private key (made on the device)
# is left as it is. Uses ssh-keygen (openssh-client) if present, else the `cryptography`
# package that flwr already depends on.
#
#   --owner USER[:GROUP]  chown the private keys to the account the SuperNode runs as (the
#                         kit's unit: flwr); they stay mode 0600
set -euo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
die() { echo "make-node-keys.sh: $1" >&2; exit "${2:-1}"; }
owner=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        -h | --help) usage; exit 0 ;;
        --owner) [[ $# -ge 2 ]] || die "--owner needs USER[:GROUP]" 2; owner=$2; shift 2 ;;
        --*) die "unknown option $1 (see --help)" 2 ;;
        *) break ;;
    esac
done
[[ $# -ge 2 ]] || { usage >&2; exit 2; }
dir=$1 num=$2 first=${3:-0}
[[ "$num" =~ ^[0-9]+$ && "$first" =~ ^[0-9]+$ ]] || die "N and FIRST must be integers" 2
if [[ -n "$owner" ]]; then
    id -u "${owner%%:*}" > /dev/null 2>&1 || die "--owner: no user '${owner%%:*}'" 2
fi
mkdir -p "$dir"
umask 077

python=$(command -v python3 || command -v python || true)
# public_of KEY: write KEY.pub from the private key KEY
public_of() {
    if command -v ssh-keygen > /dev/null; then
        ssh-keygen -y -f "$1" > "$1.pub.tmp"
    else
        "$python" - "$1" <<'PY'
import sys
from cryptography.hazmat.primitives import serialization

path = sys.argv[1]
key = serialization.load_ssh_private_key(open(path, "rb").read(), None)
with open(path + ".pub.tmp", "wb") as f:
    f.write(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                          serialization.PublicFormat.OpenSSH) + b"\n")
PY
    fi
    chmod 644 "$1.pub.tmp"
    mv "$1.pub.tmp" "$1.pub"
}

# new_pair KEY COMMENT: a new key pair KEY, KEY.pub (neither exists)
new_pair() {
    if command -v ssh-keygen > /dev/null; then
        ssh-keygen -q -t ecdsa -b 384 -N "" -C "$2" -f "$1"
    elif [[ -n "$python" ]]; then
        "$python" - "$1" "$2" <<'PY'
import os
import sys
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

path, comment = sys.argv[1], sys.argv[2]
key = ec.generate_private_key(ec.SECP384R1())
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
with os.fdopen(fd, "wb") as f:
    f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                              serialization.NoEncryption()))
with open(path + ".pub", "wb") as f:
    f.write(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                          serialization.PublicFormat.OpenSSH)
            + b" " + comment.encode() + b"\n")
PY
    else
        die "needs ssh-keygen or python3 with cryptography"
    fi
    chmod 644 "$1.pub"
}

for ((t = first; t < first + num; t++)); do
    key=$dir/node-$t
    if [[ -f "$key" && -f "$key.pub" ]]; then
        echo "kept    $key(.pub)"
    elif [[ -f "$key" ]]; then
        public_of "$key"
        echo "kept    $key; wrote its missing public key $key.pub"
    elif [[ -f "$key.pub" ]]; then
        echo "kept    $key.pub (its private key is not here: made on the device?)"
        continue
    else
        new_pair "$key" "fmtl-node-$t"
        echo "made    $key (private) and $key.pub (public)"
    fi
    [[ -z "$owner" ]] || chown "$owner" "$key"
done
