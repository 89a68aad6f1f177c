#!/usr/bin/env bash
# Prints the python of a venv that holds the lowest torch and transformers setup.py declares (plus the test
# dependencies), creating it first if needed. The venv lives outside the repository, cached across runs and clones:
#   ${HYBRID_PARALLEL_LOWEST_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/hybrid-parallel/venv-lowest}
# It is reused while its torch and transformers are exactly those versions and the test dependencies are installed;
# otherwise (a bound in setup.py moved, an interrupted build) it is deleted and built again. Downloads go through
# pip's own cache. Usage: .ci/venv-lowest.sh [python used to create the venv, default python3]
set -euo pipefail
cd "$(dirname "$0")/.."
BASE_PYTHON="${1:-python3}"
VENV="${HYBRID_PARALLEL_LOWEST_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/hybrid-parallel/venv-lowest}"

# the lower bounds of install_requires, e.g. "torch>=2.11,<2.16" -> 2.11
lowest() {
    "$BASE_PYTHON" - "$1" <<'PY'
import re, sys
text = re.search(r"install_requires=\[([^\]]*)\]", open("setup.py").read()).group(1)  # not the extras
found = re.findall(r'"%s\s*>=\s*([0-9][0-9.]*)' % re.escape(sys.argv[1]), text)
if len(found) != 1:
    sys.exit(f"setup.py: expected one lower bound for {sys.argv[1]}, found {found}")
print(found[0])
PY
}
TORCH="$(lowest torch)"
TRANSFORMERS="$(lowest transformers)"

# "2.11" is 2.11.0 (pip's == pads with zeros); a local tag (+cu130, +cpu) is the same release. Read from the
# installed packages' metadata, without importing them (seconds on every run); pip writes a package's metadata last.
matches() {
    [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - "$TORCH" "$TRANSFORMERS" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version
from packaging.version import Version
for name in ("accelerate", "peft", "pytest", "safetensors", "tqdm"):  # the test dependencies are there
    version(name)
def release(v):
    r = Version(v).release
    return r + (0,) * (3 - len(r))
sys.exit(0 if release(version("torch")) == release(sys.argv[1])
         and release(version("transformers")) == release(sys.argv[2]) else 1)
PY
}

mkdir -p "$(dirname "$VENV")"
if command -v flock >/dev/null; then  # one build at a time; a second make waits and then reuses it
    exec 9>"$VENV.lock"
    flock 9
fi
if ! matches; then
    echo "venv-lowest: building $VENV (torch==$TORCH, transformers==$TRANSFORMERS)" >&2
    rm -rf "$VENV"
    "$BASE_PYTHON" -m venv "$VENV"
    # torch's PyPI wheel is the CUDA build (with its nvidia-* packages); it runs on CPU as well
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check \
        "torch==$TORCH" "transformers==$TRANSFORMERS" pytest peft "accelerate>=1.15" safetensors tqdm packaging >&2
    matches || { echo "venv-lowest: $VENV does not hold torch==$TORCH, transformers==$TRANSFORMERS" >&2; exit 1; }
fi
echo "venv-lowest: $VENV (torch $TORCH, transformers $TRANSFORMERS)" >&2
echo "$VENV/bin/python"
