#!/usr/bin/env bash
# Builds vLLM's CUDA environment for the GPU engine tier (make test-gpu-engine) in a venv of its own:
#
#   tools/gpu_env.sh [VENV]          # default .venv-gpu (git-ignored); or: make gpu-env
#   make test-gpu-engine PYTHON=.venv-gpu/bin/python
#
# The host needs: a CUDA-capable NVIDIA GPU with at least 40 GiB of memory (the tier runs eight engines at a
# time on it), an NVIDIA driver for CUDA 12.x or later (the CUDA of the torch wheel vLLM pins; the script
# prints it at the end), Python 3.10-3.12, and network access to PyPI. Nothing outside the venv is changed.
#
# Settings (environment):
#   VLLM_VERSION  the vLLM to install (default 0.23.0: vllm-ascend v0.23.0's vLLM, the one the tier's
#                 expectations were written for, e.g. the dynamic buffer's shared_by plan)
#   PYTHON        the interpreter the venv is made from (default python3)
#   SYSTEM_SITE=1 make the venv with --system-site-packages, over packages already installed for PYTHON
#                 (a torch of the version vLLM pins is then reused, not downloaded again)
#   MOONCAKE=1    also install Mooncake's CUDA build, for the tier's tiered-store engines (they skip
#                 without it, naming what is missing); it needs libibverbs1, librdmacm1 and libnuma1
#   GPU_MIN_GIB   the GPU memory the check asks for (default 40); 0 skips the check
set -euo pipefail

venv=${1:-.venv-gpu}
vllm_version=${VLLM_VERSION:-0.23.0}
python=${PYTHON:-python3}
min_gib=${GPU_MIN_GIB:-40}
mooncake_pin=mooncake-transfer-engine==0.3.13.post1
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

fail() { echo "gpu_env: $*" >&2; exit 1; }

check_python() {
  "$python" -c 'import sys; sys.exit(not (3, 10) <= sys.version_info[:2] <= (3, 12))' \
    || fail "$python is Python $("$python" -c 'import platform; print(platform.python_version())'); vLLM's CUDA wheels need 3.10-3.12 (set PYTHON)"
}

check_gpu() {
  [ "$min_gib" = 0 ] && return
  command -v nvidia-smi >/dev/null || fail "no nvidia-smi: this needs an NVIDIA GPU and its driver (GPU_MIN_GIB=0 skips the check)"
  local mib
  mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | sort -n | tail -1)
  [ "$mib" -ge $((min_gib * 1024)) ] || fail "the largest GPU has $mib MiB; the tier needs ${min_gib} GiB (GPU_MIN_GIB)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
}

make_venv() {
  if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv ${SYSTEM_SITE:+--system-site-packages} "$venv"
  fi
  "$venv/bin/python" -m pip install -q --upgrade pip
}

# vLLM with its CUDA dependencies (torch among them); the package's own requirements and the test tools.
# The package itself is not installed: make test-gpu-engine writes its metadata beside the sources
# (setup.py egg_info) and runs with the checkout on the path.
install() {
  local packages=("vllm==$vllm_version" numba requests pytest pytest-xdist filelock)
  [ "${MOONCAKE:-0}" = 1 ] && packages+=("$mooncake_pin")
  "$venv/bin/python" -m pip install "${packages[@]}"
}

verify() {
  "$venv/bin/python" - <<'PY'
import torch
import vllm

assert torch.cuda.is_available(), "torch sees no CUDA device: the driver is older than this torch's CUDA, or no GPU"
name = torch.cuda.get_device_name(0)
print(f"vllm {vllm.__version__}, torch {torch.__version__} (CUDA {torch.version.cuda}), {name}: ready")
PY
}

check_python
check_gpu
make_venv
install
verify
echo "next: make test-gpu-engine PYTHON=$venv/bin/python"
