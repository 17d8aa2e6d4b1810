#!/usr/bin/env bash
# Start a Flower SuperLink and N SuperNodes on this machine (loopback by default).
#
#   deploy/start-local.sh N [options]
#
# SuperNode i (0 <= i < N) gets --node-config "task-id=<FIRST+i>" (the key fmtl_flower's
# ClientApps read), so N nodes serve tasks FIRST .. FIRST+N-1. The processes run in the
# background, each in its own session; the script returns once the SuperLink listens (and,
# with --auth, the node keys are registered). Everything it starts is recorded in RUN_DIR:
#
#   RUN_DIR/pids            one line per process: NAME PID START_TIME (stop.sh reads it)
#   RUN_DIR/logs/*.log      superlink.log, supernode-<i>.log
#   RUN_DIR/flwr-home/      FLWR_HOME of the SuperLink and of `flwr` (config.toml holds the
#                           connection FEDERATION)
#   RUN_DIR/nodes/node-<t>/ FLWR_HOME of SuperNode t (it unpacks the app's FAB there); its
#                           state/ is the node's client-state-dir (as in supernode@.service)
#                           unless --node-config sets one. The SuperNodes run under
#                           deploy/bin/fmtl-supernode (as in supernode@.service), which
#                           records the node id in fmtl-supernode.json there
#   RUN_DIR/env.sh          `. RUN_DIR/env.sh` exports FLWR_HOME (and PATH) for `flwr run`
#
# Options
#   --run-dir DIR        where to record it all (default: a new ${TMPDIR:-/tmp}/fmtl-deploy.XXXXXX;
#                        keep it outside the app directory, `flwr run .` packs *.toml files)
#   --port P             SuperLink port (Fleet, Control and Runtime APIs; default: a free port)
#   --node-ports P,P,..  Runtime API port of each SuperNode (default: free ports)
#   --host H             address the SuperLink binds (default 127.0.0.1; 0.0.0.0 for a fleet);
#                        with --fleet-proxy, the address the proxy binds instead
#   --fleet-proxy P      put nginx in front (needs --tls): the SuperLink binds 127.0.0.1
#                        only and nginx serves just its Fleet API on H:P (0: a free port);
#                        the SuperNodes dial the proxy, `flwr` the SuperLink on loopback.
#                        The Control API (runs, SuperNode registration) is then out of the
#                        devices' reach (deploy/make-fleet-proxy.sh, deploy/README.md)
#   --nginx PATH         the nginx executable (default: nginx on PATH, else /usr/sbin/nginx)
#   --first-task K       task id of the first node (default 0)
#   --node-config "..."  extra key=value pairs for every SuperNode's --node-config
#   --tls DIR            TLS with DIR/ca.crt, DIR/server.crt, DIR/server.key (make-certs.sh)
#   --auth DIR           SuperNode authentication with DIR/node-<i> keys (make-node-keys.sh);
#                        needs --tls. The SuperLink gets --enable-supernode-auth, each public
#                        key DIR/node-<FIRST+i>.pub is registered with `flwr supernode register`
#   --database FILE      SuperLink state in this SQLite file (default: in memory); keeps runs
#                        and registered node keys across SuperLink restarts
#   --federation NAME    name of the connection in config.toml (default: local)
#   --bin DIR            directory holding flower-superlink, flower-supernode, flower-superexec
#                        and flwr (default: found on PATH); it is put first on PATH because
#                        the SuperLink and SuperNodes start flower-superexec by name
#   --max-retries N, --max-wait-time S
#                        passed to every SuperNode (reconnection limits; default: none)
#
# Stop everything with: deploy/stop.sh RUN_DIR
set -euo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
die() { echo "start-local.sh: $*" >&2; exit 2; }

[[ $# -ge 1 ]] || { usage >&2; exit 2; }
if [[ "$1" == "-h" || "$1" == "--help" ]]; then usage; exit 0; fi
num_nodes=$1
shift
[[ "$num_nodes" =~ ^[0-9]+$ ]] || die "N must be a non-negative integer, got '$num_nodes'"

run_dir="" port="" node_ports="" host="127.0.0.1" first_task=0 extra_config=""
tls_dir="" auth_dir="" database="" federation="local" bin_dir="" max_retries="" max_wait_time=""
proxy_port="" nginx=""
while [[ $# -gt 0 ]]; do
    [[ $# -ge 2 ]] || die "option $1 needs a value"
    case "$1" in
        --run-dir) run_dir=$2 ;;
        --port) port=$2 ;;
        --node-ports) node_ports=$2 ;;
        --host) host=$2 ;;
        --first-task) first_task=$2 ;;
        --node-config) extra_config=$2 ;;
        --tls) tls_dir=$2 ;;
        --auth) auth_dir=$2 ;;
        --database) database=$2 ;;
        --federation) federation=$2 ;;
        --bin) bin_dir=$2 ;;
        --max-retries) max_retries=$2 ;;
        --max-wait-time) max_wait_time=$2 ;;
        --fleet-proxy) proxy_port=$2 ;;
        --nginx) nginx=$2 ;;
        *) die "unknown option $1 (see --help)" ;;
    esac
    shift 2
