"""Which tensors of an HF checkpoint are quantized, and how they dequantize: the pairing of each
quantized weight with its scales, checked before a load reads any weight.

* **FP8 block-wise** (DeepSeek-V3/R1): ``X.weight`` of a float8 dtype, 2-D, with
  ``X.weight_scale_inv`` of ``[ceil(rows / br), ceil(cols / bc)]`` (``br x bc``: the config's
  ``quantization_config.weight_block_size``, 128 x 128 where it names none).
* **MXFP4** (gpt-oss): ``X_blocks`` ``[..., G, B]`` uint8 with ``X_scales`` ``[..., G]`` uint8;
  the weight dequantizes to ``[..., G * 2 * B]`` and keeps its stored name, as PyTorch's
  ``QuantizedHuggingFaceStorageReader`` presents it.

Anything else quantized-looking (a float8 tensor with no block scales, ``_blocks`` with no
``_scales``, a scale whose shape does not fit its weight, a ``quant_method`` other than these two)
is refused naming the tensor. Pure: names, dtypes and shapes in, a plan out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

__all__ = [
    "DEFAULT_BLOCK",
    "Quantized",
    "block_size_of",
    "quantized_tensors",
]

DEFAULT_BLOCK = (128, 128)
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_KNOWN_METHODS = ("fp8", "mxfp4")
_FIX = "load with dequantize=None to read the stored tensors as they are"


@dataclass(frozen=True)
class Quantized:
    """How one stored tensor dequantizes: its ``kind``, the key of its scales, the block
    (FP8: rows x columns a scale covers; MXFP4: ``(1, 2 * B)`` values a group) and the
    ``shape`` it has once dequantized."""

    kind: Literal["fp8_block", "mxfp4"]
    scale_key: str
    block: tuple[int, int]
    shape: tuple[int, ...]


def block_size_of(
    config: Mapping[str, Any] | None, given: int | Sequence[int] | None
) -> tuple[int, int]:
    """The FP8 block, ``rows x columns``: ``given`` (the reader's option), else the config's
    ``quantization_config.weight_block_size``, else 128 x 128.

    Raises:
        ValueError: the config names a method other than FP8 or MXFP4, a block that is not two
            positive ints, or one other than ``given``.
    """
    quant = (config or {}).get("quantization_config") or {}
    method = quant.get("quant_method")
    if method is not None and method not in _KNOWN_METHODS:
        raise ValueError(
            f"config.json: quantization_config.quant_method is {method!r}; the reader dequantizes "
            f"{' and '.join(_KNOWN_METHODS)} only: {_FIX}"
        )
    from_config = quant.get("weight_block_size")
    block = _block(from_config, "config.json: quantization_config.weight_block_size")
    if given is not None:
        wanted = _block(given, "block_size")
        assert wanted is not None
        if block is not None and block != wanted:
            raise ValueError(
                f"block_size={given!r} but config.json's quantization_config.weight_block_size is "
                f"{from_config!r}; give the config's (or leave block_size out)"
            )
        return wanted
    return block or DEFAULT_BLOCK


def _block(value: Any, what: str) -> tuple[int, int] | None:
    if value is None:
        return None
    pair = [value, value] if isinstance(value, int) else value
    if (
        not isinstance(pair, (list, tuple))
        or len(pair) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in pair)
    ):
        raise ValueError(f"{what} is {value!r}; it must be a positive int or two of them")
    return int(pair[0]), int(pair[1])


def quantized_tensors(
    tensors: Mapping[str, tuple[torch.dtype, Sequence[int]]], block: tuple[int, int]
) -> dict[str, Quantized]:
    """``{weight key: Quantized}`` for every quantized weight of a checkpoint whose tensors are
    ``{key: (dtype, shape)}``; scales stay ordinary tensors (they load as stored).

    Raises:
        ValueError: a quantized tensor that cannot be dequantized, naming it, the rule and the
            fix (before anything is read).
    """
    found: dict[str, Quantized] = {}
    for key, (dtype, shape) in tensors.items():
        if dtype in _FP8:
            found[key] = _fp8(key, shape, tensors, block)
        elif key.endswith("_blocks") and dtype == torch.uint8:
            found[key] = _mxfp4(key, shape, tensors)
        elif key.endswith(".weight_scale_inv") and key[: -len("_scale_inv")] not in tensors:
            raise ValueError(
                f"tensor {key!r}: block scales with no {key[: -len('_scale_inv')]!r} in the "
                f"checkpoint; the checkpoint is incomplete: {_FIX}"
            )
    return found


def _fp8(
    key: str,
    shape: Sequence[int],
    tensors: Mapping[str, tuple[torch.dtype, Sequence[int]]],
    block: tuple[int, int],
) -> Quantized:
    scale_key = key + "_scale_inv"
    dtype = tensors[key][0]
    if scale_key not in tensors:
        raise ValueError(
            f"tensor {key!r} is {dtype} with no {scale_key!r}: only block-wise FP8 (a "
            "weight_scale_inv beside each weight) and MXFP4 (_blocks with _scales) dequantize; "
            f"{_FIX}"
        )
    scale_dtype, scale_shape = tensors[scale_key]
    want = [math.ceil(n / b) for n, b in zip(shape, block, strict=False)]
    if len(shape) != 2 or scale_dtype not in _SCALE_DTYPES or list(scale_shape) != want:
        raise ValueError(
            f"tensor {key!r} {list(shape)} has scales {scale_key!r} {list(scale_shape)} of "
            f"{scale_dtype}; block-wise FP8 needs a 2-D weight and floating scales of "
            f"[ceil(rows / {block[0]}), ceil(cols / {block[1]})] = {want}: check "
            f"quantization_config.weight_block_size (or block_size), or {_FIX}"
        )
    return Quantized("fp8_block", scale_key, block, tuple(shape))


def _mxfp4(
    key: str, shape: Sequence[int], tensors: Mapping[str, tuple[torch.dtype, Sequence[int]]]
) -> Quantized:
    scale_key = key[: -len("_blocks")] + "_scales"
    if scale_key not in tensors:
        raise ValueError(
            f"tensor {key!r} is MXFP4 blocks (uint8) with no {scale_key!r} in the checkpoint; "
            f"the checkpoint is incomplete: {_FIX}"
        )
    scale_dtype, scale_shape = tensors[scale_key]
    if len(shape) < 2 or scale_dtype != torch.uint8 or list(scale_shape) != list(shape[:-1]):
        raise ValueError(
            f"tensor {key!r} {list(shape)} has scales {scale_key!r} {list(scale_shape)} of "
            f"{scale_dtype}; MXFP4 needs uint8 scales of the blocks' shape less its last "
            f"dimension ({list(shape[:-1])}): {_FIX}"
        )
    *prefix, groups, width = shape
    return Quantized("mxfp4", scale_key, (1, 2 * width), (*prefix, groups * 2 * width))
