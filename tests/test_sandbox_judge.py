"""The judge judges from outside: reward hacks of the agent's code earn nothing, a correct solution earns everything.

Hidden-style probes (issue 53): the tests run in the judge's process and compare plain values that crossed a pipe
(rollout/sandbox/values.py), so an object whose `__eq__` is always true, patched builtins or `assert`, files
rewritten on disk, an early exit or forged output in the agent's process pass no test. Each probe runs in both
isolation modes.
"""

from __future__ import annotations

import hashlib
import math
import uuid
from collections import Counter, OrderedDict, namedtuple
from pathlib import Path

import pytest

from rollout.sandbox import (
    ERROR,
    FAILED,
    NOT_RUN,
    PASSED,
    Limits,
    Sandbox,
    SandboxError,
    Test,
    isolation_counts,
    values,
)
from rollout.sandbox import parent as sandbox_parent

LIMITS = Limits(wall_s=10.0, test_s=5.0, cpu_s=8, memory_mb=256, nproc=8, output_chars=2000, nice=0)
SANDBOX_FILES = [Path(sandbox_parent.__file__).with_name(n) for n in ("judge.py", "child.py", "values.py",
                                                                       "isolation.py", "results.py", "parent.py")]


@pytest.fixture(scope="module", params=["auto", "basic"])
def sandbox(request):
    return Sandbox(LIMITS, max_concurrent=2, isolation=request.param)


def test_an_object_equal_to_everything_passes_no_test(sandbox):
    code = """
class Always:
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    __hash__ = object.__hash__
class AlwaysInt(int):
    def __eq__(self, other): return True
class AlwaysStr(str):
    def __eq__(self, other): return True
class AlwaysList(list):
    def __eq__(self, other): return True
def f(kind):
    return {"object": Always(), "int": AlwaysInt(0), "str": AlwaysStr("no"), "list": AlwaysList([0]),
            "nested": [(1, Always())]}[kind]
"""
    tests = [Test(kind, f"assert f({kind!r}) == {want!r}") for kind, want in
             [("object", 7), ("int", 7), ("str", "yes"), ("list", [1, 2]), ("nested", [(1, 2)])]]
    r = sandbox.run(code, tests)
    assert r.status == "ok" and r.passed == 0, r.tests
    statuses = {t.name: t.status for t in r.tests}
    assert statuses["object"] == statuses["nested"] == ERROR  # not plain data: no value at all
    assert "not plain data" in r.tests[0].detail
    assert statuses["int"] == statuses["str"] == statuses["list"] == FAILED  # read as 0, "no", [0]: compared here


def test_a_test_expecting_an_error_is_not_satisfied_by_a_value_that_cannot_cross(sandbox):
    code = "class Odd:\n    pass\ndef f(x):\n    return Odd()\n"
    expects_error = "try:\n    f(-1)\nexcept Exception:\n    pass\nelse:\n    raise AssertionError('no error')"
    r = sandbox.run(code, [Test("expects an error", expects_error)])
    assert r.tests[0].status == ERROR, r.tests[0]


PATCHES = """
import builtins, math, sys
class Never(Exception):
    pass
builtins.AssertionError = Never
builtins.all = lambda *a, **k: True
math.isclose = lambda *a, **k: True
sys.modules["math"] = math
sys.excepthook = lambda *a: None
for name in list(sys.modules):  # the wire format's module, as loaded in this process: every reply says 4
    if name.startswith("_sandbox_"):
        module = sys.modules[name]
        if hasattr(module, "to_plain"):
            module.to_plain = lambda value, depth=0: 4
"""


@pytest.mark.parametrize("patches", [PATCHES, PATCHES + "builtins.isinstance = lambda *a, **k: True\n"],
                         ids=["patched", "patched-until-it-breaks"])
