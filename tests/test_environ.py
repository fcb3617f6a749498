"""rpcx._util.environ: a variable set for a block, then put back as it was."""

from __future__ import annotations

import os

import pytest

from rpcx._util.environ import environment_variable

NAME = "RPCX_TEST_ENVIRON_VARIABLE"


def test_an_unset_variable_is_unset_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(NAME, raising=False)
    with environment_variable(NAME, "inside"):
        assert os.environ[NAME] == "inside"
    assert NAME not in os.environ


def test_a_set_variable_gets_its_value_back_even_after_an_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NAME, "before")
    with pytest.raises(RuntimeError), environment_variable(NAME, "inside"):
        assert os.environ[NAME] == "inside"
        raise RuntimeError("the block failed")
    assert os.environ[NAME] == "before"


def test_none_leaves_the_variable_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NAME, "mine")
    with environment_variable(NAME, None):
        assert os.environ[NAME] == "mine"
        os.environ[NAME] = "changed in the block"
    assert os.environ[NAME] == "changed in the block"  # not restored: it was never set here
