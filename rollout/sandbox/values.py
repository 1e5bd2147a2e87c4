"""Plain values across the sandbox's boundary: what the judge compares is built here from JSON, never an agent's object.

On the wire a value is JSON: null, booleans, numbers, strings and lists as themselves; a tuple, dict, set, frozenset,
bytes or complex as {"$": kind, "v": ...}. `to_plain` (in the agent's process) copies what a function returned into
that form: builtin containers of builtin scalars only, a subclass read as its base type (an int subclass's own
`__eq__` never crosses); anything else is refused. `loads` (in the judge) builds fresh builtins from a line and
refuses anything malformed, so whatever the agent's process writes, the judge holds only plain data.

Standard library only: rollout/sandbox/child.py and judge.py load it by path (they run with `-I -S`).
"""

from __future__ import annotations

import json

MAX_DEPTH = 100  # containers nested deeper than this are refused (either way across)


class NotPlain(ValueError):
    """A value that is not plain data, or a line that does not hold one."""


def to_plain(value: object, depth: int = 0) -> object:
    """`value` as a JSON-ready tree (NotPlain if it is not plain data)."""
    if depth > MAX_DEPTH:
        raise NotPlain(f"nested more than {MAX_DEPTH} deep")
    if value is None or value is True or value is False:
        return value
    if isinstance(value, int):
        return int.__index__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, list):
        return [to_plain(x, depth + 1) for x in list(value)]
    if isinstance(value, tuple):
        return {"$": "tuple", "v": [to_plain(x, depth + 1) for x in tuple(value)]}
    if isinstance(value, dict):
        return {"$": "dict", "v": [[to_plain(k, depth + 1), to_plain(v, depth + 1)] for k, v in dict.items(value)]}
    if isinstance(value, set | frozenset):
        kind = "frozenset" if isinstance(value, frozenset) else "set"
        return {"$": kind, "v": [to_plain(x, depth + 1) for x in list(value)]}
    if isinstance(value, bytes | bytearray):
        return {"$": "bytes", "v": bytes(value).hex()}
    if isinstance(value, complex):
        return {"$": "complex", "v": [complex.__complex__(value).real, complex.__complex__(value).imag]}
    raise NotPlain(f"a {type(value).__name__} is not plain data (return None, bool, int, float, str, bytes, "
                   "complex, or lists, tuples, dicts and sets of them)")


def dumps(value: object) -> str:
    """One line of JSON holding `value` (NotPlain if it is not plain data)."""
    return json.dumps(to_plain(value), separators=(",", ":"))


def from_plain(tree: object, depth: int = 0) -> object:
    """Fresh builtins from a decoded JSON tree (NotPlain if it is not one `to_plain` makes)."""
    if depth > MAX_DEPTH:
        raise NotPlain(f"nested more than {MAX_DEPTH} deep")
    kind = type(tree)
    if tree is None or kind in (bool, int, float, str):
        return tree
    if kind is list:
        return [from_plain(x, depth + 1) for x in tree]
    if kind is not dict or set(tree) != {"$", "v"}:
        raise NotPlain("not a plain value")
    tag, body = tree["$"], tree["v"]
    try:
        if tag == "tuple" and type(body) is list:
            return tuple(from_plain(x, depth + 1) for x in body)
        if tag in ("set", "frozenset") and type(body) is list:
            items = [from_plain(x, depth + 1) for x in body]
            return set(items) if tag == "set" else frozenset(items)
        if tag == "dict" and type(body) is list and all(type(p) is list and len(p) == 2 for p in body):
            return {from_plain(k, depth + 1): from_plain(v, depth + 1) for k, v in body}
        if tag == "bytes" and type(body) is str:
            return bytes.fromhex(body)
        if tag == "complex" and type(body) is list and len(body) == 2 and all(type(x) is float for x in body):
            return complex(body[0], body[1])
    except TypeError as exc:  # an unhashable key or member
        raise NotPlain(str(exc)) from None
    raise NotPlain(f"not a plain value (kind {tag!r})")


def loads(text: str | bytes) -> object:
    """The plain value in one line of JSON (NotPlain if it holds none)."""
    try:
        return from_plain(json.loads(text))
    except (ValueError, RecursionError) as exc:  # bad JSON, an int too long to convert, nesting too deep
        if isinstance(exc, NotPlain):
            raise
        raise NotPlain(f"not plain data: {type(exc).__name__}") from None
