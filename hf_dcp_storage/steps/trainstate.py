"""Training state without pickle: tensors for DCP, everything else as JSON, RNG states per rank.

``split`` turns a training-state mapping (``Stateful`` objects such as an optimizer wrapper, an
LR scheduler or a dataloader, and plain values) into flat ``tensors`` — saved with DCP, so they
reshard on load like the weights — and a JSON tree in which each tensor is a reference by key.
``join`` rebuilds the values from the tree and the loaded tensors. Values JSON cannot hold are
refused before anything is written, naming their key. Tuples, dicts with non-string keys,
non-finite floats and ``bytes`` survive the round trip through small tagged objects (``bytes``
as base64: a dataloader's ``state_dict`` is often a pickle it made itself, e.g. torchtitan's
``ParallelAwareDataloader``; it is stored and handed back as the same bytes, never unpickled here).
"""

from __future__ import annotations

import base64
import math
import random
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["capture_rng", "join", "restore_rng", "split"]

_TENSOR, _TUPLE, _ITEMS, _FLOAT, _BYTES = (
    "__tensor__",
    "__tuple__",
    "__items__",
    "__float__",
    "__bytes__",
)
_TAGS = {_TENSOR, _TUPLE, _ITEMS, _FLOAT, _BYTES}


def split(state: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(tensors by dotted key, JSON tree)`` of a training state's values (``state_dict()``
    already taken for ``Stateful`` ones).

    Raises:
        TypeError: a value JSON cannot hold, naming its dotted key and its type.
    """
    tensors: dict[str, torch.Tensor] = {}

    def encode(value: Any, key: str) -> Any:
        if isinstance(value, torch.Tensor):
            tensors[key] = value
            return {_TENSOR: key}
        if value is None or isinstance(value, (bool, str, int)):
            return value
        if isinstance(value, float):
            return value if math.isfinite(value) else {_FLOAT: repr(value)}
        if isinstance(value, (bytes, bytearray)):
            return {_BYTES: base64.b64encode(value).decode("ascii")}
        if isinstance(value, tuple):
            return {_TUPLE: [encode(v, f"{key}.{i}") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [encode(v, f"{key}.{i}") for i, v in enumerate(value)]
        if isinstance(value, Mapping):
            if all(isinstance(k, str) and k not in _TAGS for k in value):
                return {k: encode(v, f"{key}.{k}") for k, v in value.items()}
            if all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in value):
                return {_ITEMS: [[k, encode(v, f"{key}.{k}")] for k, v in value.items()]}
        raise TypeError(
            f"training state {key!r} is a {type(value).__name__}, which is saved neither as a "
            "tensor nor as JSON (None, bool, int, float, str, bytes, list, tuple, dict); convert "
            "it in state_dict() (e.g. to a list or a tensor)"
        )

    tree = {k: encode(v, k) for k, v in state.items()}
    return tensors, tree


def join(tree: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """The values ``split`` encoded, with each tensor reference replaced by ``tensors[key]``."""
    if isinstance(tree, list):
        return [join(v, tensors) for v in tree]
    if not isinstance(tree, dict):
        return tree
    if _TENSOR in tree:
        return tensors[tree[_TENSOR]]
    if _TUPLE in tree:
        return tuple(join(v, tensors) for v in tree[_TUPLE])
    if _ITEMS in tree:
        return {k: join(v, tensors) for k, v in tree[_ITEMS]}
    if _FLOAT in tree:
        return float(tree[_FLOAT])
    if _BYTES in tree:
        return base64.b64decode(tree[_BYTES])
    return {k: join(v, tensors) for k, v in tree.items()}


def capture_rng() -> dict[str, Any]:
    """This process's RNG states (Python, NumPy if installed, torch CPU, every CUDA device), as
    JSON."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "torch": _b64(torch.get_rng_state()),
    }
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        legacy = np.random.get_state(legacy=True)
        assert isinstance(legacy, tuple)  # the global generator is MT19937: a legacy tuple
        kind, keys, pos, has_gauss, cached = legacy
        state["numpy"] = [kind, keys.tolist(), pos, has_gauss, cached]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    """Set this process's RNG states from ``capture_rng`` output (parts it lacks stay as they
    are)."""
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "torch" in state:
        torch.set_rng_state(_unb64(state["torch"]))
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        states = [_unb64(s) for s in state["cuda"]]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)
