"""Stub of ``sgl_kernel.scalar_type`` (async-rl CPU test environment).

SGLang builds module-level tables of quantization scalar types at import time
(e.g. ``scalar_types.uint4b8``).  Attribute access returns a plain marker
object; nothing here implements real quantized types.
"""


class ScalarType:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"ScalarType({self.name!r}, stub)"

    def __eq__(self, other) -> bool:
        return isinstance(other, ScalarType) and other.name == self.name

    def __hash__(self) -> int:
        return hash(("ScalarType", self.name))


class _ScalarTypes:
    def __getattr__(self, name: str) -> ScalarType:
        if name.startswith("__"):
            raise AttributeError(name)
        return ScalarType(name)


scalar_types = _ScalarTypes()
