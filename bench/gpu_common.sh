# Sourced by the GPU scripts (bench/gpu_open_items.sh, bench/gpu_speed.sh) after they set `out`:
# the environment of a lent machine, `capped CAP_S COMMAND...` (a step with its own time cap, then
# SIGKILL, so a script ends inside a lease's one call) and the device's name in $out/device.txt.
mkdir -p "$out"
export PYTHONUNBUFFERED=1
# The lent machine's torch (2.11 + CUDA 13) is older than the pinned CPU build the couplings are
# tested on: run anyway, with the warning (src/lmforge/upstream.py, TESTED).
export LMFORGE_ALLOW_UNTESTED_VERSIONS=1
python=$(command -v python || command -v python3)  # the lent machine has python3 only
capped() {
    local cap=$1
    shift
    timeout --kill-after=5 "$cap" "$@" || echo "step ended with $? (124: cut at ${cap}s): $*"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt"
