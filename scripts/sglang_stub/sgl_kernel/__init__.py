"""Stub ``sgl_kernel`` for running SGLang's CPU engine in tests.

SGLang imports ``sgl_kernel`` (and submodules such as ``sgl_kernel.kvcacheio``)
unconditionally in many places, but the real package only ships CUDA builds.
This stub satisfies those imports.  Every attribute is a callable placeholder
that raises ``NotImplementedError`` when called, so an accidental use of a GPU
kernel fails loudly instead of silently.

Installed by scripts/build_sglang_env.sh into the SGLang venv only.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+asyncrl.stub"
IS_ASYNC_RL_STUB = True


def _make_placeholder(qualname: str):
    def _placeholder(*args, **kwargs):
        raise NotImplementedError(
            f"{qualname} is provided by the async-rl sgl_kernel stub; "
            "GPU kernels are not available in this CPU-only environment"
        )

    _placeholder.__name__ = qualname.rsplit(".", 1)[-1]
    _placeholder.__qualname__ = qualname
    _placeholder.__module__ = qualname.rsplit(".", 1)[0]
    _placeholder._async_rl_stub = True
    return _placeholder


class _StubModule(types.ModuleType):
    """Module whose unknown attributes are raising placeholders."""

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = _make_placeholder(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves any ``sgl_kernel.<sub>`` import with an empty stub package."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = _StubModule(spec.name)
        mod.__path__ = []
        return mod

    def exec_module(self, module):
        return None


# Appended (not prepended) so that real files in this package directory, such
# as scalar_type.py, are found first by the normal path finder.
if not any(isinstance(f, _StubFinder) for f in sys.meta_path):
    sys.meta_path.append(_StubFinder())

# Make this module itself resolve unknown attributes to placeholders.
sys.modules[__name__].__class__ = _StubModule
