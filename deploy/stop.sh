#!/usr/bin/env bash
# Stop the SuperLink and SuperNodes that deploy/start-local.sh started, by PID.
#
#   deploy/stop.sh RUN_DIR [GRACE]
#
# Reads RUN_DIR/pids (NAME PID START_TIME), sends SIGTERM to those PIDs (SuperNodes first,
# then the fleet proxy, the SuperLink last), waits up to GRACE seconds (default 20: a SuperNode can take ~15 s to
# wind down), then SIGKILLs any still alive. A PID whose start time no longer matches (the
# process ended and the PID was reused) is left alone. Processes Flower spawned below them
# (flower-superexec, ServerApp/ClientApp processes) normally exit with their parent; any
# still alive after that are stopped the same way, by PID. That includes orphans of a
# SuperLink or SuperNode that was killed earlier (e.g. a flwr-serverapp that outlived its
# SuperLink): start-local.sh starts each recorded process in its own session, and every
# process still in that session and started after its leader is stopped too.
# Exits 0 when none is left alive.
set -euo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
[[ $# -ge 1 ]] || { usage >&2; exit 2; }
if [[ "$1" == "-h" || "$1" == "--help" ]]; then usage; exit 0; fi
run_dir=$1
grace=${2:-20}
[[ "$grace" =~ ^[0-9]+$ ]] || { echo "stop.sh: GRACE must be whole seconds" >&2; exit 2; }
pids_file=$run_dir/pids
[[ -f "$pids_file" ]] || { echo "stop.sh: no $pids_file" >&2; exit 2; }

start_time() {
    local stat rest
    stat=$(cat "/proc/$1/stat" 2> /dev/null) || { echo "-"; return; }
    rest=${stat##*) }
    read -ra fields <<< "$rest"
    echo "${fields[19]}"
}
# alive PID START: the process runs (not a zombie) and is the one recorded
alive() {
    kill -0 "$1" 2> /dev/null || return 1
    if [[ -r "/proc/$1/stat" ]]; then
        local stat
        stat=$(cat "/proc/$1/stat" 2> /dev/null) || return 1
        [[ "${stat##*) }" != Z* ]] || return 1
        [[ "$2" == "-" || "$(start_time "$1")" == "$2" ]] || return 1
    fi
    return 0
}
descendants() {  # all descendants of PID, from `ps` (procps), deepest last
    local queue=("$1") pid child
    while [[ ${#queue[@]} -gt 0 ]]; do
        pid=${queue[0]}
        queue=("${queue[@]:1}")
        for child in $(ps -o pid= --ppid "$pid" 2> /dev/null); do
            echo "$child"
            queue+=("$child")
        done
    done
}
session_members() {  # PIDs in session SID (led by a recorded process) started after START
    local sid=$1 start=$2 pid
    for pid in $(ps -o pid= -s "$sid" 2> /dev/null); do
        [[ "$pid" == "$sid" ]] && continue
        [[ "$start" == "-" || "$(start_time "$pid")" -ge "$start" ]] 2> /dev/null && echo "$pid"
    done
}
# stop_all "PID START" ...: SIGTERM, wait up to $grace s, SIGKILL; prints survivors
stop_all() {
    local entry pid start left=()
    for entry in "$@"; do
        read -r pid start <<< "$entry"
        alive "$pid" "$start" && kill -TERM "$pid" 2> /dev/null && left+=("$entry")
    done
    local deadline=$((SECONDS + grace))
    while [[ ${#left[@]} -gt 0 && $SECONDS -lt $deadline ]]; do
        sleep 0.5
        local still=()
        for entry in "${left[@]}"; do
            read -r pid start <<< "$entry"
            alive "$pid" "$start" && still+=("$entry")
        done
        left=("${still[@]+"${still[@]}"}")
    done
    for entry in "${left[@]+"${left[@]}"}"; do
        read -r pid start <<< "$entry"
        echo "stop.sh: pid $pid still alive after ${grace} s: SIGKILL" >&2
        kill -KILL "$pid" 2> /dev/null || true
    done
    sleep 0.5
    for entry in "${left[@]+"${left[@]}"}"; do
        read -r pid start <<< "$entry"
        alive "$pid" "$start" && echo "$pid"
    done
    return 0
}

# SuperNodes first (they deregister from a live SuperLink), then the SuperLink
nodes=() proxy=() link=() children=()
while read -r name pid start; do
    [[ -n "${name:-}" ]] || continue
    if alive "$pid" "$start"; then
        for child in $(descendants "$pid"); do
            children+=("$child $(start_time "$child")")
        done
    fi
    for child in $(session_members "$pid" "$start"); do  # orphans of a killed process too
        [[ " ${children[*]+"${children[*]}"} " == *" $child "* ]] || \
            children+=("$child $(start_time "$child")")
    done
    case "$name" in
        superlink) link+=("$pid $start") ;;
        fleet-proxy) proxy+=("$pid $start") ;;
        *) nodes+=("$pid $start") ;;
    esac
done < "$pids_file"

survivors=$(stop_all "${nodes[@]+"${nodes[@]}"}")
# the proxy after the SuperNodes (they deregister through it), before the SuperLink
survivors+=$(stop_all "${proxy[@]+"${proxy[@]}"}")
survivors+=$(stop_all "${link[@]+"${link[@]}"}")
# whatever they spawned and left behind (normally nothing: superexec watches its parent;
# a flwr-serverapp orphaned by a SuperLink killed earlier is found through its session)
((grace > 5)) && grace=5
survivors+=$(stop_all "${children[@]+"${children[@]}"}")

if [[ -n "${survivors//[[:space:]]/}" ]]; then
    echo "stop.sh: still alive: $survivors" >&2
    exit 1
fi
mv "$pids_file" "$pids_file.stopped"
echo "stopped everything listed in $pids_file"
