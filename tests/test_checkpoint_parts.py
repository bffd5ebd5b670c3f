"""The registry of named checkpoint state (reliability/checkpoint_parts.py): every part saved and loaded, in the order
the components registered them, each name once."""

from __future__ import annotations

import pytest

from trlx_scale.reliability.checkpoint_parts import CheckpointParts


class _Recorder:
    def __init__(self, name: str, log: list[str]):
        self.name, self.log = name, log

    def save(self, checkpoint_dir: str) -> None:
        self.log.append(f"save {self.name} {checkpoint_dir}")

    def load(self, checkpoint_dir: str) -> None:
        self.log.append(f"load {self.name} {checkpoint_dir}")


def test_parts_are_saved_and_loaded_in_registration_order():
    log: list[str] = []
    parts = CheckpointParts()
    for name in ("policy_version", "rollout_buffer", "critic"):
        parts.register(name, _Recorder(name, log))
    parts.save("ckpt")
    parts.load("ckpt")
    assert parts.names() == ["policy_version", "rollout_buffer", "critic"]
    assert log == [
        "save policy_version ckpt", "save rollout_buffer ckpt", "save critic ckpt",
        "load policy_version ckpt", "load rollout_buffer ckpt", "load critic ckpt",
    ]  # fmt: skip


def test_a_name_is_registered_once_and_a_part_saves_and_loads():
    parts = CheckpointParts()
    parts.register("policy_version", _Recorder("a", []))
    with pytest.raises(ValueError, match="'policy_version' is registered already"):
        parts.register("policy_version", _Recorder("b", []))
    with pytest.raises(TypeError, match="needs save\\(checkpoint_dir\\) and load\\(checkpoint_dir\\)"):
        parts.register("half", object())
