"""Module paths of rpcx 0.1 keep working for one release, and say where they went."""

from __future__ import annotations

import importlib
import sys

import pytest

import rpcx
from rpcx._util.moved import MOVED


def _forget(path: str) -> None:
    sys.modules.pop(path, None)
    parent, _, child = path.rpartition(".")
    if child in vars(sys.modules[parent]):
        delattr(sys.modules[parent], child)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_gives_the_module_at_its_new_one_with_a_warning(old: str) -> None:
    _forget(old)
    with pytest.warns(DeprecationWarning, match=rf"{old} moved to {MOVED[old]}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(MOVED[old])


def test_from_rpcx_import_an_old_name_works_and_the_warning_names_the_importing_file() -> None:
    _forget("rpcx.serialization")
    with pytest.warns(DeprecationWarning) as caught:
        from rpcx import serialization
    assert serialization.encode is importlib.import_module("rpcx._wire.codec").encode
    assert caught[0].filename == __file__


def test_every_new_path_exists_and_no_old_one_is_a_file() -> None:
    root = __import__("pathlib").Path(rpcx.__file__).parent
    for old, new in MOVED.items():
        assert importlib.util.find_spec(new) is not None, new
        assert not (root / f"{old.split('.', 1)[1]}.py").exists(), old


def test_a_path_that_never_existed_is_still_not_found() -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("rpcx.no_such_module")
