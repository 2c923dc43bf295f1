#!/usr/bin/env bash
# CUDA MPS for several PEs on one GPU (run as root on the GPU machine):
#   bash scripts/mps.sh start|stop|restart|status
# Clients find the daemon through CUDA_MPS_PIPE_DIRECTORY: export the same CUDA_MPS_PIPE_DIRECTORY
# and CUDA_MPS_LOG_DIRECTORY to them (defaults below), and give each client its share of the SMs
# with CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (100 / PEs per GPU; NVSHMEM supports several PEs per GPU
# fully only when the shares sum to at most 100). Restart after a client failed: MPS then refuses
# new clients ("CUDA-capable device(s) is/are busy or unavailable") until the daemon restarts.
set -uo pipefail
export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/pydatacopy-mps}
export CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY:-/tmp/pydatacopy-mps-log}

# The kernel keeps 15 characters of a process name: nvidia-cuda-mps-control and -server are both
# "nvidia-cuda-mps" there.
mps_pids() { pgrep -x nvidia-cuda-mps; }
running() { mps_pids > /dev/null; }

start() {
  command -v nvidia-cuda-mps-control > /dev/null || { echo "mps: nvidia-cuda-mps-control not found"; return 1; }
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if running; then echo "mps: already running"; return 0; fi
  nvidia-cuda-mps-control -d || { echo "mps: nvidia-cuda-mps-control -d failed"; return 1; }
  for _ in $(seq 50); do running && break; sleep 0.1; done
  running || { echo "mps: the control daemon did not stay up; $(tail -n 3 "$CUDA_MPS_LOG_DIRECTORY/control.log" 2>/dev/null)"; return 1; }
  echo "mps: started (pipes in $CUDA_MPS_PIPE_DIRECTORY)"
}

stop() {
  running || return 0
  echo quit | nvidia-cuda-mps-control > /dev/null 2>&1
  for _ in $(seq 100); do  # quit waits for the server's clients: up to 10 s
    running || break
    sleep 0.1
  done
  # A client stuck in a kernel keeps the server: end the daemon and server this script started,
  # by their process IDs.
  local pids
  pids=$(mps_pids)
  if [ -n "$pids" ]; then
    echo "mps: did not quit within 10 s; ending processes $(echo $pids)"
    # shellcheck disable=SC2086  # one PID per word
    kill -9 $pids 2> /dev/null
    sleep 1
  fi
  echo "mps: stopped"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  restart) stop; start ;;
  status) if running; then echo "mps: running"; else echo "mps: not running"; exit 1; fi ;;
  *) echo "usage: bash scripts/mps.sh start|stop|restart|status"; exit 2 ;;
esac
