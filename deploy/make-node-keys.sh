#!/usr/bin/env bash
# Make SuperNode authentication key pairs (EC P-384, OpenSSH format, as flwr expects).
#
#   deploy/make-node-keys.sh DIR N [FIRST]
#
# Writes DIR/node-<t> (private key: stays on device t, passed to
# `flower-supernode --auth-supernode-private-key`) and DIR/node-<t>.pub (public key:
# registered on the SuperLink with `flwr supernode register DIR/node-<t>.pub <connection>`)
# for t = FIRST .. FIRST+N-1 (FIRST defaults to 0). Existing key pairs are kept, so the
# command can be re-run to add devices. Uses ssh-keygen (openssh-client) if present, else the
# `cryptography` package that flwr already depends on.
set -euo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
if [[ $# -ge 1 && ("$1" == "-h" || "$1" == "--help") ]]; then usage; exit 0; fi
[[ $# -ge 2 ]] || { usage >&2; exit 2; }
dir=$1 num=$2 first=${3:-0}
[[ "$num" =~ ^[0-9]+$ && "$first" =~ ^[0-9]+$ ]] || { echo "make-node-keys.sh: N and FIRST must be integers" >&2; exit 2; }
mkdir -p "$dir"
umask 077

python=$(command -v python3 || command -v python || true)
for ((t = first; t < first + num; t++)); do
    key=$dir/node-$t
    if [[ -f "$key" && -f "$key.pub" ]]; then
        echo "kept    $key(.pub)"
        continue
    fi
    rm -f "$key" "$key.pub"
    if command -v ssh-keygen > /dev/null; then
        ssh-keygen -q -t ecdsa -b 384 -N "" -C "fmtl-node-$t" -f "$key"
    elif [[ -n "$python" ]]; then
        "$python" - "$key" "fmtl-node-$t" <<'PY'
import sys
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

path, comment = sys.argv[1], sys.argv[2]
key = ec.generate_private_key(ec.SECP384R1())
with open(path, "wb") as f:
    f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                              serialization.NoEncryption()))
with open(path + ".pub", "wb") as f:
    f.write(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                          serialization.PublicFormat.OpenSSH)
            + b" " + comment.encode() + b"\n")
PY
    else
        echo "make-node-keys.sh: needs ssh-keygen or python3 with cryptography" >&2
        exit 1
    fi
    chmod 644 "$key.pub"
    echo "made    $key (private) and $key.pub (public)"
done