done
[[ "$first_task" =~ ^[0-9]+$ ]] || die "--first-task must be an integer"
[[ "$federation" =~ ^[A-Za-z0-9_-]+$ ]] || die "--federation must be a plain name"

if [[ -n "$bin_dir" ]]; then
    bin_dir=$(cd "$bin_dir" && pwd)
    export PATH="$bin_dir:$PATH"
fi
for exe in flower-superlink flower-supernode flower-superexec flwr; do
    command -v "$exe" >/dev/null || die "$exe not on PATH (activate the venv or pass --bin)"
done
# SuperNode/SuperLink spawn flower-superexec by name: make sure it is the one next to them
bin_dir=$(dirname "$(command -v flower-superlink)")
export PATH="$bin_dir:$PATH"
# no telemetry, no update check (unless the caller asked for them)
export FLWR_TELEMETRY_ENABLED=${FLWR_TELEMETRY_ENABLED:-0}
export FLWR_DISABLE_UPDATE_CHECK=${FLWR_DISABLE_UPDATE_CHECK:-1}

abspath() { (cd "$(dirname "$1")" && echo "$(pwd)/$(basename "$1")"); }

if [[ -n "$tls_dir" ]]; then
    for f in ca.crt server.crt server.key; do
        [[ -f "$tls_dir/$f" ]] || die "--tls $tls_dir: no $f (make it with deploy/make-certs.sh)"
    done
    ca=$(abspath "$tls_dir/ca.crt")
    server_crt=$(abspath "$tls_dir/server.crt")
    server_key=$(abspath "$tls_dir/server.key")
fi
if [[ -n "$proxy_port" ]]; then
    [[ "$proxy_port" =~ ^[0-9]+$ ]] || die "--fleet-proxy must be a port number (0: a free one)"
    [[ -n "$tls_dir" ]] || die "--fleet-proxy needs --tls (the proxy terminates TLS with server.crt)"
    [[ -n "$nginx" ]] || nginx=$(command -v nginx || echo /usr/sbin/nginx)
    [[ -x "$nginx" ]] || die "--fleet-proxy needs nginx ($nginx not found; Debian/Ubuntu/Raspberry Pi OS: apt-get install nginx-light)"
fi
if [[ -n "$auth_dir" ]]; then
    [[ -n "$tls_dir" ]] || die "--auth needs --tls (the SuperLink refuses node auth without TLS)"
    for ((i = 0; i < num_nodes; i++)); do
        t=$((first_task + i))
        [[ -f "$auth_dir/node-$t" && -f "$auth_dir/node-$t.pub" ]] ||
            die "--auth $auth_dir: no node-$t / node-$t.pub (make them with deploy/make-node-keys.sh)"
    done
    auth_dir=$(cd "$auth_dir" && pwd)
fi