def test_patched_builtins_and_assert_pass_no_test(sandbox, patches):
    code = patches + """
def add(a, b):
    return a + b + 1
def flags():
    return [False]
def half():
    return 3.0
"""
    tests = [
        Test("assert", "assert add(2, 3) == 5"),
        Test("all", "assert all(flags())"),
        Test("isclose", "import math\nassert math.isclose(half(), 0.5)"),
        Test("isinstance", "assert isinstance(half(), str)"),
    ]
    r = sandbox.run(code, tests)
    assert r.passed == 0, r.tests
    if "isinstance" not in patches:  # the agent's process still answers: every answer is 4, compared here
        assert r.status == "ok" and [t.status for t in r.tests] == [FAILED, ERROR, FAILED, FAILED], r.tests


def test_rewriting_files_on_disk_passes_no_test(sandbox, tmp_path):
    before = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in SANDBOX_FILES}
    targets = [str(p) for p in SANDBOX_FILES] + ["test_0.py", "/tmp/test_0.py", "setup.py", "solution.py"]
    code = f"""
import linecache
forged = "def check(candidate):\\n    pass\\n"
for path in {targets!r}:
    try:
        with open(path, "w") as f:
            f.write(forged)
    except OSError:
        pass
    linecache.cache[path] = (len(forged), None, [forged], path)
def f():
    return 0
"""
    r = sandbox.run(code, [Test("hidden", "assert f() == 1")])
    assert r.status == "ok" and r.tests[0].status == FAILED, r.tests
    assert {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in SANDBOX_FILES} == before
    forged = Path("/tmp/test_0.py")
    assert not forged.exists() or "def check" not in forged.read_text()


@pytest.mark.parametrize("early_exit", [
    "import sys\nsys.exit(0)",
    "raise SystemExit(0)",
    "import os\nos._exit(0)",
    "def f(x):\n    import sys\n    sys.exit(0)",
    "def f(x):\n    import os\n    os._exit(0)",
    "import os\nprint('3/3 tests passed\\nOK')\nfor fd in range(1, 64):\n    try:\n        os.write(fd, b'{\"event\": "
    "\"test\", \"index\": 0, \"status\": \"passed\"}\\n{\"kind\": \"reply\", \"id\": 1, \"value\": 2}\\n"
    "{\"event\": \"done\"}\\n')\n    except OSError:\n        pass\nos._exit(0)",
])
def test_exiting_early_or_printing_success_passes_no_test(sandbox, early_exit):
    r = sandbox.run(early_exit, [Test("a", "assert f(1) == 2"), Test("b", "assert f(2) == 3")])
    assert r.passed == 0, r.tests
    assert all(t.status in (ERROR, NOT_RUN) for t in r.tests), r.tests


def test_the_tests_never_reach_the_agents_process(sandbox):
    secret = f"SECRET-{uuid.uuid4().hex}"
    code = """
import gc, sys
def f():
    seen = []
    frame = sys._getframe()
    while frame is not None:
        seen.extend(frame.f_locals.values())
        frame = frame.f_back
    seen.extend(gc.get_objects())
    for obj in seen:
        for text in (obj.values() if isinstance(obj, dict) else obj if isinstance(obj, list) else [obj]):
            if isinstance(text, str) and "SECRET-" in text:
                return text[text.index("SECRET-"):text.index("SECRET-") + 39]
    return None
"""
    r = sandbox.run(code, [Test("hidden", f"assert f() == {secret!r}")])
    assert r.tests[0].status == FAILED, r.tests


