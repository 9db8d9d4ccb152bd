#!/usr/bin/env bash
# Launch jaxinfer on several processes that serve one model together (see docs/multihost.md).
#
# Localhost demo: N processes on this machine, each with its own simulated CPU devices:
#   scripts/launch_multihost.sh demo [N] [DEVICES_PER_PROCESS] [-- extra `jaxinfer serve` args]
#   e.g. scripts/launch_multihost.sh demo 2 4 -- --mesh data=2,tensor=4 --port 50051
#
# Real hosts: run the same command on every host, changing only the process id (0 on the host whose
# address is the coordinator; it also serves gRPC):
#   host 0:  scripts/launch_multihost.sh host 10.0.0.1:1234 2 0 -- --mesh data=2,tensor=8
#   host 1:  scripts/launch_multihost.sh host 10.0.0.1:1234 2 1 -- --mesh data=2,tensor=8
# The coordinator port and the next one (the control channel) must be reachable from every host.
# On a TPU pod slice, use your pod launcher (e.g. `gcloud ... tpu-vm ssh --worker=all --command=...`) to
# run the `host` form on every worker with its own id.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}

mode=${1:-demo}
shift || true

serve_args=()
collect_serve_args() {
    while [[ $# -gt 0 ]]; do
        if [[ "$1" == "--" ]]; then shift; serve_args=("$@"); return; fi
        shift
    done
}

case "$mode" in
demo)
    n=${1:-2}
    devices=${2:-4}
    collect_serve_args "$@"
    port=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    pids=()
    cleanup() {
        for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
        wait 2>/dev/null || true
    }
    trap cleanup EXIT INT TERM
    for ((i = 0; i < n; i++)); do
        JAX_PLATFORMS=cpu XLA_FLAGS="--xla_force_host_platform_device_count=$devices" \
            "$python" -m jaxinfer.cli serve --coordinator "127.0.0.1:$port" --num-processes "$n" \
            --process-id "$i" "${serve_args[@]}" > "multihost-process$i.log" 2>&1 &
        pids+=($!)
        echo "process $i: pid $!, log multihost-process$i.log"
    done
    echo "process 0 serves the front end; Ctrl-C stops every process"
    wait "${pids[0]}"
    ;;
host)
    if [[ $# -lt 3 ]]; then
        echo "usage: $0 host COORDINATOR_HOST:PORT NUM_PROCESSES PROCESS_ID [-- serve args]" >&2
        exit 2
    fi
    coordinator=$1 n=$2 id=$3
    shift 3
    collect_serve_args "$@"
    exec "$python" -m jaxinfer.cli serve --coordinator "$coordinator" --num-processes "$n" \
        --process-id "$id" "${serve_args[@]}"
    ;;
*)
    echo "usage: $0 demo [N] [DEVICES_PER_PROCESS] [-- serve args] | $0 host COORD N ID [-- serve args]" >&2
    exit 2
    ;;
esac
