#!/usr/bin/env bash
# make gpu-check: on a machine with an NVIDIA GPU, print what the node offers each isolation
# mode (driver, MIG, MPS binaries, cgroup version, dmem), then run gpu-alloc against a share in
# every mode the machine supports and say whether the allocation past the share failed.
#   GPU_CHECK_SHARE_MIB: the share (default 2048); GPU_CHECK_BIN: the built gpu-alloc.
# It needs root for the modes that change the node (EXCLUSIVE_PROCESS, cgroups). CI never runs
# it; docs/node-agent.md records what it printed on a lent GPU.
set -uo pipefail
BIN="${GPU_CHECK_BIN:-target/gpu-check/gpu-alloc}"
SHARE="${GPU_CHECK_SHARE_MIB:-2048}"
HAMI_LIB="${GPU_CHECK_HAMI_LIB:-/usr/local/vgpu/libvgpu.so}"
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu-check: no NVIDIA GPU here (nvidia-smi missing or lists none); gpu-alloc is built at $BIN, run make gpu-check on a GPU machine" >&2
    exit 2
fi
q() { nvidia-smi --query-gpu="$1" --format=csv,noheader 2>/dev/null | head -1; }
echo "== node"
echo "driver: $(q driver_version)   gpu: $(q name)   memory: $(q memory.total)"
echo "mig: $(q mig.mode.current)   compute mode: $(q compute_mode)"
if [ "$(stat -fc %T /sys/fs/cgroup)" = cgroup2fs ]; then
    echo "cgroup: v2 ($(cat /sys/fs/cgroup/cgroup.controllers))"
    [ -r /sys/fs/cgroup/dmem.capacity ] && echo "dmem.capacity:" && sed 's/^/  /' /sys/fs/cgroup/dmem.capacity
else
    echo "cgroup: v1"
fi
MPS=$(command -v nvidia-cuda-mps-control || true)
echo "mps: ${MPS:-no nvidia-cuda-mps-control}"
pgrep -a nvidia-cuda-mps >/dev/null && echo "mps: a daemon already runs: $(pgrep -a nvidia-cuda-mps | tr '\n' ' ')"
echo "hami-core: $([ -f "$HAMI_LIB" ] && echo "$HAMI_LIB" || echo "no library at $HAMI_LIB")"

run() { # mode, then the command; prints the mode's verdict
    local mode=$1; shift
    echo "== $mode"
    "$@"; local rc=$?
    case $rc in
        0) echo "$mode: PASS (the allocation past the share failed)";;
        3) echo "$mode: NOT HELD (allocations past the share succeeded)";;
        *) echo "$mode: did not run to a verdict (exit $rc)";;
    esac
}

run "none (nothing in front: expect NOT HELD)" "$BIN" "$SHARE"
if [ -f "$HAMI_LIB" ]; then
    run hami-core env LD_PRELOAD="$HAMI_LIB" CUDA_DEVICE_MEMORY_LIMIT_0="${SHARE}m" "$BIN" "$SHARE"
else
    echo "== hami-core: skipped (no library)"
fi
if [ -n "$MPS" ] && [ "$(q mig.mode.current)" != Enabled ] && [ "$(id -u)" = 0 ]; then
    PIPE=$(mktemp -d); LOG=$(mktemp -d); MODE_BEFORE=$(q compute_mode)
    nvidia-smi -i 0 -c EXCLUSIVE_PROCESS >/dev/null
    export CUDA_MPS_PIPE_DIRECTORY=$PIPE CUDA_MPS_LOG_DIRECTORY=$LOG
    CUDA_VISIBLE_DEVICES=0 "$MPS" -d
    printf 'set_default_device_pinned_mem_limit 0 %sM\nset_default_active_thread_percentage 50\n' "$SHARE" | "$MPS"
    run mps "$BIN" "$SHARE"
    echo quit | "$MPS"; sleep 1
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    [ "$MODE_BEFORE" = Default ] && nvidia-smi -i 0 -c DEFAULT >/dev/null
    rm -rf "$PIPE" "$LOG"
else
    echo "== mps: skipped (needs nvidia-cuda-mps-control, MIG off and root)"
fi
if [ -r /sys/fs/cgroup/dmem.capacity ] && [ "$(id -u)" = 0 ]; then
    REGION=$(awk 'NR==1{print $1}' /sys/fs/cgroup/dmem.capacity)
    CG=/sys/fs/cgroup/gpu-check-$$
    grep -qw dmem /sys/fs/cgroup/cgroup.subtree_control || echo +dmem > /sys/fs/cgroup/cgroup.subtree_control
    mkdir "$CG" && echo "$REGION $((SHARE << 20))" > "$CG/dmem.max"
    echo "dmem.max: $(cat "$CG/dmem.max")"
    run dmem sh -c "echo \$\$ > $CG/cgroup.procs && exec $BIN $SHARE"
    rmdir "$CG"
else
    echo "== dmem: skipped (needs cgroup v2 with dmem.capacity, driver r615+, and root)"
fi
echo "== nvml: the agent's sampling kills a process over its share within one --enforce-interval; run the agent with --isolation=nvml and gpu-alloc <share> 256 30 in a pod to see it"
