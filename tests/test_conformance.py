"""The conformance suite (shipped in ``cakeops.testing``) on every in-tree backend: every test
class of every ``cakeops.testing.test_*`` module, so an op's new module needs no wiring here.

A third-party backend runs the same classes with ``pytest --pyargs cakeops.testing``.
"""

import importlib
import pkgutil

import cakeops.testing

for _info in pkgutil.iter_modules(cakeops.testing.__path__):
    if _info.name.startswith("test_"):
        _module = importlib.import_module(f"cakeops.testing.{_info.name}")
        globals().update(
            {k: v for k, v in vars(_module).items() if k.startswith("Test") and isinstance(v, type)}
        )
