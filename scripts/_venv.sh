# Shared venv set-up, sourced by scripts/test, scripts/demo and the benchmarks.
# ensure_venv cpu|xla  -> creates/updates the lane's venv and sets $PY.
# The CPU lane installs torch==2.13.0 (a CPU wheel) *before* the project, or pip pulls a multi-GB CUDA build.
ensure_venv() {
    local lane=$1 root venv stamp want
    root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    if [[ $lane == xla ]]; then venv=$root/.venv-xla; else venv=$root/.venv; fi
    [[ -x $venv/bin/python ]] || python3 -m venv "$venv"
    PY=$venv/bin/python
    stamp=$venv/.adapter-manager-stamp
    want=$(cat "$root/pyproject.toml" "$root/scripts/_venv.sh" | sha256sum | cut -d' ' -f1)
    if [[ -f $stamp && $(cat "$stamp") == "$want" ]]; then return 0; fi
    need_disk "$root" "$([[ $lane == xla ]] && echo 9 || echo 3)" "the $lane lane's venv ($venv)"
    "$PY" -m pip install -q --upgrade pip >/dev/null
    if [[ $lane == xla ]]; then
        "$PY" -m pip install -q torch==2.9.0 torch_xla==2.9.0 jax==0.7.1 jaxlib==0.7.1 torchax==0.0.7 "flax>=0.11,<0.12"
        "$PY" -m pip install -q -e "$root[dev,xla]"
    else
        "$PY" -m pip install -q torch==2.13.0
        # cluster: ray[serve] for tests/runtime/cluster (~25 s); triton: a 286 MB wheel, its kernels' interpret-mode tests
        "$PY" -m pip install -q -e "$root[dev,cluster,triton]"
    fi
    echo "$want" > "$stamp"
}

# need_disk DIR GB WHAT -> fails with a clear message (not pip's "No space left on device" halfway through an
# install) when the file system of DIR has less than GB GiB free.
need_disk() {
    local free_kb
    free_kb=$(df -Pk "$1" | awk 'NR == 2 {print $4}')
    if (( free_kb < $2 * 1024 * 1024 )); then
        echo "error: $3 needs about $2 GiB free on the file system of $1; it has $((free_kb / 1024 / 1024)) GiB." >&2
        echo "Free some space (old clones, out/, /tmp) and run again." >&2
        return 1
    fi
}