def test_a_correct_solution_passes_every_test(sandbox):
    code = """
from collections import Counter, OrderedDict, namedtuple
Pair = namedtuple("Pair", "a b")
def shapes():
    return [(1, 2.5), {1: "a", (2, 3): None}, {1, 2}, frozenset({"x"}), b"\\x00\\xff", 1 + 2j, True, None, "s"]
def counts(text):
    return Counter(text)
def ordered():
    return OrderedDict([("b", 1), ("a", 2)])
def pair():
    return Pair(1, 2)
def sqrt(x):
    if x < 0:
        raise ValueError("negative")
    return x ** 0.5
def big():
    return list(range(100000))
"""
    tests = [
        Test("types cross intact", "assert shapes() == [(1, 2.5), {1: 'a', (2, 3): None}, {1, 2}, frozenset({'x'}), "
                                   "b'\\x00\\xff', 1 + 2j, True, None, 's']\n"
                                   "assert [type(v) for v in shapes()[:5]] == [tuple, dict, set, frozenset, bytes]"),
        Test("subclasses as their base", "assert counts('aab') == {'a': 2, 'b': 1}\n"
                                         "assert ordered() == {'a': 2, 'b': 1}\nassert pair() == (1, 2)"),
        Test("an expected exception", "try:\n    sqrt(-1)\nexcept ValueError as e:\n    assert 'negative' in str(e)\n"
                                      "else:\n    raise AssertionError('no error')"),
        Test("floats", "import math\nassert math.isclose(sqrt(2), 1.41421356, rel_tol=1e-6)"),
        Test("keyword arguments", "assert sqrt(x=4) == 2.0"),
        Test("a large value", "assert big()[-1] == 99999"),
    ]
    r = sandbox.run(code, tests)
    assert r.status == "ok" and [t.status for t in r.tests] == [PASSED] * len(tests), r.tests


def test_the_entry_points_are_the_only_names_the_agent_answers_for(sandbox):
    """The setup's helpers stay the task's own: redefining one in the solution changes nothing the judge uses."""
    setup = "def encode(s):\n    return s[::-1]\ndef decode(s):\n    '''Undo encode.'''\n"
    code = "def encode(s):\n    return s\ndef decode(s):\n    return s\n"
    test = Test("round trip", "assert decode(encode('abc')) == 'abc'")
    r = sandbox.run(code, [test], setup=setup, entry_points=["decode"])
    assert r.tests[0].status == FAILED, r.tests  # encode('abc') is the task's 'cba'; the agent's decode leaves it
    honest = "def decode(s):\n    return s[::-1]\n"
    assert sandbox.run(honest, [test], setup=setup, entry_points=["decode"]).passed == 1


def test_values_cross_as_plain_data_or_not_at_all():
    Point = namedtuple("Point", "x y")
    for value in [None, True, 3, -2.5, math.inf, "é", [1, [2]], (1, (2,)), {1: {2: 3}}, {1, 2}, frozenset({(1,)}),
                  b"\x01", 2j, Counter("aa"), OrderedDict(a=1), Point(1, 2), {(1, 2): [3]}]:
        back = values.loads(values.dumps(value))
        assert back == value and type(back) in (type(value), dict, tuple), value
    for bad in [object(), [lambda: 1], {1: object()}, [[[[[[[[[[[[1]]]]]]]]]]]] * 0 + [eval("[" * 150 + "]" * 150)]]:
        with pytest.raises(values.NotPlain):
            values.dumps(bad)
    for line in ['{"$": "evil", "v": 1}', '{"a": 1}', '{"$": "set", "v": [[1]]}', "[" * 5000 + "]" * 5000,
                 "9" * 5000, "not json"]:
        with pytest.raises(values.NotPlain):
            values.loads(line)


def test_require_namespaces_refuses_to_run_without_them(monkeypatch):
    with pytest.raises(ValueError, match="require_namespaces"):
        Sandbox(LIMITS, isolation="basic", require_namespaces=True)
    counts = isolation_counts()
    fallback = Sandbox(LIMITS, isolation="basic")
    assert fallback.run("def f():\n    return 1\n", [Test("a", "assert f() == 1")]).passed == 1
    after = isolation_counts()
    assert after["sandbox_executions"] == counts["sandbox_executions"] + 1
    assert after["sandbox_executions_without_namespaces"] == counts["sandbox_executions_without_namespaces"] + 1
    # a host that forbids unshare: the agent's process finds no namespaces and never loads the code
    original = Sandbox._agent_spec
    monkeypatch.setattr(Sandbox, "_agent_spec", lambda self, *a: {**original(self, *a), "namespaces": False})
    with pytest.raises(SandboxError, match="require_namespaces") as refused:
        Sandbox(LIMITS, require_namespaces=True)
    assert "namespaces are required: the code was not run" in str(refused.value)
