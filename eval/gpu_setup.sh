# The setup the prepared GPU commands (eval/gpu_comparison.sh, eval/gpu_diagnosis.sh) share, sourced by them:
# their command line, and the packages. A GPU machine of the kind they were prepared for has PyTorch but lacks
# gymnasium, mujoco, tyro and minari, and has no network, so what this Python lacks is installed from carried wheels
# (docs/gpu.md names them). A command begins
#
#   . "$(dirname "$0")/gpu_setup.sh"
#   command_args "$@" || exit 2
#   ...
#   install_missing "$WHEELS" || exit $?
#
# command_args takes WHEELS_DIR OUT_DIR and sets WHEELS, OUT, ROOT (the repository) and PY (the Python: PYTHON,
# default python3); another count of arguments is the usage line. install_missing puts ROOT on PYTHONPATH and, where
# modules are missing, installs every wheel of WHEELS_DIR without a network into a folder (GPU_COMPARISON_SITE,
# default /tmp/primal-dt-site) put on PYTHONPATH too; INSTALLED then says what (empty when nothing was missing). A
# failure is one `error:` line on stderr and status 2 (1: pip failed).

command_args() {
    if [ $# -ne 2 ]; then
        echo "usage: $0 WHEELS_DIR OUT_DIR" >&2
        return 2
    fi
    WHEELS=$1
    OUT=$2
    ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    PY=${PYTHON:-python3}
}

NEEDED="gymnasium mujoco tyro minari yaml h5py tensorboard tqdm matplotlib PIL torch"

missing() {
    "$PY" -c "import importlib.util as u, sys; print(' '.join(m for m in sys.argv[1:] if u.find_spec(m) is None))" $NEEDED
}

install_missing() {
    local wheels_dir=$1 lacking still site
    INSTALLED=""
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
    lacking=$(missing)
    [ -z "$lacking" ] && return 0
    site=${GPU_COMPARISON_SITE:-/tmp/primal-dt-site}
    shopt -s nullglob
    local wheels=("$wheels_dir"/*.whl)
    if [ ${#wheels[@]} -eq 0 ]; then
        echo "error: this Python lacks $lacking and $wheels_dir holds no wheels; see docs/gpu.md for the pip download command" >&2
        return 2
    fi
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "${wheels[@]}" \
        || { echo "error: installing the wheels of $wheels_dir into $site failed (above)" >&2; return 1; }
    export PYTHONPATH="$ROOT:$site${PYTHONPATH#$ROOT}"
    still=$(missing)
    if [ -n "$still" ]; then
        echo "error: still missing after installing $wheels_dir: $still (add their wheels; docs/gpu.md lists them)" >&2
        return 2
    fi
    INSTALLED="installed from $wheels_dir: $lacking"
}
