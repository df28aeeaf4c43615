"""Make mlx-lm's ``load_prompt_cache`` find mlxevict's cache classes, without importing mlx-lm early.

``load_prompt_cache`` rebuilds each cache with ``globals()[class_name].from_state(state)``
in ``mlx_lm.models.cache``, so mlxevict's class names must be set there. Doing
that at ``import mlxevict`` would import mlx-lm (about a second, with transformers)
in every process that imports mlxevict, the command line's ``--help`` included.
:func:`register_when_imported` sets them as soon as ``mlx_lm.models.cache`` is
imported (at once if it already is, else right after the import that loads it,
by a one-shot import hook). What it sets is a stand-in whose ``from_state``
imports the real class, calls it and puts the class in its place, so no
mlxevict module is imported in the middle of mlx-lm's import.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from importlib import import_module
from types import ModuleType
from typing import Any, Optional

MLX_LM_CACHE = "mlx_lm.models.cache"
CLASSES = {"EvictingKVCache": "mlxevict.cache", "QuantizedEvictingKVCache": "mlxevict.quantized"}


class _ByName:
    """Stands in ``mlx_lm.models.cache`` for one mlxevict class until ``load_prompt_cache`` needs it."""

    def __init__(self, namespace: dict, name: str):
        self.namespace, self.name = namespace, name

    def from_state(self, *args: Any, **kwargs: Any) -> Any:
        cls = getattr(import_module(CLASSES[self.name]), self.name)
        self.namespace[self.name] = cls  # the real class from now on
        return cls.from_state(*args, **kwargs)


def register(module: ModuleType) -> None:
    """Set mlxevict's class names on mlx-lm's cache module (stand-ins, unless the classes are already there)."""
    for name in CLASSES:
        if not isinstance(module.__dict__.get(name), type):
            module.__dict__[name] = _ByName(module.__dict__, name)

class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds ``mlx_lm.models.cache`` with the other finders and registers once its code has run."""

    def find_spec(self, name: str, path, target=None) -> Optional[importlib.machinery.ModuleSpec]:
        if name != MLX_LM_CACHE:
            return None
        sys.meta_path.remove(self)  # one shot; also keeps find_spec below from finding us again
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            register(module)

        spec.loader.exec_module = exec_module  # this loader instance serves this one module
        return spec


def register_when_imported() -> None:
    """Register mlxevict's classes in ``mlx_lm.models.cache`` now or when it is first imported."""
    module = sys.modules.get(MLX_LM_CACHE)
    if module is not None:
        register(module)
    elif not any(isinstance(finder, _AfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
