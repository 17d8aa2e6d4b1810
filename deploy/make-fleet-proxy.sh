#!/usr/bin/env bash
# Render the nginx configuration that exposes only the SuperLink's Fleet API to devices.
#
#   deploy/make-fleet-proxy.sh CERT_DIR [--listen [ADDR:]PORT] [--upstream HOST:PORT]
#                                       [--standalone DIR]
#
# Fills deploy/nginx/fleet-proxy.conf (an nginx `server` block) with CERT_DIR/server.crt,
# CERT_DIR/server.key (the SuperLink's certificate, made by make-certs.sh: devices keep
# verifying with ca.crt) and CERT_DIR/ca.crt (nginx verifies the SuperLink with it), and
# prints it. The SuperLink must listen on 127.0.0.1 only (--host 127.0.0.1, with TLS):
# the Control API shares its port and has no authentication in open-source flwr.
#
#   --listen [ADDR:]PORT  where devices connect (default 8443, all addresses)
#   --upstream HOST:PORT  the SuperLink (default 127.0.0.1:8000)
#   --standalone DIR      instead of printing a server block, write DIR/nginx.conf: a
#                         complete configuration for `nginx -p DIR -c DIR/nginx.conf`, run in
#                         the foreground as the calling user, pid, logs and temporary files
#                         in DIR (what deploy/start-local.sh --fleet-proxy uses)
#
# On a server with the distribution's nginx (`apt-get install nginx-light`):
#   deploy/make-fleet-proxy.sh /etc/flwr/certs --listen 8443 | \
#       sudo tee /etc/nginx/sites-available/fmtl-fleet > /dev/null
#   sudo ln -s ../sites-available/fmtl-fleet /etc/nginx/sites-enabled/
#   sudo nginx -t && sudo systemctl reload nginx
set -euo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
die() { echo "make-fleet-proxy.sh: $*" >&2; exit 2; }
[[ $# -ge 1 ]] || { usage >&2; exit 2; }
if [[ "$1" == "-h" || "$1" == "--help" ]]; then usage; exit 0; fi
cert_dir=$1
shift
listen=8443 upstream=127.0.0.1:8000 standalone=""
while [[ $# -gt 0 ]]; do
    [[ $# -ge 2 ]] || die "option $1 needs a value"
    case "$1" in
        --listen) listen=$2 ;;
        --upstream) upstream=$2 ;;
        --standalone) standalone=$2 ;;
        *) die "unknown option $1 (see --help)" ;;
    esac
    shift 2
done
listen_re='^([]A-Za-z0-9.:_[-]+:)?[0-9]+$' upstream_re='^[]A-Za-z0-9.:_[-]+:[0-9]+$'
[[ "$listen" =~ $listen_re ]] || die "--listen must be [ADDR:]PORT, got '$listen'"
[[ "$upstream" =~ $upstream_re ]] || die "--upstream must be HOST:PORT, got '$upstream'"
[[ -d "$cert_dir" ]] || die "no directory $cert_dir (make it with deploy/make-certs.sh)"
cert_dir=$(cd "$cert_dir" && pwd)
for f in ca.crt server.crt server.key; do
    [[ -f "$cert_dir/$f" ]] || die "$cert_dir: no $f (make it with deploy/make-certs.sh)"
done
template=$(dirname "$0")/nginx/fleet-proxy.conf
[[ -f "$template" ]] || die "no template $template"

server_block() {
    sed -e "s|@LISTEN@|$listen|" -e "s|@UPSTREAM@|$upstream|" \
        -e "s|@SERVER_CRT@|$cert_dir/server.crt|" -e "s|@SERVER_KEY@|$cert_dir/server.key|" \
        -e "s|@CA_CRT@|$cert_dir/ca.crt|" "$template"
}

if [[ -z "$standalone" ]]; then
    server_block
    exit 0
fi
mkdir -p "$standalone/tmp"
standalone=$(cd "$standalone" && pwd)
server_block > "$standalone/fleet-proxy.conf"
cat > "$standalone/nginx.conf" <<CONF
# standalone nginx for one deployment (deploy/make-fleet-proxy.sh --standalone): one
# process in the foreground, as the calling user; stop it by its PID
daemon off;
master_process off;
worker_processes 1;
pid $standalone/nginx.pid;
error_log $standalone/error.log notice;
events { worker_connections 512; }
http {
    # the normalised path and where it went (- when nginx answered itself)
    log_format fleet '\$remote_addr "\$request" \$status uri=\$uri upstream=\$upstream_addr';
    access_log $standalone/access.log fleet;
    client_body_temp_path $standalone/tmp/body;
    proxy_temp_path $standalone/tmp/proxy;
    fastcgi_temp_path $standalone/tmp/fastcgi;
    uwsgi_temp_path $standalone/tmp/uwsgi;
    scgi_temp_path $standalone/tmp/scgi;
    include $standalone/fleet-proxy.conf;
}
CONF
echo "$standalone/nginx.conf"
