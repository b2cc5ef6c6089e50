"""``verify_checkpoint``'s check of a folder's ``config.json`` against its weights.

The model that the config describes is built by ``transformers`` on the meta device (no memory,
nothing downloaded) and its state dict's names and shapes compared with the tensors the files
hold: a tensor the model needs that no file holds (``from_pretrained`` would initialise it at
random), a tensor of another shape (``from_pretrained`` refuses it), and a tensor the model has
no place for (dropped on load, so most likely a key-mapping mistake) are each a problem. A key
the model ties to another one (``lm_head.weight`` to the embedding) may be missing when the
other is there, as ``save_pretrained`` writes it. With a ``quantization_config``, a weight's
scales (FP8's ``weight_scale_inv``) and MXFP4's ``_blocks`` and ``_scales`` count as parts of the
model's tensor. Where ``transformers`` is not installed, or does not know the config's model, the
check is skipped with a note.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import torch

from ..io.files import CONFIG_NAME

__all__ = ["CONFIG_NAME", "config_problems"]

# Problems listed per kind before the rest are counted: a wrong config gives one per tensor.
_SHOWN = 8
_SAY = {
    "missing": "needed by the model {cfg} describes ({shape}), held by no file: from_pretrained "
    "would initialise it at random",
    "shape": "{held} in the files, {shape} in the model {cfg} describes: from_pretrained "
    "refuses it",
    "extra": "in the files, but the model {cfg} describes has no such tensor: dropped on load "
    "(a key-mapping mistake?)",
}


def config_problems(
    config: bytes, shapes: Mapping[str, tuple[int, ...]]
) -> tuple[list[tuple[str | None, str]], str | None]:
    """``([(key or None, message)], note or None)``: what in ``shapes`` (tensor name -> shape,
    every file's) disagrees with the model ``config`` (``config.json``'s bytes) describes, or
    why that was not checked."""
    try:
        fields = json.loads(config)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return [(None, f"{CONFIG_NAME}: not valid JSON ({exc})")], None
    if not isinstance(fields, dict):
        return [(None, f"{CONFIG_NAME}: a JSON {type(fields).__name__}, not an object")], None
    expected, tied = _model_shapes(fields)
    if isinstance(expected, str):
        return [], f"{CONFIG_NAME} not checked against the weights: {expected}"
    out: list[tuple[str | None, str]] = []
    # A quantized folder (quantization_config) holds each quantized weight's scales beside it
    # (FP8: ``X.weight_scale_inv``), or the weight as ``X_blocks`` and ``X_scales`` (MXFP4).
    parts = {
        k: base
        for k in shapes
        if isinstance(fields.get("quantization_config"), dict)
        and (base := _quantized_of(k)) is not None
        and base in expected
    }
    as_parts = set(parts.values()) - set(shapes)
    missing = [
        k
        for k in expected
        if k not in shapes and k not in as_parts and not any(t in shapes for t in tied.get(k, ()))
    ]
    extra = [k for k in shapes if k not in expected and k not in parts]
    wrong = [k for k in expected if k in shapes and tuple(shapes[k]) != expected[k]]
    for kind, keys in (("missing", missing), ("shape", wrong), ("extra", extra)):
        say = _SAY[kind]
        for k in keys[:_SHOWN]:
            held = list(shapes[k]) if k in shapes else None
            shape = list(expected[k]) if k in expected else None
            message = say.format(cfg=CONFIG_NAME, shape=shape, held=held)
            out.append((k, f"{k}: {message}"))
        if len(keys) > _SHOWN:
            out.append((None, f"{CONFIG_NAME}: {len(keys) - _SHOWN} more tensors ({kind})"))
    return out, None


def _quantized_of(key: str) -> str | None:
    """The model tensor a quantized folder's ``key`` is part of: ``X.weight`` for FP8's
    ``X.weight_scale_inv``, ``X`` for MXFP4's ``X_blocks`` and ``X_scales``; else ``None``."""
    for suffix in ("_scale_inv", "_blocks", "_scales"):
        if key.endswith(suffix):
            return key[: -len(suffix)]
    return None


def _model_shapes(
    fields: dict[str, object],
) -> tuple[dict[str, tuple[int, ...]] | str, dict[str, tuple[str, ...]]]:
    """``(name -> shape of the described model's state dict, name -> the names tied to it)``, or
    ``(why not, {})``."""
    try:
        import transformers
    except ImportError:
        return "transformers is not installed", {}
    model_type = fields.get("model_type")
    architectures = fields.get("architectures") or []
    name = architectures[0] if isinstance(architectures, list) and architectures else None
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    try:
        config = transformers.AutoConfig.for_model(
            str(model_type), **{k: v for k, v in fields.items() if k != "model_type"}
        )
        with torch.device("meta"):
            # The config's architecture, else (a config made in code) its causal LM.
            model = (
                cls(config)
                if cls is not None
                else transformers.AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
            )
    except Exception as exc:  # noqa: BLE001 - any failure to build the model only skips the check
        return (
            f"transformers {transformers.__version__} could not build the model of "
            f"model_type={model_type!r}, architectures={architectures!r} "
            f"({type(exc).__name__}: {exc})"
        ), {}
    state = model.state_dict(keep_vars=True)
    by_tensor: dict[int, list[str]] = {}
    for k, v in state.items():
        by_tensor.setdefault(id(v), []).append(k)
    tied = {k: tuple(n for n in names if n != k) for names in by_tensor.values() for k in names}
    return {k: tuple(v.shape) for k, v in state.items()}, tied