# free TCP ports from the OS (python3 comes with flwr)
python=$(command -v python3 || command -v python)
free_ports() {
    "$python" -c '
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
for s in socks:
    s.close()' "$1"
}
[[ -n "$port" ]] || port=$(free_ports 1)
[[ "$proxy_port" != 0 ]] || proxy_port=$(free_ports 1)
if [[ -n "$node_ports" ]]; then
    IFS=, read -ra ports <<< "$node_ports"
    [[ ${#ports[@]} -eq $num_nodes ]] || die "--node-ports lists ${#ports[@]} ports for $num_nodes nodes"
elif [[ $num_nodes -gt 0 ]]; then
    read -ra ports <<< "$(free_ports "$num_nodes")"
fi

# where `flwr` connects (`flwr run`, `flwr supernode ...`, `flwr ls`): the SuperLink; where
# the SuperNodes connect: the SuperLink, or the proxy in front of it
connectable() { if [[ "$1" == "0.0.0.0" || "$1" == "::" ]]; then echo 127.0.0.1; else echo "$1"; fi; }
if [[ -n "$proxy_port" ]]; then
    proxy_host=$host host=127.0.0.1
    node_address="$(connectable "$proxy_host"):$proxy_port"
fi
address="$(connectable "$host"):$port"
[[ -n "$proxy_port" ]] || node_address=$address
listening() { (exec 3<> "/dev/tcp/${2:-$(connectable "$host")}/$1") 2> /dev/null; }
for p in "$port" "${ports[@]+"${ports[@]}"}"; do
    ! listening "$p" || die "something already listens on port $p"
done
if [[ -n "$proxy_port" ]]; then
    ! listening "$proxy_port" "$(connectable "$proxy_host")" || die "something already listens on port $proxy_port"
fi

if [[ -z "$run_dir" ]]; then
    run_dir=$(mktemp -d "${TMPDIR:-/tmp}/fmtl-deploy.XXXXXX")
else
    mkdir -p "$run_dir"
    [[ ! -s "$run_dir/pids" ]] || die "$run_dir/pids exists: stop that deployment first (deploy/stop.sh $run_dir)"
fi
run_dir=$(cd "$run_dir" && pwd)
logs=$run_dir/logs
home=$run_dir/flwr-home
mkdir -p "$logs" "$home"
: > "$run_dir/pids"

{
    echo "[superlink]"
    echo "default = \"$federation\""
    echo
    echo "[superlink.$federation]"
    echo "address = \"$address\""
    if [[ -n "$tls_dir" ]]; then
        echo "root-certificates = \"$ca\""
    else
        echo "insecure = true"
    fi
} > "$home/config.toml"
cat > "$run_dir/env.sh" <<ENV
# . this file to talk to the deployment recorded in $run_dir
export FLWR_HOME="$home"
export PATH="$bin_dir:\$PATH"
export FLWR_TELEMETRY_ENABLED=$FLWR_TELEMETRY_ENABLED
export FLWR_DISABLE_UPDATE_CHECK=$FLWR_DISABLE_UPDATE_CHECK
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
ENV

start_time() {  # field 22 of /proc/PID/stat: guards stop.sh against recycled PIDs
    local stat rest
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || { echo "-"; return; }
    rest=${stat##*) }
    read -ra fields <<< "$rest"
    echo "${fields[19]}"
}
spawn() {  # spawn NAME COMMAND...: background, own session, output to logs/NAME.log
    local name=$1
    shift
    # without job control a background child is no group leader: setsid execs, PID kept
    if command -v setsid > /dev/null; then
        setsid "$@" > "$logs/$name.log" 2>&1 < /dev/null &
    else
        nohup "$@" > "$logs/$name.log" 2>&1 < /dev/null &
    fi
    local pid=$!
    echo "$name $pid $(start_time "$pid")" >> "$run_dir/pids"
    echo "started $name (pid $pid, log $logs/$name.log)"
}
alive() { kill -0 "$1" 2> /dev/null; }

link_cmd=(flower-superlink --host "$host" --port "$port" --disable-runtime-dependency-installation)
if [[ -n "$tls_dir" ]]; then
    link_cmd+=(--ssl-ca-certfile "$ca" --ssl-certfile "$server_crt" --ssl-keyfile "$server_key")
else
    link_cmd+=(--insecure)
fi
[[ -n "$auth_dir" ]] && link_cmd+=(--enable-supernode-auth)
[[ -n "$database" ]] && link_cmd+=(--database "$(abspath "$database")")
# from here on, a failure stops whatever was started
started_ok=0
cleanup() {
    if [[ $started_ok -ne 1 && -s "$run_dir/pids" ]]; then
        echo "start-local.sh: failed; stopping what was started" >&2
        "$(dirname "$0")/stop.sh" "$run_dir" 10 >&2 || true
    fi
}
trap cleanup EXIT
# its SQLite state (--database: runs, registered node keys) and logs readable by us only
saved_umask=$(umask)
umask 077
spawn superlink env FLWR_HOME="$home" "${link_cmd[@]}"
umask "$saved_umask"
link_pid=$(awk '$1 == "superlink" {print $2}' "$run_dir/pids")

deadline=$((SECONDS + ${STARTUP_TIMEOUT:-60}))
until listening "$port"; do
    if ! alive "$link_pid"; then
        echo "start-local.sh: the SuperLink exited; its log:" >&2
        tail -n 30 "$logs/superlink.log" >&2
        exit 1
    fi
    if ((SECONDS > deadline)); then
        echo "start-local.sh: nothing listens on $address after ${STARTUP_TIMEOUT:-60} s" >&2
        exit 1
    fi
    sleep 0.3
done

if [[ -n "$proxy_port" ]]; then
    conf=$("$(dirname "$0")/make-fleet-proxy.sh" "$tls_dir" --listen "$proxy_host:$proxy_port" \
        --upstream "127.0.0.1:$port" --standalone "$run_dir/nginx")
    spawn fleet-proxy "$nginx" -p "$run_dir/nginx" -c "$conf" -e "$run_dir/nginx/error.log"
    proxy_pid=$(awk '$1 == "fleet-proxy" {print $2}' "$run_dir/pids")
    until listening "$proxy_port" "$(connectable "$proxy_host")"; do
        if ! alive "$proxy_pid"; then
            echo "start-local.sh: nginx exited; its logs:" >&2
            tail -n 30 "$logs/fleet-proxy.log" "$run_dir/nginx/error.log" >&2
            exit 1
        fi
        ((SECONDS <= deadline)) || { echo "start-local.sh: nginx does not listen on port $proxy_port" >&2; exit 1; }
        sleep 0.2
    done
fi

if [[ -n "$auth_dir" ]]; then
    # SuperNodes may only connect with a public key registered through the Control API
    for ((i = 0; i < num_nodes; i++)); do
        t=$((first_task + i))
        if FLWR_HOME=$home flwr supernode register "$auth_dir/node-$t.pub" "$federation" \
            --name "task-$t" > "$logs/register-$t.log" 2>&1; then
            echo "registered $auth_dir/node-$t.pub ($(grep -o 'SuperNode [0-9]* registered' \
                "$logs/register-$t.log" || echo "see $logs/register-$t.log"))"
        elif grep -q "Public key already in use" "$logs/register-$t.log"; then
            # a --database SuperLink remembers earlier registrations
            echo "$auth_dir/node-$t.pub was registered before (kept in the SuperLink's database)"
        else
            echo "start-local.sh: registering $auth_dir/node-$t.pub failed:" >&2
            cat "$logs/register-$t.log" >&2
            exit 1
        fi
    done
fi

launcher=$(cd "$(dirname "$0")" && pwd)/bin/fmtl-supernode
for ((i = 0; i < num_nodes; i++)); do
    t=$((first_task + i))
    node_config="task-id=$t"
    if [[ "$extra_config" != *client-state-dir* ]]; then
        # the device's dual state survives a server restart (a resubmitted run resumes it)
        mkdir -p "$run_dir/nodes/node-$t/state"
        node_config+=" client-state-dir='$run_dir/nodes/node-$t/state'"
    fi
    # fmtl-supernode: flower-supernode that rejoins after a crash (its old node id released
    # or waited out) and exits non-zero when the SuperLink no longer knows it
    node_cmd=("$launcher" --superlink "$node_address" --port "${ports[$i]}"
              --node-config "$node_config${extra_config:+ $extra_config}")
    if [[ -n "$tls_dir" ]]; then
        node_cmd+=(--root-certificates "$ca")
    else
        node_cmd+=(--insecure)
    fi
    [[ -n "$auth_dir" ]] && node_cmd+=(--auth-supernode-private-key "$auth_dir/node-$t")
    [[ -n "$max_retries" ]] && node_cmd+=(--max-retries "$max_retries")
    [[ -n "$max_wait_time" ]] && node_cmd+=(--max-wait-time "$max_wait_time")
    mkdir -p "$run_dir/nodes/node-$t"
    spawn "supernode-$t" env FLWR_HOME="$run_dir/nodes/node-$t" "${node_cmd[@]}"
done

started_ok=1
cat <<MSG

SuperLink on $address ($([[ -n "$tls_dir" ]] && echo "TLS, CA $ca" || echo insecure)$([[ -n "$auth_dir" ]] && echo ", node authentication")), $num_nodes SuperNode(s): tasks $first_task..$((first_task + num_nodes - 1)).
${proxy_port:+Devices reach only the Fleet API, through nginx on $proxy_host:$proxy_port (SuperNodes dial $node_address).
}Submit a run from the app directory (the repository root):

    . $run_dir/env.sh
    flwr run . $federation --stream --run-config "num-tasks=$((first_task + num_nodes)) num-server-rounds=5"

Stop everything:  $(dirname "$0")/stop.sh $run_dir
MSG
