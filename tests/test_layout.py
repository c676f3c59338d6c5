"""The package's shape, as the redesign left it: no import cycle inside it, and what a vLLM server says
about itself read in one module (``host.py``), so that a change in vLLM's configuration touches one file."""

from __future__ import annotations

import ast
from pathlib import Path

import epd_middleware

PACKAGE = Path(epd_middleware.__file__).parent
# vLLM's configuration objects and the app state's command line, by the names the code reads them.
VLLM_CONFIGURATION = frozenset(
    {
        "vllm_config",
        "ec_transfer_config",
        "kv_transfer_config",
        "parallel_config",
        "lora_config",
        "multimodal_config",
        "model_config",
        "trust_request_mm_kwargs",
        "enable_scale_out",
        "tokens_only",
    }
)


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every package module ``name`` imports, at any level of the file (TYPE_CHECKING blocks and
    functions included): an import cycle hidden in a function is still a cycle."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            submodules = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in known]
            targets = submodules if len(submodules) == len(node.names) else [base, *submodules]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def test_the_package_has_no_import_cycle() -> None:
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    done: set[str] = set()

    def walk(name: str, trail: list[str]) -> None:
        if name in trail:
            raise AssertionError("import cycle: " + " -> ".join([*trail[trail.index(name) :], name]))
        if name in done:
            return
        for target in sorted(graph[name]):
            walk(target, [*trail, name])
        done.add(name)

    for name in sorted(graph):
        walk(name, [])


def test_only_the_host_module_reads_vllms_configuration() -> None:
    readers = {}
    for name, path in modules().items():
        if name == "epd_middleware.host":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            attribute = node.attr if isinstance(node, ast.Attribute) else None
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", None) == "getattr"
                and len(node.args) > 1
            ):
                second = node.args[1]
                attribute = second.value if isinstance(second, ast.Constant) else None
            if attribute in VLLM_CONFIGURATION:
                readers.setdefault(name, set()).add(attribute)
    assert readers == {}


def test_the_test_seam_and_the_public_names() -> None:
    """What users and tests import from the package itself; the implementation lives in ``_`` modules."""
    assert {"EPDMiddleware", "EPDConfig", "Host", "Transport", "HttpxTransport", "HTTPError"} <= set(
        epd_middleware.__all__
    )
    public = {path.stem for path in PACKAGE.glob("*.py") if not path.stem.startswith("_")}
    assert public == {"cli", "config", "errors", "host", "transport", "vllm_plugin"}


# A function longer than this no longer fits in the head: split it along its seams (issue 35, item 8:
# the failover's call had grown to 112 lines with blame and tracing).
MAX_FUNCTION_LINES = 80


def test_no_function_of_the_package_passes_80_lines() -> None:
    long = [
        f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1})"
        for path in PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert long == []
