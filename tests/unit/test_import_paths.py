"""The import paths users had before the engine, the models and the LoRA helpers moved into packages
keep working for one release, and give the very objects of the new paths."""

from __future__ import annotations

import subprocess
import sys

import tierzero
import tierzero.engine.engine
import tierzero.models.builtin
import tierzero.pretrained.lora


def test_the_engine_keeps_its_old_import_path() -> None:
    from tierzero.engine import Engine

    assert Engine is tierzero.engine.engine.Engine is tierzero.Engine


def test_the_models_keep_their_old_import_path() -> None:
    from tierzero import models

    for name in models.__all__:
        assert getattr(models, name) is getattr(tierzero.models.builtin, name), name
    assert set(models.__all__) == set(tierzero.models.builtin.__all__)


def test_the_lora_helpers_keep_their_old_import_path() -> None:
    from tierzero import lora

    assert set(lora.__all__) <= set(tierzero.pretrained.lora.__all__)  # the names it had; new ones live only there
    for name in lora.__all__:
        assert getattr(lora, name) is getattr(tierzero.pretrained.lora, name), name


def test_the_command_runs_as_a_module() -> None:
    done = subprocess.run([sys.executable, "-m", "tierzero.cli", "--version"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"tierzero {tierzero.__version__}"
