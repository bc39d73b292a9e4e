"""A function's arguments are bound to its signature on the driver, before anything starts."""

from __future__ import annotations

import functools
from typing import Any

import pytest

from spark_torch import ArgumentError
from spark_torch.driver.run.entrypoint import check_arguments, make_entrypoint


def train(lr: float, epochs: int = 3, *, batch_size: int = 32) -> None:
    del lr, epochs, batch_size


def test_a_misspelt_keyword_names_the_closest_parameter() -> None:
    with pytest.raises(ArgumentError) as info:
        check_arguments(train, (0.1,), {"epoch": 3})
    message = str(info.value)
    assert "unexpected keyword argument 'epoch' (did you mean 'epochs'?)" in message
    assert "train(lr, epochs=3, *, batch_size=32)" in message
    assert "its parameters are lr, epochs, batch_size (no rank was started)" in message
    assert isinstance(info.value, TypeError)  # what Python raises for the same call


@pytest.mark.parametrize(
    ("args", "kwargs", "reason"),
    [
        ((), {}, "missing a required argument: 'lr'"),
        ((1, 2, 3), {}, "too many positional arguments"),
        ((0.1,), {"lr": 0.2}, "multiple values for argument 'lr'"),
        ((0.1,), {"zzz": 1}, "got an unexpected keyword argument 'zzz'"),
    ],
)
def test_every_mismatch_python_would_raise(args: tuple[Any, ...], kwargs: dict[str, Any], reason: str) -> None:
    with pytest.raises(ArgumentError, match=reason):
        make_entrypoint(train, args, kwargs)


def test_calls_that_fit_pass() -> None:
    check_arguments(train, (0.1,), {"epochs": 1, "batch_size": 8})
    check_arguments(functools.partial(train, 0.1), (), {"epochs": 2})
    check_arguments(lambda *a, **k: None, (1, 2), {"anything": 3})
    check_arguments(len, ([],), {})  # a builtin: checked where it has a signature


def test_a_callable_without_a_signature_is_not_checked() -> None:
    check_arguments(print.__call__, (1, 2), {"sep": ","})  # no inspectable signature: the rank decides
