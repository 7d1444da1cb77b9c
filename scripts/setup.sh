#!/usr/bin/env bash
# Install flowerbed into the current Python environment.
#   bash scripts/setup.sh          the package (simulation, strategies, clients)
#   bash scripts/setup.sh --dev    plus what the tests need: pytest, ruff, mypy,
#                                  ExecuTorch's Python runtime, a JDK and JUnit 4
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
PY=${PYTHON:-python3}

# torch first: a bare `torch` requirement on an empty environment pulls the newest
# build with several GB of CUDA packages; 2.13.0 is the CPU build this project is
# tested with, and the range in pyproject.toml is then already satisfied.
if ! "$PY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
  "$PY" -m pip install -q torch==2.13.0
fi

if [ "${1:-}" != "--dev" ]; then
  "$PY" -m pip install -q -e .
  exit 0
fi
"$PY" -m pip install -q -e ".[dev]"

# ExecuTorch's Python runtime runs the phone training programs in the tests. Its
# wheel pins dependencies that would replace torch, hence --no-deps and the list.
if ! "$PY" -c "import executorch" 2>/dev/null; then
  "$PY" -m pip install -q --no-deps executorch==1.5.1
fi
"$PY" -m pip install -q flatbuffers pyyaml ruamel.yaml packaging numpy tabulate

# A JDK and JUnit 4 for the phone core (android_client/core) from Debian.
need=()
command -v javac >/dev/null 2>&1 || need+=(default-jdk-headless)
[ -f /usr/share/java/junit4.jar ] || need+=(junit4)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}"
  else
    echo "note: install ${need[*]} (sudo apt-get install -y ${need[*]}) for the Java tests" >&2
  fi
fi
