"""Patch a module of vLLM as it is imported, in a lab server's processes only (never in the package):
what epd_lab/lab_site/sitecustomize.py installs runs before vLLM is imported, in every process."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType


def patch_on_import(patches: dict[str, Callable[[ModuleType], None]]) -> None:
    """Run ``patches[name]`` on the module ``name`` once it is executed (now, if it already is)."""
    waiting = {}
    for name, patch in patches.items():
        if name in sys.modules:
            patch(sys.modules[name])
        else:
            waiting[name] = patch
    if waiting:
        sys.meta_path.insert(0, _PatchOnImport(waiting))


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: lets the normal finders find the module, then patches it once executed."""

    def __init__(self, patches: dict[str, Callable[[ModuleType], None]]) -> None:
        self._patches = patches

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        patch = self._patches.pop(fullname, None)
        if patch is None:
            return None
        if not self._patches:
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_patch(module: ModuleType) -> None:
            exec_module(module)
            patch(module)

        loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec
