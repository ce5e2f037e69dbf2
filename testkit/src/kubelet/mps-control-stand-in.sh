#!/bin/bash
# A stand-in for nvidia-cuda-mps-control in tests (gpuledger_testkit::kubelet::node::mps_stand_in):
# -d starts a daemon that writes its PID where the real one does; without arguments it reads
# control commands on stdin like the real shell and records each in $CUDA_MPS_LOG_DIRECTORY/control.log.
set -u
P="$CUDA_MPS_PIPE_DIRECTORY"; L="$CUDA_MPS_LOG_DIRECTORY"
pidf="$P/nvidia-cuda-mps-control.pid"
log() { echo "$*" >> "$L/control.log"; }
alive() {
  [ -s "$pidf" ] || return 1
  local s; s=$(awk '{print $3}' "/proc/$(cat "$pidf")/stat" 2>/dev/null) || return 1
  [ -n "$s" ] && [ "$s" != Z ]
}
case "${1:-}" in
-d)
  if alive; then echo "An instance of this daemon is already running" >&2; exit 1; fi
  log "start CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES"
  # The daemon blocks in bash's own read on a FIFO it holds open: no process per tick.
  rm -f "$P/stand-in.fifo"; mkfifo "$P/stand-in.fifo"
  ( exec <>"$P/stand-in.fifo" >/dev/null 2>&1; while :; do read -r _; done ) &
  echo $! > "$pidf"
  exit 0;;
"") ;;
*) echo "unknown option $1" >&2; exit 2;;
esac
alive || { echo "Cannot find MPS control daemon process" >&2; exit 1; }
while read -r cmd args; do
  [ -z "$cmd" ] && continue
  log "$cmd${args:+ $args}"
  case "$cmd" in
    get_server_list) if [ -f "$P/servers" ]; then cat "$P/servers"; fi;;
    quit) kill "$(cat "$pidf")"; rm -f "$pidf";;
    set_default_device_pinned_mem_limit|set_default_active_thread_percentage) ;;
    set_device_pinned_mem_limit|set_active_thread_percentage) ;;
    *) echo "Invalid command $cmd";;
  esac
done
