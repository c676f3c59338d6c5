#!/usr/bin/env bash
# CI: the package as a user gets it, in two steps, each in a brand-new virtual environment under a
# temporary folder that is removed at the end (pass or fail). Packages come from pip's configured index.
#
#   bash scripts/check-install.sh            build the wheel, check what it holds, install it with its
#                                            declared dependencies and no extras, then import the package
#                                            and run the CLI (--version, check --help)
#   bash scripts/check-install.sh --lowest   install the project with its test extras and every direct
#                                            dependency at its declared lower bound
#                                            (constraints/lowest.txt, checked against pyproject.toml), then
#                                            run the unit tests; further arguments go to pytest instead of
#                                            the default selection
#
# PYTHON picks the interpreter for the new environments (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON="${PYTHON:-python3}"
PIP_FLAGS=(--quiet --disable-pip-version-check)

WORK=$(mktemp -d "${TMPDIR:-/tmp}/epd-check-install.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

step() { printf '== %s\n' "$*"; }
fail() {
  printf 'check-install: %s\n' "$*" >&2
  exit 1
}

wheel_install() {
  step "build the wheel"
  "$PYTHON" -m pip wheel "${PIP_FLAGS[@]}" --no-deps --wheel-dir "$WORK/dist" "$ROOT"
  local wheels=("$WORK"/dist/*.whl)
  [ "${#wheels[@]}" -eq 1 ] && [ -f "${wheels[0]}" ] || fail "expected one wheel, found: ${wheels[*]}"
  local wheel=${wheels[0]}
  echo "$(basename "$wheel")"

  step "check the wheel's contents and metadata"
  # Every module of the package that is not ignored by git must be in the wheel, with the LICENSE and
  # nothing else outside the package and its .dist-info (no tests).
  (cd "$ROOT" && git ls-files --cached --others --exclude-standard -- 'epd_middleware/*') >"$WORK/sources"
  "$PYTHON" - "$wheel" "$WORK/sources" <<'EOF'
import email.parser
import sys
import zipfile

wheel, sources = sys.argv[1], sys.argv[2]
names = set(zipfile.ZipFile(wheel).namelist())
problems = []
expected = {line.strip() for line in open(sources) if line.strip()}
missing = sorted(expected - names)
if missing:
    problems.append(f"package files missing: {missing}")
for required in ("epd_middleware/_http/__init__.py", "epd_middleware/_surfaces/__init__.py",
                 "epd_middleware/py.typed"):
    if required not in names:
        problems.append(f"{required} missing")
dist_info = {name.split("/")[0] for name in names if name.split("/")[0].endswith(".dist-info")}
if len(dist_info) != 1:
    problems.append(f"expected one .dist-info, found {sorted(dist_info)}")
info = dist_info.pop() if len(dist_info) == 1 else ""
stray = sorted(name for name in names if not name.startswith(("epd_middleware/", f"{info}/")))
if stray:
    problems.append(f"files outside the package: {stray}")
tests = sorted(name for name in names if "/tests/" in f"/{name}" or name.split("/")[-1].startswith("test_"))
if tests:
    problems.append(f"tests in the wheel: {tests}")
if f"{info}/licenses/LICENSE" not in names:
    problems.append("LICENSE missing from the .dist-info")
metadata = email.parser.Parser().parsestr(zipfile.ZipFile(wheel).read(f"{info}/METADATA").decode())
if metadata.get("License-Expression") != "Apache-2.0":
    problems.append(f"License-Expression is {metadata.get('License-Expression')!r}")
if "LICENSE" not in (metadata.get_all("License-File") or []):
    problems.append("License-File: LICENSE missing from the metadata")
if problems:
    sys.exit("\n".join(problems))
modules = sum(name.startswith("epd_middleware/") and name.endswith(".py") for name in names)
print(f"{modules} modules (_http/, _surfaces/ included), py.typed, {info}/licenses/LICENSE; no tests")
print(f"Metadata-Version {metadata['Metadata-Version']}, License-Expression {metadata['License-Expression']}")
EOF

  step "install it into a new environment (declared dependencies, no extras)"
  "$PYTHON" -m venv "$WORK/venv"
  "$WORK/venv/bin/python" -m pip install "${PIP_FLAGS[@]}" "$wheel"
  local bin=$WORK/venv/bin

  step "import it and run the CLI"
  # From the temporary folder, so that the checkout's own epd_middleware/ cannot be what is imported.
  cd "$WORK"
  local version
  version=$("$bin/python" - <<'EOF'
import importlib.metadata
import importlib.util
import sys

import epd_middleware

installed = importlib.metadata.version("epd-middleware")
if not epd_middleware.__file__.startswith(sys.prefix):
    sys.exit(f"imported {epd_middleware.__file__}, not the installed package")
if epd_middleware.__version__ != installed:
    sys.exit(f"epd_middleware.__version__ {epd_middleware.__version__} != the metadata's {installed}")
for optional in ("prometheus_client",):
    if importlib.util.find_spec(optional) is not None:
        print(f"note: {optional} is installed without the extra (a dependency brought it)", file=sys.stderr)
print(installed)
EOF
  )
  echo "import epd_middleware: ok, version $version"
  local said
  said=$("$bin/epd-middleware" --version)
  [[ "$said" =~ (^|[[:space:]])v?${version//./\\.}$ ]] ||
    fail "epd-middleware --version said '$said', expected it to end in the version $version"
  echo "epd-middleware --version: $said"
  "$bin/epd-middleware" check --help >"$WORK/check-help" || fail "epd-middleware check --help failed"
  grep -q "usage:" "$WORK/check-help" || fail "epd-middleware check --help printed no usage"
  echo "epd-middleware check --help: ok"
  cd "$ROOT"
}

lowest() {
  local constraints=$ROOT/constraints/lowest.txt
  step "install every direct dependency at its lower bound ($constraints)"
  "$PYTHON" -m venv "$WORK/venv"
  local python=$WORK/venv/bin/python
  "$python" -m pip install "${PIP_FLAGS[@]}" -c "$constraints" -e "$ROOT[test]"

  step "check the pins against pyproject.toml's lower bounds and what is installed"
  "$python" - "$ROOT/pyproject.toml" "$constraints" <<'EOF'
import importlib.metadata
import sys

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    print("note: no tomllib on this Python, the pins are not compared with pyproject.toml")
    sys.exit(0)

pyproject, constraints = sys.argv[1], sys.argv[2]
pins = {}
for line in open(constraints):
    line = line.split("#")[0].strip()
    if line:
        requirement = Requirement(line)
        (spec,) = requirement.specifier
        assert spec.operator == "==", line
        pins[canonicalize_name(requirement.name)] = Version(spec.version)
project = tomllib.load(open(pyproject, "rb"))["project"]
declared = project["dependencies"] + project["optional-dependencies"].get("metrics", [])
problems = []
for line in declared:
    requirement = Requirement(line)
    name = canonicalize_name(requirement.name)
    floors = [Version(spec.version) for spec in requirement.specifier if spec.operator == ">="]
    if not floors:
        problems.append(f"{line}: no lower bound")
    elif name not in pins:
        problems.append(f"{line}: not pinned in {constraints}")
    elif pins[name] != max(floors):
        problems.append(f"{line}: pinned at {pins[name]}, not at its lower bound {max(floors)}")
for name, version in pins.items():
    if Version(importlib.metadata.version(name)) != version:
        problems.append(f"{name} {importlib.metadata.version(name)} installed, pinned {version}")
if problems:
    sys.exit("\n".join(problems))
print(", ".join(f"{name} {version}" for name, version in pins.items()))
EOF

  step "unit tests on the lowest versions"
  if [ "$#" -eq 0 ]; then set -- -m "not e2e" -q; fi
  "$python" -m pytest -p no:cacheprovider "$@"
}

case "${1:-}" in
  --lowest)
    shift
    lowest "$@"
    ;;
  "") wheel_install ;;
  *) fail "unknown argument '$1' (use no argument, or --lowest [pytest arguments])" ;;
esac
