"""Integrations with model libraries (each an optional extra of the ``cakeops`` distribution).

``import cakeops`` installs :func:`install_transformers_hook`: once transformers' model code is
imported (before or after cakeops), ``experts_implementation="cakeops"`` is registered, with no
import of :mod:`cakeops.integrations.transformers` needed. Nothing else of transformers is
imported, and nothing happens where it is not installed."""

from __future__ import annotations

import importlib.abc
import sys
import warnings

#: the transformers module whose import registers cakeops (it defines ``PreTrainedModel``)
TRANSFORMERS_MODELS = "transformers.modeling_utils"


def register_with_transformers() -> None:
    """Import :mod:`cakeops.integrations.transformers` (which registers itself); a transformers
    too old to have an ``ExpertsInterface`` is left alone, any other failure is a warning: the
    user's import of transformers must not fail because of cakeops."""
    try:
        import cakeops.integrations.transformers  # noqa: F401
    except Exception as exc:
        too_old = isinstance(exc, ImportError) and ("ExpertsInterface" in str(exc)
                                                    or "moe" in str(exc))  # fmt: skip
        if not too_old:
            warnings.warn(f"cakeops: experts_implementation='cakeops' is not registered with "
                          f"transformers: {type(exc).__name__}: {exc}", RuntimeWarning,
                          stacklevel=2)  # fmt: skip


class _AfterTransformersModels(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when :data:`TRANSFORMERS_MODELS` is found by the other finders, it
    has that module's loader call :func:`register_with_transformers` after executing it."""

    def find_spec(self, fullname, path, target=None):
        if fullname != TRANSFORMERS_MODELS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        execute = loader.exec_module

        def exec_module(module):
            execute(module)
            register_with_transformers()

        loader.exec_module = exec_module  # this module's own loader instance
        return spec


def install_transformers_hook() -> None:
    """Register with transformers now if its model code is imported, or when it is (once)."""
    if TRANSFORMERS_MODELS in sys.modules:
        register_with_transformers()
    elif not any(isinstance(f, _AfterTransformersModels) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterTransformersModels())
