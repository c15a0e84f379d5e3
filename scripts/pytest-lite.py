#!/usr/bin/env python3
"""Runs pytest-style test files where pytest is not installed (a GPU host with only the
driver, PyTorch and NumPy): each `test_*` function, with `tmp_path` given, and the few pytest
helpers the tests use (raises, skip, fail). Exit status 1 if any test failed.

    scripts/pytest-lite.py python/tests/test_package.py
"""

import contextlib
import importlib.util
import inspect
import pathlib
import re
import shutil
import sys
import tempfile
import traceback
import types


class Skipped(Exception):
    pass


class Failed(AssertionError):
    pass


class _Raised:
    value = None


@contextlib.contextmanager
def raises(kind, match=None):
    info = _Raised()
    try:
        yield info
    except kind as e:
        info.value = e
        if match is not None and not re.search(match, str(e)):
            raise Failed(f"{e!r} does not match {match!r}") from e
    else:
        raise Failed(f"did not raise {kind}")


def skip(reason=""):
    raise Skipped(reason)


def fail(reason=""):
    raise Failed(reason)


def main(paths):
    stub = types.ModuleType("pytest")
    stub.raises, stub.skip, stub.fail = raises, skip, fail
    sys.modules["pytest"] = stub
    passed = failed = skipped = 0
    for path in paths:
        spec = importlib.util.spec_from_file_location(pathlib.Path(path).stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        for name, test in inspect.getmembers(module, inspect.isfunction):
            if not name.startswith("test_") or test.__module__ != module.__name__:
                continue
            tmp = pathlib.Path(tempfile.mkdtemp(prefix="test-"))
            kwargs = {"tmp_path": tmp} if "tmp_path" in inspect.signature(test).parameters else {}
            try:
                test(**kwargs)
                passed += 1
                print(f"PASSED {name}")
            except Skipped as e:
                skipped += 1
                print(f"SKIPPED {name}: {e}")
            except Exception:
                failed += 1
                print(f"FAILED {name}\n{traceback.format_exc()}")
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    print(f"{passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
