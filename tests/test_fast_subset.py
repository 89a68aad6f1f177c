"""tests/fast_subset.txt (make test-fast, make test-lowest) names tests that exist: a renamed or removed test fails
here, in the whole suite, instead of silently leaving its feature out of the lowest-versions run."""
import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _node_ids():
    with open(os.path.join(ROOT, "tests", "fast_subset.txt")) as f:
        return [line.split("#", 1)[0].strip() for line in f if line.split("#", 1)[0].strip()]


def test_fast_subset_names_existing_tests():
    ids = _node_ids()
    assert ids and len(ids) == len(set(ids)), ids
    for node in ids:
        path, _, name = node.partition("::")
        function, _, param = name.partition("[")
        assert path.startswith("tests/") and function.startswith("test_"), node
        with open(os.path.join(ROOT, path)) as f:
            tree = ast.parse(f.read())
        found = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function]
        assert found, f"{node}: no function {function} in {path}"
        if param:  # a parametrized case: its id must be one of the decorator's values
            assert re.fullmatch(r"[\w.-]+\]", param), node
            values = [ast.literal_eval(v) for d in found[0].decorator_list if isinstance(d, ast.Call)
                      and getattr(d.func, "attr", "") == "parametrize" for v in d.args[1].elts]
            assert param[:-1] in map(str, values), f"{node}: no case {param[:-1]} among {values}"
