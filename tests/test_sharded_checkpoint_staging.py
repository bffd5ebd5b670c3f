"""The asynchronous sharded save's staging (``save_sharded(asynchronous=True)``) in one process, against torch
2.11's stager as well as the installed one. On an H100 (torch 2.11) the save failed at its first checkpoint: it staged
the model's part and then the optimizer's with one ``DefaultStager``, and torch 2.11's stager empties its table of
copiers after each stage (``KeyError: <class 'type'>`` at the second). torch 2.13, which these tests run on, keeps
the table, so the test also runs the save against a stager that behaves as 2.11's does."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import staging

from trlx_scale.reliability.sharded_checkpoint import MODEL_DIR, OPTIMIZER_DIR, save_sharded


class _StagerThatEmptiesItsTableAfterEachStage(staging.DefaultStager):
    """torch 2.11's ``DefaultStager``: after every stage its ``StateDictStager`` is closed, which clears its copiers."""

    def stage(self, state_dict, **kwargs):
        staged = super().stage(state_dict, **kwargs)
        self._state_dict_stager.close()
        return staged


def _trained_model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    return model, optimizer


@pytest.mark.parametrize("stager", ["installed", "torch_2_11"])
def test_an_asynchronous_save_stages_model_and_optimizer_and_writes_both(tmp_path, monkeypatch, stager):
    if stager == "torch_2_11":
        # Test-only: the save builds its stager from torch's module, so the emulation is swapped in there.
        monkeypatch.setattr(staging, "DefaultStager", _StagerThatEmptiesItsTableAfterEachStage)
    model, optimizer = _trained_model_and_optimizer()
    expected = {name: value.detach().clone() for name, value in model.state_dict().items()}
    pending = save_sharded(model, optimizer, str(tmp_path), asynchronous=True)
    with torch.no_grad():  # training goes on while the files are written: the staged copy is what lands
        for parameter in model.parameters():
            parameter.add_(1.0)
    pending.wait()
    assert pending.done()
    restored = {"model": {name: torch.zeros_like(value) for name, value in expected.items()}}
    dcp.load(restored, storage_reader=dcp.FileSystemReader(os.path.join(tmp_path, MODEL_DIR)))
    for name, value in expected.items():
        torch.testing.assert_close(restored["model"][name], value, rtol=0, atol=0)
    assert os.path.isfile(os.path.join(tmp_path, OPTIMIZER_DIR, ".metadata"))
