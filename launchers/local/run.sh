#!/bin/bash
# megatron-sao on one machine without Slurm: the Slurm job's flow (megatron_sao/platform/sao_job.sbatch.in) minus srun.
# A one-node Ray cluster on 127.0.0.1 with ports from this process's own block, the join
# barrier, the driver, Ray torn down, the driver's exit code returned. Run by `sao launch local`.
# Usage: run.sh RESOLVED_CONFIG.yaml PYTHON "SAO_COMMAND" CPUS
set -uo pipefail
CONFIG=$1; PYTHON=$2; COMMAND=$3; CPUS=${4:-1}
log() { echo "sao-local[$(date +%H:%M:%S)]: $*"; }

read -r FIRST_PORT PORT_COUNT < <("$PYTHON" -m megatron_sao.platform.slurm ports --job-id $$ --range 20000-29999) \
    || { log "no port block"; exit 1; }
export RAY_ADDRESS="127.0.0.1:$FIRST_PORT" MASTER_ADDR=127.0.0.1 MASTER_PORT=$((FIRST_PORT + 2)) \
    SAO_PORT_BASE=$((FIRST_PORT + 3)) PYTHONUNBUFFERED=1
# Token authentication with this run's own token, for ray start, the join barrier and the driver:
# never decided by whatever ~/.ray/auth_token holds (platform/ray_cluster.py says why).
RAY_AUTH_TOKEN=$("$PYTHON" -m megatron_sao.platform.ray_cluster token) || { log "no Ray token"; exit 1; }
export RAY_AUTH_MODE=token RAY_AUTH_TOKEN
RAY_TMP=/tmp/ray_sao_local_$$
"$PYTHON" -m megatron_sao.platform.ray_cluster start --ip 127.0.0.1 --first-port "$FIRST_PORT" \
    --port-count "$PORT_COUNT" --num-cpus "$CPUS" --num-gpus 0 --temp-dir "$RAY_TMP" &
RAY_PID=$!
# Ray's session files (logs, sockets, spilled objects) go with it.
stop_ray() { kill -TERM "$RAY_PID" 2>/dev/null; wait "$RAY_PID" 2>/dev/null; rm -rf "$RAY_TMP"; }
if ! "$PYTHON" -m megatron_sao.platform.ray_cluster wait --address "$RAY_ADDRESS" --nodes 1 \
        --cpus-per-node "$CPUS" --timeout 120; then
    stop_ray; log "Ray did not start (the line above says why)"; exit 3
fi
trap 'kill -TERM "$DRIVER_PID" 2>/dev/null' TERM INT
read -r -a SUB <<< "$COMMAND"
"$PYTHON" -m megatron_sao.cli "${SUB[@]}" "$CONFIG" checkpoint.resume=auto &
DRIVER_PID=$!
wait "$DRIVER_PID"; CODE=$?
while kill -0 "$DRIVER_PID" 2>/dev/null; do wait "$DRIVER_PID"; CODE=$?; done
stop_ray
log "driver exited with $CODE"
exit "$CODE"
