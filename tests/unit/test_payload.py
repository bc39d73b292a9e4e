"""The function payload keeps where the user's code lives: a rank's traceback names the file."""

from __future__ import annotations

import importlib.util
import pickle
import sys
import traceback
from pathlib import Path

from spark_torch.driver.run.entrypoint import FunctionEntrypoint
from spark_torch.driver.run.payload import dump_function_payload


def _user_module(tmp_path: Path):
    source = tmp_path / "user_train.py"
    source.write_text("def train(x):\n    helper = lambda: 1 / x\n    return helper()\n")
    spec = importlib.util.spec_from_file_location("user_train", source)
    module = importlib.util.module_from_spec(spec)
    sys.modules["user_train"] = module
    spec.loader.exec_module(module)
    return module, source


def test_a_shipped_function_keeps_its_file_name_in_tracebacks(tmp_path: Path) -> None:
    module, source = _user_module(tmp_path)
    try:
        payload = dump_function_payload(FunctionEntrypoint(module.train, (0,)))
    finally:
        del sys.modules["user_train"]
    fn, args, kwargs = pickle.loads(payload)
    assert fn.__code__.co_filename == str(source)
    try:
        fn(*args, **kwargs)
    except ZeroDivisionError:
        text = traceback.format_exc()
    # both the function and the lambda inside it point at the user's file, not <dynamic-code>
    assert text.count(f'File "{source}"') == 2, text
    assert "<dynamic-code>" not in text
