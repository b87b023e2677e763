#!/usr/bin/env bash
# One entry point for people and CI. Creates (or reuses) ./.venv, installs the project
# (with torch's CPU build unless the venv already has a torch), then runs what you ask for.
#
#   ./dev.sh demo        a local swarm (2 stages x 2 node processes) on the bundled corpus
#   ./dev.sh test        ruff (as lint), then the default test suite (slow tests excluded)
#   ./dev.sh lint        only ruff over swarm_node, bootstrap, bench and tests (pyproject's rules)
#   ./dev.sh test-unit   only the unit tier (CI runs it on each supported Python)
#   ./dev.sh test-slow   only the slow tests (long convergence runs)
#   ./dev.sh test-gpu    only the GPU tier (tests/gpu; needs a CUDA device, skipped without one)
#   ./dev.sh bench       the quick benchmarks (under 15 min), then BENCHMARKS.md (--full: long ones)
#   ./dev.sh shell       a shell inside the virtual environment
set -euo pipefail
cd "$(dirname "$0")"

TORCH_VERSION="${SWARM_TORCH_VERSION:-2.13.0}"
VENV="${SWARM_VENV:-.venv}"
# --no-compile: byte-compiling every module of torch, scipy and sympy at install was
# about half the install's CPU; tools/compile_imports.py then compiles what we import.
PIP_INSTALL=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-compile)

SUPPORTED_PYTHONS=(3.11 3.12 3.13)  # pyproject.toml's classifiers; CI tests each (.ci/run)

find_python() {
    # SWARM_PYTHON: an interpreter (python3.12, /usr/bin/python3) or a version (3.12);
    # otherwise the first supported one on PATH, then one pyenv holds.
    local wanted=("${SWARM_PYTHON:-}") candidate version
    [[ -n "${SWARM_PYTHON:-}" ]] || wanted=("${SUPPORTED_PYTHONS[@]/#/python}" python3 python)
    for candidate in "${wanted[@]}"; do
        [[ "$candidate" =~ ^3\.[0-9]+$ ]] && candidate="python$candidate"
        if supported_python "$candidate"; then echo "$candidate"; return 0; fi
    done
    if command -v pyenv >/dev/null 2>&1; then
        for version in "${SUPPORTED_PYTHONS[@]}"; do
            [[ -z "${SWARM_PYTHON:-}" || "${SWARM_PYTHON#python}" == "$version" ]] || continue
            candidate="$(pyenv prefix "$(pyenv latest "$version" 2>/dev/null)" 2>/dev/null)/bin/python" || continue
            if supported_python "$candidate"; then echo "$candidate"; return 0; fi
        done
    fi
    echo "dev.sh: Python ${SWARM_PYTHON:-${SUPPORTED_PYTHONS[*]}} not found (supported: ${SUPPORTED_PYTHONS[*]}; set SWARM_PYTHON to pick one)" >&2
    return 1
}

supported_python() {
    local found
    found="$("$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)" || return 1
    [[ " ${SUPPORTED_PYTHONS[*]} " == *" $found "* ]]
}

ensure_venv() {
    local extras="${1:-test}"  # test: the default tiers; the slow tier adds hf, tensorboard, wandb, hf-datasets
    if [[ ! -x "$VENV/bin/python" ]]; then
        echo "dev.sh: creating $VENV" >&2
        "$(find_python)" -m venv "$VENV"
    fi
    # Reinstall only when the package metadata changed since the last install.
    local stamp="$VENV/.swarm-install-stamp-${extras//,/-}"
    local want
    want="$(cat pyproject.toml setup.py | sha256sum | cut -d' ' -f1)-torch$TORCH_VERSION"
    if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
        echo "dev.sh: installing swarm-node and its dependencies into $VENV (about a minute)" >&2
        ensure_torch
        "${PIP_INSTALL[@]}" -e ".[$extras]" 2> >(grep -v "is ignored: it is neither" >&2)
        "$VENV/bin/python" tools/compile_imports.py
        echo "$want" > "$stamp"
        echo "dev.sh: installed; to run swarm-node and swarm-bootstrap directly: . $VENV/bin/activate" >&2
    fi
}

ensure_torch() {
    # A torch already in the venv stays (a CUDA build you installed on purpose, say).
    # Otherwise the CPU build: PyPI's Linux x86_64 wheel of torch is the CUDA one, several
    # GB, so ask for the +cpu build, from a local wheel or index when pip has one, else
    # from PyTorch's CPU index (about 200 MB). Other platforms' PyPI wheels are CPU builds.
    "$VENV/bin/python" -c "import torch" 2>/dev/null && return 0
    # Where PyTorch's index cannot be reached (a CI that reaches only PyPI), PyPI's CUDA
    # build: several GB, but it runs on a CPU.
    if [[ "$(uname -s)-$(uname -m)" == Linux-x86_64 ]]; then
        "${PIP_INSTALL[@]}" "torch==$TORCH_VERSION+cpu" 2>/dev/null ||
            "${PIP_INSTALL[@]}" "torch==$TORCH_VERSION+cpu" --timeout 15 --retries 1 \
                --extra-index-url https://download.pytorch.org/whl/cpu 2>/dev/null ||
            { echo "dev.sh: PyTorch's CPU index unreachable; installing PyPI's torch (several GB)" >&2
              "${PIP_INSTALL[@]}" "torch==$TORCH_VERSION" 2> >(grep -v "is ignored: it is neither" >&2); }
    else
        "${PIP_INSTALL[@]}" "torch==$TORCH_VERSION"
    fi
}

lint() {
    # The rules are pyproject.toml's [tool.ruff.lint]; ruff is pinned in the test extra.
    "$VENV/bin/ruff" check --quiet swarm_node bootstrap bench tests || {
        echo "dev.sh: ruff found the violations above (\`$VENV/bin/ruff check --fix\` fixes some); no tests run" >&2
        return 1
    }
}

cmd="${1:-help}"
shift || true
case "$cmd" in
    demo)
        ensure_venv
        mkdir -p runs/demo
        exec "$VENV/bin/swarm-node" local --stages 2 --replicas 2 --model debug --data corpus \
            --steps 300 --json-out runs/demo/summary.json "$@"
        ;;
    test)
        ensure_venv
        lint
        # One worker per core, a test file per worker: most tests wait on processes and
        # networks, and a file's tests share its swarm. Files go out in the order
        # tests/conftest.py sets (the longest first).
        exec "$VENV/bin/python" -m pytest -q -n "${SWARM_TEST_WORKERS:-auto}" --dist loadfile \
            --no-loadscope-reorder "$@"
        ;;
    lint)
        ensure_venv
        lint
        ;;
    test-unit)
        ensure_venv
        exec "$VENV/bin/python" -m pytest -q -n "${SWARM_TEST_WORKERS:-auto}" tests/unit "$@"
        ;;
    test-slow)
        ensure_venv test,hf,tensorboard,wandb,hf-datasets
        exec "$VENV/bin/python" -m pytest -q -m slow "$@"
        ;;
    test-gpu)
        ensure_venv test,hf
        exec "$VENV/bin/python" -m pytest -q -m gpu tests/gpu "$@"
        ;;
    bench)
        ensure_venv
        exec "$VENV/bin/python" -m bench.run_all "$@"
        ;;
    shell)
        ensure_venv
        exec bash --rcfile <(echo "source $VENV/bin/activate")
        ;;
    *)
        sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
        [[ "$cmd" == help || "$cmd" == -h || "$cmd" == --help ]] || exit 2
        ;;
esac
