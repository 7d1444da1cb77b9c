#!/usr/bin/env bash
# Install flowerbed into the current Python environment (make a virtual environment
# first: python3 -m venv .venv && . .venv/bin/activate).
#   bash scripts/setup.sh          the package (simulation, strategies, clients)
#   bash scripts/setup.sh --dev    plus what the tests need: pytest, pytest-xdist, ruff,
#                                  mypy, ExecuTorch's Python runtime, a JDK and JUnit 4
# FLOWERBED_TORCH_INDEX=URL takes torch from that index, e.g. PyTorch's CPU wheels:
#   FLOWERBED_TORCH_INDEX=https://download.pytorch.org/whl/cpu bash scripts/setup.sh
# FLOWERBED_TORCH=VERSION installs that torch release instead of 2.13.0 (CI also runs
# the suite on the newest one; on Linux x86_64, PyPI's builds of it carry CUDA: GBs).
# Exits non-zero, with pip's own output, when anything fails to install.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
PY=${PYTHON:-python3}
case "${1:-}" in
  "" | --dev) ;;
  *) echo "usage: bash scripts/setup.sh [--dev]" >&2; exit 2 ;;
esac

# A system Python that refuses `pip install` (PEP 668, e.g. Debian's): say what to do.
if "$PY" - <<'EOF'
import sys, sysconfig, pathlib
in_venv = sys.prefix != sys.base_prefix
managed = pathlib.Path(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED").exists()
sys.exit(0 if managed and not in_venv else 1)
EOF
then
  echo "error: $PY is managed by the system and refuses pip installs; make a" \
    "virtual environment first: python3 -m venv .venv && . .venv/bin/activate" \
    "(Debian: apt-get install python3-venv)" >&2
  exit 1
fi

log=$(mktemp)
trap 'rm -f "$log"' EXIT

# pip, quietly: its output is shown only if it fails, or if it reports something other
# than ExecuTorch's dependencies, which --dev leaves out on purpose (see below).
pip_install() {
  if ! "$PY" -m pip install -q "$@" >"$log" 2>&1; then
    cat "$log" >&2
    echo "error: pip install $* failed (output above)" >&2
    exit 1
  fi
  # Also left out: pip's note on an index or find-links folder of pip's own
  # configuration that lacks a package ("Location ... is ignored").
  grep -v -e "^executorch .* requires " \
    -e "^ERROR: pip's dependency resolver does not currently take into account" \
    -e "^WARNING: Location '.*' is ignored: it is neither a file nor a directory" \
    "$log" >&2 || true
}

# torch first: a bare `torch` requirement on an empty environment pulls the newest
# build, on Linux x86_64 with several GB of CUDA packages; 2.13.0 (a CPU build) is
# the default this project is tested with, and the range in pyproject.toml is then
# satisfied.
torch_version=${FLOWERBED_TORCH:-2.13.0}
if ! "$PY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$torch_version')" 2>/dev/null; then
  if [ -n "${FLOWERBED_TORCH_INDEX:-}" ]; then
    pip_install "torch==$torch_version" --index-url "$FLOWERBED_TORCH_INDEX"
  else
    pip_install "torch==$torch_version"
  fi
fi

# flwr: the newest release the range in pyproject.toml allows. `pip install -e .`
# alone keeps an installed flwr that is inside the range (1.41 when 1.42 is out), so
# an environment set up earlier would go on running the older line.
flwr=$(sed -n 's/^ *"\(flwr\[simulation\][^"]*\)",$/\1/p' pyproject.toml)
if [ -z "$flwr" ]; then
  echo "error: pyproject.toml has no \"flwr[simulation]...\" dependency line" >&2
  exit 1
fi
pip_install --upgrade "$flwr"

if [ "${1:-}" != "--dev" ]; then
  pip_install -e .
  echo "flowerbed installed: try flowerbed --help"
  exit 0
fi
pip_install -e ".[dev]"

# ExecuTorch's Python runtime runs the phone training programs in the tests. Its
# wheel pins dependencies (torchao, pandas, coremltools, ...) that this project does
# not need and that would replace or add to torch, hence --no-deps and the list of
# what the runtime imports. `pip check` lists the rest as missing: that is expected.
if ! "$PY" -c "import executorch" 2>/dev/null; then
  pip_install --no-deps executorch==1.5.1
fi
pip_install flatbuffers pyyaml ruamel.yaml packaging numpy tabulate
if ! "$PY" -c "from executorch.exir import to_edge; from executorch.extension.training import get_sgd_optimizer" 2>"$log"; then
  cat "$log" >&2
  echo "error: ExecuTorch's Python runtime does not import (output above)" >&2
  exit 1
fi
echo "ExecuTorch 1.5.1 runtime installed without its pinned extras (expected)"

# A JDK and JUnit 4 for the phone core (android_client/core) from Debian.
need=()
command -v javac >/dev/null 2>&1 || need+=(default-jdk-headless)
[ -f /usr/share/java/junit4.jar ] || need+=(junit4)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    if ! { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}"; } >"$log" 2>&1; then
      cat "$log" >&2
      echo "error: apt-get install ${need[*]} failed (output above)" >&2
      exit 1
    fi
  else
    echo "note: the Java phone-core test needs ${need[*]}:" \
      "sudo apt-get install -y ${need[*]}" >&2
  fi
fi
echo "flowerbed and its test tools installed: python -m pytest"
