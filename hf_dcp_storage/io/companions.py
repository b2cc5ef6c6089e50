"""The files that make a checkpoint folder a complete Hugging Face model folder besides the
weights: ``config.json``, ``generation_config.json``, the tokenizer's files (``companions``).

``HFStorageWriter(companions=...)`` takes them as a folder (a local path or an fsspec URL: the
known names below that it holds are copied) or as a mapping ``file name -> content`` (bytes, text,
a dict written as JSON, or a local file's path). ``check_companions`` validates the names and
types where the writer is made (every rank, no I/O); ``read_companions`` reads the contents
(the coordinator, before anything of the save is written, so a missing file fails the save with
nothing written); the coordinator then puts them next to the weights before any rank writes,
so the index, written last, still publishes a complete folder, and a save finished later by
``hf-dcp consolidate`` has them already.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from ..format.index import INDEX_NAME, SHARD_NAME_RE, SINGLE_FILE_NAME
from . import fsio
from .files import CONFIG_NAME

__all__ = [
    "COMPANION_NAMES",
    "Companions",
    "check_companions",
    "read_companions",
    "with_quantization_config",
]

# What a folder source contributes: the files ``transformers``' ``from_pretrained`` reads for a
# model, its generation defaults, its tokenizer and its processor.
COMPANION_NAMES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
)

Content = bytes | bytearray | str | Mapping[str, Any] | os.PathLike[str]
Companions = str | os.PathLike[str] | Mapping[str, Content]

# The save's staging folder (``stores/base.STAGING_DIR``; ``io/`` sits below ``stores/``).
_STAGING = ".hf_dcp_staging"


def check_companions(companions: Companions | None) -> Companions | None:
    """``companions``, checked: ``None``, a folder (``str`` or path), or a mapping of plain file
    names (no folders, not the checkpoint's own weights, index or staging folder) to bytes, text,
    a dict (JSON) or a local file's path. No I/O.

    Raises:
        ValueError: naming the bad name or value, the rule and what to pass instead.
    """
    if companions is None or isinstance(companions, (str, os.PathLike)):
        return companions
    if not isinstance(companions, Mapping):
        raise ValueError(
            f"companions={type(companions).__name__}: pass a folder (path or URL) or a dict of "
            "file name -> bytes, text, dict (written as JSON) or local file path"
        )
    for name, content in companions.items():
        if (
            not isinstance(name, str)
            or not name
            or "/" in name
            or "\\" in name
            or name in (".", "..")
        ):
            raise ValueError(
                f"companions: {name!r} is not a plain file name; companion files sit next to the "
                "weights (e.g. 'config.json', 'tokenizer.json')"
            )
        if name in (INDEX_NAME, SINGLE_FILE_NAME) or SHARD_NAME_RE.match(name) or name == _STAGING:
            raise ValueError(
                f"companions: {name!r} is the checkpoint's own (its weights, index or staging "
                "folder); the save writes it, pass only the model's other files"
            )
        if not isinstance(content, (bytes, bytearray, str, Mapping, os.PathLike)):
            raise ValueError(
                f"companions[{name!r}] is a {type(content).__name__}; pass bytes, text, a dict "
                "(written as JSON) or a local file's path (pathlib.Path)"
            )
    return companions


def read_companions(
    companions: Companions | None,
    storage_options: Mapping[str, Any] | None = None,
    quantization: Mapping[str, Any] | None = None,
) -> dict[str, bytes]:
    """(coordinator) ``file name -> bytes`` of every companion file. A folder source is read with
    ``storage_options`` (the writer's; without them where its filesystem refuses them); a ``str``
    content is UTF-8 text, a dict is written as JSON (indented, as
    ``transformers`` writes its configs), a path is a local file read whole. ``quantization``:
    the ``quantization_config`` of weights the save quantizes, put into ``config.json``
    (``with_quantization_config``).

    Raises:
        FileNotFoundError: a companion file, or a folder holding none of ``COMPANION_NAMES``,
            naming what was looked for.
        ValueError: (with ``quantization``) see ``with_quantization_config``.
    """
    if companions is None:
        return {}
    check_companions(companions)
    if isinstance(companions, (str, os.PathLike)):
        found = _from_folder(os.fspath(companions), storage_options)
        return with_quantization_config(found, quantization)
    out: dict[str, bytes] = {}
    for name, content in companions.items():
        if isinstance(content, (bytes, bytearray)):
            out[name] = bytes(content)
        elif isinstance(content, str):
            out[name] = content.encode()
        elif isinstance(content, Mapping):
            out[name] = (json.dumps(content, indent=2, ensure_ascii=False) + "\n").encode()
        else:
            try:
                with open(content, "rb") as f:
                    out[name] = f.read()
            except FileNotFoundError:
                raise FileNotFoundError(
                    f"companions[{name!r}]: no file at {os.fspath(content)!r}"
                ) from None
    return with_quantization_config(out, quantization)


def _from_folder(folder: str, storage_options: Mapping[str, Any] | None) -> dict[str, bytes]:
    try:
        fs, root = fsio.resolve(folder, dict(storage_options or {}))
    except (ValueError, TypeError):  # options of another kind of store than the folder's
        fs, root = fsio.resolve(folder, None)
    try:
        present = set(fsio.list_names(fs, root))
    except FileNotFoundError:
        present = set()
    names = [n for n in COMPANION_NAMES if n in present]
    if not names:
        raise FileNotFoundError(
            f"companions={folder!r} holds none of the model files looked for "
            f"({', '.join(COMPANION_NAMES)}); pass the folder the model was saved to with "
            "save_pretrained, or a dict of the files"
        )
    return {n: fsio.read_all(fs, fsio.join(root, n)) for n in names}


def with_quantization_config(
    files: Mapping[str, bytes], quantization: Mapping[str, Any] | None
) -> dict[str, bytes]:
    """``files`` with ``quantization`` (the ``quantization_config`` of weights the save
    quantizes) in their ``config.json``, where they have one: the folder then says what its
    weights are to ``transformers``, vLLM and the readers.

    Raises:
        ValueError: the ``config.json`` is not a JSON object, or already names another
            ``quantization_config``.
    """
    out = dict(files)
    if quantization is None or CONFIG_NAME not in out:
        return out
    try:
        config = json.loads(out[CONFIG_NAME])
    except ValueError as exc:
        raise ValueError(f"companions['config.json'] is not JSON ({exc}); fix it") from None
    if not isinstance(config, dict):
        raise ValueError("companions['config.json'] is not a JSON object; fix it")
    found = config.get("quantization_config")
    if found is not None and found != dict(quantization):
        raise ValueError(
            f"companions['config.json'] has quantization_config {found!r}, but the save "
            f"quantizes as {dict(quantization)!r}: give the unquantized model's config.json (the "
            "save adds its own)"
        )
    config["quantization_config"] = dict(quantization)
    out[CONFIG_NAME] = (json.dumps(config, indent=2, ensure_ascii=False) + "\n").encode()
    return out
