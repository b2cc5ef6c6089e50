"""Fuzzing: property tests of every parser of untrusted bytes, and a mutation test of whole
checkpoints.

Each input is either accepted, and then what comes out is consistent (a header that tiles, an
index whose file names stay inside the folder, a load that equals what was saved), or refused
with the library's own error type and a message that names the file or key; never another
exception type, never a hang, never a read outside the checkpoint folder, never a write.

Hypothesis runs derandomized and without an example database, so every run (CI included) tries
the same inputs. Every test adds what it tried to ``TALLY``; ``pytest -s tests/test_fuzz.py``
prints the table of bad inputs tried and how each was handled.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import posixpath
import re
import shutil
import struct
import sys
import threading
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.api import CheckpointException

import hf_dcp_storage
from hf_dcp_storage import HFStorageReader, HFStorageWriter
from hf_dcp_storage.format.header import (
    MAX_HEADER_BYTES,
    NAME_TO_DTYPE,
    HeaderError,
    TensorEntry,
    decode_header,
    encode_header,
)
from hf_dcp_storage.format.index import checksum_table, parse_index, recorded_headers
from hf_dcp_storage.io.files import HEADER_PROBE, read_header
from hf_dcp_storage.steps.retention import RetentionPolicy, parse_step, step_name, to_remove
from hf_dcp_storage.tools.keymap import KeyMapping, KeyMappingError, Renaming, load_key_mapping

INDEX = "model.safetensors.index.json"
SHARD_1 = "model-00001-of-00002.safetensors"
SHARD_2 = "model-00002-of-00002.safetensors"

# Derandomized (the same examples for the same code, every run) and no example database (no
# failure of an earlier run replayed), so CI is reproducible; no deadline: a loaded 2-core CI box
# is slow.
FUZZ = settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
FEW = settings(FUZZ, max_examples=100)

# Error types a caller may catch. Their subclasses that mean "a parser fell over" are not.
ALLOWED = (ValueError, OSError, RuntimeError)
FORBIDDEN = (UnicodeError, RecursionError, NotImplementedError)


# -- counting ---------------------------------------------------------------------------------

TALLY: dict[str, Counter[str]] = defaultdict(Counter)


def _count(category: str, outcome: str) -> None:
    """One input of ``category`` tried, with its outcome: accepted (valid, or loaded exactly) or
    refused."""
    TALLY[category]["tried"] += 1
    TALLY[category][outcome] += 1


@pytest.fixture(scope="module", autouse=True)
def _report_tally() -> Iterator[None]:
    """After the module, print the table (seen with ``pytest -s``)."""
    yield
    print(
        "\n| category | inputs tried | accepted (valid / loaded exactly) | refused with a message |"
    )
    print("|---|---|---|---|")
    for category, c in sorted(TALLY.items()):
        print(f"| {category} | {c['tried']} | {c['accepted']} | {c['refused']} |")
    total = sum((c for c in TALLY.values()), Counter())
    print(f"| **total** | {total['tried']} | {total['accepted']} | {total['refused']} |")


def _refused(
    exc: BaseException, expected: type[BaseException] | tuple[type[BaseException], ...]
) -> None:
    """``exc`` is the library's own kind of refusal, with a message."""
    assert isinstance(exc, expected) and not isinstance(exc, FORBIDDEN), (
        f"{type(exc).__name__}: {exc}"
    )
    assert str(exc).strip(), f"{type(exc).__name__} without a message"


# A hang's bound, not a speed target: exponential matching or a stuck load takes hours, so a
# bound this far above the seconds these take holds on a loaded machine and still catches them.
HANG_S = 120.0


def _within(seconds: float, fn: Callable[[], Any]) -> Any:
    """``fn()``, failing the test if it runs longer than ``seconds`` (a hang, or exponential time).

    Runs in a daemon thread, so a hang fails this test instead of the whole session.
    """
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - CheckpointException is a BaseException
            result["error"] = exc

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"still running after {seconds} s: a hang"
    if "error" in result:
        raise result["error"]
    return result.get("value")


# -- strategies ---------------------------------------------------------------------------------

# JSON-ish values: every JSON type, NaN and infinities (Python's json reads them), huge ints.
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
DTYPES = st.sampled_from(sorted(NAME_TO_DTYPE))
SHAPES = st.lists(st.integers(0, 5), max_size=3)


@st.composite
def valid_headers(draw: st.DrawFn) -> tuple[list[TensorEntry], dict[str, str]]:
    """Entries tiling their data contiguously, with any names (incl. non-ASCII) and metadata."""
    names = draw(
        st.lists(
            st.text(min_size=1, max_size=10).filter(lambda n: n != "__metadata__"),
            unique=True,
            max_size=6,
        )
    )
    entries, pos = [], 0
    for name in names:
        dtype = NAME_TO_DTYPE[draw(DTYPES)]
        shape = tuple(draw(SHAPES))
        n = math.prod(shape) * dtype.itemsize
        entries.append(TensorEntry(name, dtype, shape, pos, pos + n))
        pos += n
    return entries, draw(st.dictionaries(st.text(max_size=6), st.text(max_size=6), max_size=3))


def _prefixed(body: bytes) -> bytes:
    return struct.pack("<Q", len(body)) + body


def _consistent(entries: list[TensorEntry], data_start: int, file_size: int | None) -> None:
    """What an accepted header promises: entries that tile ``[0, end)`` and agree with their
    shapes."""
    pos = 0
    for e in entries:
        assert e.begin == pos and e.end - e.begin == math.prod(e.shape) * e.dtype.itemsize, e
        pos = e.end
    if file_size is not None:
        assert data_start + pos <= file_size


# -- 1. headers ---------------------------------------------------------------------------------


@FUZZ
@given(valid_headers())
def test_valid_headers_round_trip(header: tuple[list[TensorEntry], dict[str, str]]) -> None:
    entries, metadata = header
    try:
        raw = encode_header(entries, metadata)
    except ValueError as exc:  # a lone surrogate in a name: no UTF-8 form
        _refused(exc, ValueError)
        assert re.search(r"holds a lone UTF-16 surrogate", str(exc))
        _count("header: valid headers, encoded", "refused")
        return
    size = len(raw) + (entries[-1].end if entries else 0)
    decoded, meta, data_start = decode_header(raw, file_size=size)
    assert data_start == len(raw) and data_start % 8 == 0
    assert decoded == sorted(entries, key=lambda e: (e.begin, e.end)) and meta == metadata
    _count("header: valid headers, encoded", "accepted")


def _decode_or_refuse(raw: bytes, file_size: int | None, category: str) -> None:
    try:
        entries, _, data_start = decode_header(raw, file_size=file_size, where="f.safetensors")
    except BaseException as exc:  # noqa: BLE001 - every outcome is classified, CheckpointException included
        _refused(exc, HeaderError)
        assert str(exc).startswith("f.safetensors: "), exc
        _count(category, "refused")
        return
    _consistent(entries, data_start, file_size)
    _count(category, "accepted")


@FUZZ
@given(st.binary(max_size=64), st.none() | st.integers(0, 2**64))
def test_arbitrary_bytes_decode_or_raise_header_error(raw: bytes, file_size: int | None) -> None:
    _decode_or_refuse(raw, file_size, "header: arbitrary bytes")


@FUZZ
@given(JSON, st.none() | st.integers(0, 4096))
def test_arbitrary_json_headers_decode_or_raise_header_error(
    value: Any, file_size: int | None
) -> None:
    _decode_or_refuse(_prefixed(json.dumps(value).encode()), file_size, "header: arbitrary JSON")


@st.composite
def mutated_headers(draw: st.DrawFn) -> tuple[bytes, int]:
    """A valid header (+ its data size), then byte flips, insertions, deletions or a new length."""
    entries, metadata = draw(valid_headers().filter(_encodable))
    raw = bytearray(encode_header(entries, metadata))
    size = len(raw) + (entries[-1].end if entries else 0)
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(raw) - 1))
        kind = draw(st.sampled_from(["flip", "set", "insert", "delete", "length"]))
        if kind == "flip":
            raw[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "set":
            raw[at] = draw(st.sampled_from(b'{}[]",:0123456789 -.eEnN\x00\xff'))
        elif kind == "insert":
            raw[at:at] = draw(st.binary(min_size=1, max_size=4))
        elif kind == "delete":
            del raw[at]
        else:
            raw[:8] = struct.pack(
                "<Q",
                draw(
                    st.sampled_from([0, 1, 7, 2**32, 2**63, 2**64 - 1, MAX_HEADER_BYTES + 1])
                    | st.integers(0, len(raw))
                ),
            )
    return bytes(raw), draw(st.sampled_from([size, size - 1, size + 8]) | st.integers(0, size + 8))


def _has_utf8(text: str) -> bool:
    """No lone surrogate: ``text`` has a UTF-8 form."""
    return not any(0xD800 <= ord(c) <= 0xDFFF for c in text)


def _encodable(header: tuple[list[TensorEntry], dict[str, str]]) -> bool:
    entries, metadata = header
    return all(map(_has_utf8, [*(e.name for e in entries), *metadata, *metadata.values()]))


@FUZZ
@given(mutated_headers())
def test_mutated_headers_decode_consistently_or_raise_header_error(case: tuple[bytes, int]) -> None:
    raw, size = case
    _decode_or_refuse(raw, size, "header: mutated valid headers")


@pytest.mark.parametrize("n", [MAX_HEADER_BYTES + 1, 2**32, 2**63, 2**64 - 1])
def test_a_huge_header_length_is_refused_before_anything_more_is_read(n: int) -> None:
    reads: list[tuple[int, int]] = []

    def read_range(path: str, start: int, end: int) -> bytes:
        reads.append((start, end))
        return (struct.pack("<Q", n) + b"{}" + b" " * 100)[start:end]

    with pytest.raises(
        HeaderError, match=rf"header length {n} exceeds the {MAX_HEADER_BYTES}-byte cap"
    ):
        read_header(None, "/ck", "f.safetensors", read_range, size=10**15, where="f.safetensors")  # type: ignore[arg-type]
    assert reads == [(0, HEADER_PROBE)]
    _count("header: huge length field", "refused")


# -- 2. the index json --------------------------------------------------------------------------

# File names a hostile or broken index could give, each tried in whole-checkpoint loads too.
TRAVERSALS = [
    "../outside.safetensors", "a/../../outside.safetensors", "./../outside.safetensors",
    "..//outside.safetensors", "sub/../../outside.safetensors", "..", ".", "", "/etc/passwd",
    "//etc/passwd", "..\\outside.safetensors", "sub\\..\\..\\outside.safetensors",
    "C:\\outside.safetensors", "s3://other/x.safetensors", "file:///etc/passwd",
    "memory://x.safetensors", "x\x00.safetensors", "x\n.safetensors", "\ud800.safetensors",
    "./model-00001-of-00002.safetensors", "sub/./x.safetensors", "x.safetensors/",
    "sub//x.safetensors",
]  # fmt: skip
NAME_PIECES = [
    "..",
    ".",
    "/",
    "\\",
    ":",
    "a",
    "sub",
    "x.safetensors",
    "~",
    "%2e",
    "\x00",
    " ",
    "model-00001-of-00002.safetensors",
]
FILE_NAMES = (
    st.sampled_from(TRAVERSALS)
    | st.lists(st.sampled_from(NAME_PIECES), max_size=5).map("".join)
    | st.text(max_size=12)
)


def _must_refuse(file: str) -> bool:
    """An independent oracle: names a loader could follow out of the folder, or that no file has."""
    joined = posixpath.normpath(posixpath.join("/r/ck", file))
    return (
        not joined.startswith("/r/ck/")
        or file.startswith("/")
        or "\\" in file
        or "://" in file
        or "\x00" in file
        or not _has_utf8(file)
    )


def _must_accept(file: str) -> bool:
    """Plain names (segments of letters, digits, ``._-``) that stay inside the folder."""
    parts = file.split("/")
    return all(re.fullmatch(r"[A-Za-z0-9_.\-]+", p) and p not in (".", "..") for p in parts)


def _parse_or_refuse(raw: bytes, category: str) -> Any:
    """``parse_index(raw)``, checked: accepted means a clean index; refused, a ValueError naming
    it."""
    try:
        index = parse_index(raw, "ck/" + INDEX)
    except BaseException as exc:  # noqa: BLE001 - every outcome is classified, CheckpointException included
        _refused(exc, ValueError)
        assert str(exc).startswith(f"ck/{INDEX}: "), exc
        _count(category, "refused")
        return None
    for key, file in index.weight_map.items():
        assert isinstance(key, str) and isinstance(file, str) and not _must_refuse(file), file
    assert index.checksums is None or all(0 <= v < 2**32 for v in index.checksums.values())
    _count(category, "accepted")
    return index


@FUZZ
@given(JSON)
def test_any_json_value_is_a_clean_index_or_refused(value: Any) -> None:
    _parse_or_refuse(json.dumps(value).encode(), "index: arbitrary JSON")


@FUZZ
@given(st.binary(max_size=40))
def test_any_bytes_are_a_clean_index_or_refused(raw: bytes) -> None:
    _parse_or_refuse(raw, "index: arbitrary bytes")


WEIGHT_MAPS = st.dictionaries(st.text(max_size=6), FILE_NAMES | JSON, max_size=4) | JSON
METADATA = (
    st.fixed_dictionaries(
        {},
        optional={
            "total_size": JSON | st.sampled_from([float("nan"), float("inf"), -1, 10**30, "257"]),
            "checksum_algorithm": st.sampled_from(["crc32", "md5", "CRC32"]) | JSON,
            "checksums": st.dictionaries(
                st.text(max_size=4),
                st.text("0123456789abcdefABCDEFxX+-_ g\u0661", max_size=9) | JSON,
                max_size=3,
            )
            | JSON,
            "headers": JSON,
        },
    )
    | JSON
)


@FUZZ
@given(WEIGHT_MAPS, METADATA, st.dictionaries(st.text(max_size=5), JSON, max_size=2))
def test_type_confused_indexes_are_clean_or_refused(
    weight_map: Any, metadata: Any, extra: dict[str, Any]
) -> None:
    index = {**extra, "weight_map": weight_map, "metadata": metadata}
    _parse_or_refuse(json.dumps(index).encode(), "index: type confusion")


@FUZZ
@given(FILE_NAMES)
def test_file_names_outside_the_folder_are_refused_and_plain_ones_accepted(file: str) -> None:
    raw = json.dumps({"weight_map": {"w": file}}).encode()
    index = _parse_or_refuse(raw, "index: file names (traversal)")
    if _must_refuse(file):
        assert index is None, f"{file!r} accepted"
    if _must_accept(file):
        assert index is not None and index.weight_map == {"w": file}, f"{file!r} refused"
    if index is None:
        with pytest.raises(ValueError) as info:
            parse_index(raw, INDEX)
        assert repr(file) in str(info.value) or "not valid JSON" in str(info.value)


@FUZZ
@given(st.text("0123456789abcdefABCDEFxX+-_ g\u0661\u0662", max_size=10) | JSON)
def test_checksums_are_exactly_eight_ascii_hex_digits(value: Any) -> None:
    checksums, malformed = checksum_table(
        {"checksum_algorithm": "crc32", "checksums": {"w": value}}, INDEX
    )
    valid = isinstance(value, str) and re.fullmatch(r"[0-9a-fA-F]{8}", value, re.ASCII) is not None
    assert checksums == ({"w": int(value, 16)} if valid else {}) and malformed == (
        {} if valid else {"w": value}
    )
    _count("index: checksum values", "accepted" if valid else "refused")


@FEW
@given(
    st.dictionaries(
        st.text(max_size=4),
        st.sampled_from(["a.safetensors", "b.safetensors"]),
        min_size=1,
        max_size=5,
    ),
    st.data(),
)
def test_a_name_given_twice_in_the_index_is_refused(
    weight_map: dict[str, str], data: st.DataObject
) -> None:
    twice = data.draw(st.sampled_from(sorted(weight_map)))
    pairs = [
        *weight_map.items(),
        (twice, data.draw(st.sampled_from(["a.safetensors", "b.safetensors"]))),
    ]
    body = ",".join(f"{json.dumps(k)}:{json.dumps(v)}" for k, v in pairs)
    with pytest.raises(ValueError, match=rf"names {re.escape(repr(twice))} twice in one object"):
        parse_index(('{"weight_map":{' + body + "}}").encode(), INDEX)
    _count("index: duplicate keys", "refused")


@FEW
@given(JSON | st.dictionaries(st.sampled_from([SHARD_1, "x"]), JSON, max_size=2))
def test_recorded_header_tables_are_decoded_or_refused(table: Any) -> None:
    try:
        out = recorded_headers({"headers": table}, [SHARD_1], INDEX)
    except BaseException as exc:  # noqa: BLE001 - every outcome is classified, CheckpointException included
        _refused(exc, ValueError)
        assert str(exc).startswith(INDEX), exc
        _count("index: metadata.headers", "refused")
        return
    for header in (out or {}).values():
        _consistent(header.entries, header.data_start, header.size)
    _count("index: metadata.headers", "accepted")


# -- 3. key-mapping files -----------------------------------------------------------------------

RULE_PIECES = ["{}", "layers", ".", "1", "12", "w", "{", "}", "a", "_", "0", "{0}"]
RULE_SIDES = st.lists(st.sampled_from(RULE_PIECES), max_size=6).map("".join)
KEYS = st.lists(
    st.lists(st.sampled_from(["layers", ".", "1", "12", "w", "a", "0", "7", "_"]), max_size=8).map(
        "".join
    ),
    unique=True,
    max_size=6,
)


def _check_renaming(mapping: KeyMapping, keys: list[str], renaming: Renaming) -> None:
    """Every key is kept (renamed or as is) or dropped; no two land on one target."""
    assert set(renaming.targets) | set(renaming.dropped) == set(keys)
    assert not set(renaming.targets) & set(renaming.dropped)
    assert len(set(renaming.targets.values())) == len(renaming.targets)
    for key, target in renaming.targets.items():
        assert mapping(key) == target


@FUZZ
@given(st.dictionaries(RULE_SIDES, st.none() | RULE_SIDES | JSON, max_size=5), KEYS)
def test_random_rules_build_a_mapping_or_are_refused(
    rules: dict[str, Any], keys: list[str]
) -> None:
    try:
        mapping = KeyMapping(rules)
    except BaseException as exc:  # noqa: BLE001 - every outcome is classified, CheckpointException included
        _refused(exc, KeyMappingError)
        assert str(exc).startswith("key_mapping"), exc
        _count("keymap: rules", "refused")
        return
    _count("keymap: rules", "accepted")
    try:
        renaming = _within(HANG_S, lambda: mapping.apply(keys))
    except KeyMappingError as exc:  # a key matching two templates, or two keys onto one target
        _refused(exc, KeyMappingError)
        return
    _check_renaming(mapping, keys, renaming)


@FEW
@given(st.lists(st.integers(0, 10**6), min_size=1, max_size=4, unique=True))
def test_templates_rename_every_layer_number(layers: list[int]) -> None:
    mapping = KeyMapping(
        {"layers.{}.attn.{}.w": "model.{}.self_attn.q{}.weight", "tok.w": "embed.w", "gone": None}
    )
    keys = [f"layers.{n}.attn.{n % 7}.w" for n in layers] + ["tok.w", "gone", "other"]
    renaming = mapping.apply(keys)
    assert renaming.targets == {
        **{f"layers.{n}.attn.{n % 7}.w": f"model.{n}.self_attn.q{n % 7}.weight" for n in layers},
        "tok.w": "embed.w",
        "other": "other",
    }
    assert renaming.dropped == ("gone",)
    _count("keymap: rules", "accepted")


KEYMAP_FILES = (
    st.binary(max_size=30)
    | JSON.map(lambda v: json.dumps(v).encode())
    | st.dictionaries(RULE_SIDES, st.none() | RULE_SIDES, max_size=4).map(
        lambda d: json.dumps(d).encode()
    )
    | st.sampled_from(
        [
            b'{"a": "b", "a": "c"}',
            b"[" * 100_000,
            b'{"a": ' + b"9" * 5000 + b"}",
            b"\xef\xbb\xbf{}",
            b'{"a": "\\ud800"}',
        ]
    )
)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder for the property tests' files (hypothesis runs many examples per test call)."""
    return tmp_path_factory.mktemp("fuzz")


@FUZZ
@given(KEYMAP_FILES)
def test_key_mapping_files_load_or_are_refused_naming_the_file(
    scratch: Path, content: bytes
) -> None:
    path = scratch / "mapping.json"
    path.write_bytes(content)
    try:
        load_key_mapping(path)
    except BaseException as exc:  # noqa: BLE001 - every outcome is classified, CheckpointException included
        _refused(exc, KeyMappingError)
        assert str(path) in str(exc), exc
        _count("keymap: files", "refused")
        return
    _count("keymap: files", "accepted")


# -- 4. retention -------------------------------------------------------------------------------

STEPS = st.dictionaries(st.integers(0, 300), st.booleans(), max_size=25)
POLICIES = st.builds(RetentionPolicy, st.integers(1, 6), st.none() | st.integers(1, 60))


@FUZZ
@given(STEPS, POLICIES, st.lists(st.integers(0, 310), max_size=4))
def test_retention_keeps_what_it_promises(
    steps: dict[int, bool], policy: RetentionPolicy, in_flight: list[int]
) -> None:
    removed = to_remove(steps, policy, in_flight)
    complete = sorted(s for s, done in steps.items() if done)
    assert removed == sorted(set(removed)) and set(removed) <= set(steps)
    assert not set(removed) & set(complete[-policy.keep_last_n :]), "a newest complete step removed"
    assert not set(removed) & set(in_flight), "a step being saved removed"
    if policy.keep_every is not None:
        assert not {s for s in removed if steps[s] and s % policy.keep_every == 0}, (
            "a kept-forever multiple removed"
        )
    for s in removed:  # incomplete, or a complete step beyond the newest keep_last_n
        assert not steps[s] or s < complete[-policy.keep_last_n]
    kept = {s: done for s, done in steps.items() if s not in removed}
    assert to_remove(kept, policy, in_flight) == [], "retention is not idempotent"
    _count("retention: step sets", "accepted")


@FUZZ
@given(
    st.integers(0, 10**30) | st.text(max_size=12).map(lambda t: "step_" + t) | st.text(max_size=12)
)
def test_step_names_parse_exactly_the_names_step_name_gives(value: int | str) -> None:
    if isinstance(value, int):
        assert parse_step(step_name(value)) == value
        _count("retention: step names", "accepted")
        return
    step = parse_step(value)
    assert step is None or step_name(step) == value, f"{value!r} parsed as step {step}"
    _count("retention: step names", "refused" if step is None else "accepted")


@FEW
@given(
    st.none() | st.booleans() | st.integers(-3, 0) | st.floats() | st.text(max_size=3),
    st.booleans(),
)
def test_bad_retention_counts_are_refused_naming_the_value(value: Any, as_keep_every: bool) -> None:
    if value is None and not as_keep_every:
        value = 0
    if value is None:
        assert RetentionPolicy(2, value).keep_every is None
        return
    with pytest.raises(ValueError, match=re.escape(f"={value!r} must be")):
        RetentionPolicy(2, value) if as_keep_every else RetentionPolicy(value)
    _count("retention: policies", "refused")


# -- 5. whole checkpoints, mutated --------------------------------------------------------------


def _saved_state_dict() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.w": torch.randn(4, 8, generator=g),
        "b.bf": torch.randn(3, 5, generator=g).bfloat16(),
        "c.i": torch.arange(-5, 5, dtype=torch.int64),
        "d.h": torch.randn(6, generator=g).half(),
        "e.s": torch.tensor(2.5),
        "f.b": torch.tensor([True, False, True]),
    }


@dataclass(frozen=True)
class Pristine:
    """A saved checkpoint: its files' bytes, the tensors, and which file holds which keys."""

    files: dict[str, bytes]
    tensors: dict[str, torch.Tensor]
    keys_of: dict[str, list[str]]

    def index(self) -> dict[str, Any]:
        return json.loads(self.files[INDEX])

    def header_n(self, file: str) -> int:
        return struct.unpack("<Q", self.files[file][:8])[0]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Pristine:
    folder = tmp_path_factory.mktemp("saved") / "ck"
    sd = _saved_state_dict()
    dcp.save(sd, storage_writer=HFStorageWriter(str(folder), max_shard_size=200), no_dist=True)
    files = {p.name: p.read_bytes() for p in folder.iterdir()}
    weight_map = json.loads(files[INDEX])["weight_map"]
    assert sorted(files) == sorted([INDEX, SHARD_1, SHARD_2]) and len(set(weight_map.values())) == 2
    keys_of: dict[str, list[str]] = defaultdict(list)
    for key, file in weight_map.items():
        keys_of[file].append(key)
    return Pristine(files, sd, dict(keys_of))


# --- "nothing outside the folder is opened" -----------------------------------------------------

# Every open (builtins.open, io.open and os.open all raise the "open" audit event) while a load
# runs, from any thread. An audit hook cannot be removed, so it is installed once per process and
# records only while _OPENED is a list.
_OPENED: list[str] | None = None
_HOOKED = False


def _audit(event: str, args: tuple[Any, ...]) -> None:
    opened = _OPENED
    if opened is not None and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        opened.append(os.fsdecode(args[0]))


@contextlib.contextmanager
def _recording_opens() -> Iterator[list[str]]:
    """The paths opened inside the block (by any thread)."""
    global _OPENED, _HOOKED  # noqa: PLW0603 - an audit hook cannot be removed: installed once, it reads a module global
    if not _HOOKED:
        sys.addaudithook(_audit)
        _HOOKED = True
    _OPENED = opened = []
    try:
        yield opened
    finally:
        _OPENED = None


# Opens that are no checkpoint data, and so may be anywhere. Seen in these loads: the source files
# linecache reads when DCP logs a failed read_metadata with its traceback (torch's, json's, this
# package's), and modules imported on first use (encodings.utf_8_sig for an index with a BOM); all
# under the interpreter's prefixes (the venv's site-packages included) or the package's folder.
# /proc, /sys and /dev too: torch reads CPU and memory information there on some platforms.
_NOT_DATA = tuple(
    os.path.realpath(p) + os.sep
    for p in {
        sys.prefix,
        sys.base_prefix,
        sys.exec_prefix,
        os.path.dirname(hf_dcp_storage.__file__),
        "/proc",
        "/sys",
        "/dev",
    }
)


def _opened_outside(opened: list[str], folder: Path) -> list[str]:
    inside = os.path.realpath(folder) + os.sep
    return [p for p in opened if not os.path.realpath(p).startswith((inside, *_NOT_DATA))]


# --- the cases ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One mutated checkpoint: its files, and the names one of which a refusal must mention."""

    category: str
    label: str
    files: dict[str, bytes]
    names: tuple[str, ...]
    must_raise: bool = False
    any_file: bool = (
        False  # any path inside the folder will do (random mutations: which is hit is not known)
    )


def _replace(files: Mapping[str, bytes], name: str, data: bytes | None) -> dict[str, bytes]:
    out = dict(files)
    if data is None:
        del out[name]
    else:
        out[name] = data
    return out


def _xor(data: bytes, at: int, mask: int) -> bytes:
    return data[:at] + bytes([data[at] ^ mask]) + data[at + 1 :]


def _without_recorded_headers(p: Pristine) -> dict[str, bytes]:
    index = p.index()
    del index["metadata"]["headers"]
    return _replace(p.files, INDEX, json.dumps(index).encode())


def _file_cases(
    base: dict[str, bytes], variant: str, p: Pristine, *, header_stride: int, data_stride: int
) -> Iterator[Case]:
    """Header bytes, header length, truncation, data bytes and whole-file swaps, for each shard.

    Every ``header_stride``-th header byte and every ``data_stride``-th data byte is flipped; the
    files are cut every 4 bytes and at every boundary (length field, header end, each tensor's).
    """
    for f, other in ((SHARD_1, SHARD_2), (SHARD_2, SHARD_1)):
        data, n = base[f], p.header_n(f)

        def case(category: str, label: str, new: bytes | None, must_raise: bool = False) -> Case:
            return Case(
                f"{variant}: {category}",
                f"{f}: {label}",  # noqa: B023 - called within the iteration
                _replace(base, f, new),  # noqa: B023 - called within the iteration
                (f,),  # noqa: B023 - called within the iteration
                must_raise,
            )

        for at in range(8, 8 + n, header_stride):
            yield case("header JSON bytes", f"byte {at} ^ 0x01", _xor(data, at, 0x01))
            if at % (5 * header_stride) == 0:
                yield case("header JSON bytes", f"byte {at} ^ 0x80", _xor(data, at, 0x80))
        for at in range(8 + n - 8, 8 + n):  # the padding: other whitespace is JSON, the rest is not
            for c in b"\t\n\x00x}":
                yield case(
                    "header JSON bytes",
                    f"padding byte {at} = {c:#x}",
                    data[:at] + bytes([c]) + data[at + 1 :],
                )
        lengths = {
            n - 8,
            n - 1,
            n + 1,
            n + 8,
            0,
            1,
            7,
            len(data) - 8,
            len(data) - 7,
            len(data),
            2**32,
            2**63,
            2**64 - 1,
        }
        for value in sorted(lengths | {MAX_HEADER_BYTES, MAX_HEADER_BYTES + 1}):
            yield case("header length", f"length {value}", struct.pack("<Q", value) + data[8:])
        for at in range(8):
            yield case("header length", f"length byte {at} ^ 0xff", _xor(data, at, 0xFF))
        ends = [
            8 + n + spec["data_offsets"][1]
            for key, spec in json.loads(data[8 : 8 + n]).items()
            if key != "__metadata__"
        ]
        cuts = set(range(0, len(data), 4)) | {
            c + d for c in (7, 8, 8 + n, *ends) for d in (-1, 0, 1)
        }
        for cut in sorted(c for c in cuts if 0 <= c < len(data)):
            yield case("truncation", f"cut at {cut}", data[:cut])
        for at in range(8 + n, len(data), data_stride):
            yield case("data bytes", f"byte {at} ^ 0x01", _xor(data, at, 0x01), must_raise=True)
        for extra in (b"\0", b" " * 8, bytes(1000)):
            yield case("whole file", f"{len(extra)} bytes appended", data + extra)
        yield case("whole file", "removed", None)
        yield case("whole file", "emptied", b"")
        yield case("whole file", f"replaced by {other}", base[other])


def _index_cases(p: Pristine, outside: Path) -> Iterator[Case]:
    """The index rewritten: not JSON, type confusion, traversal, missing and extra keys, checksums,
    headers."""
    raw = p.files[INDEX]
    text = raw.decode()
    first = next(iter(p.keys_of[SHARD_1]))
    for label, new in {
        "empty": b"",
        "cut JSON": raw[: len(raw) // 2],
        "null": b"null",
        "list": b"[]",
        "number": b"42",
        "string": b'"weight_map"',
        "invalid UTF-8": b"\xff\xfe" + raw,
        "UTF-8 BOM": b"\xef\xbb\xbf" + raw,
        "nested 100,000 deep": b"[" * 100_000 + b"]" * 100_000,
        "a 5,000-digit int": text.replace(
            '"metadata": {', '"metadata": {"big": ' + "9" * 5000 + ",", 1
        ).encode(),
        "a weight_map key twice": text.replace(
            '"weight_map": {', f'"weight_map": {{"{first}": "{SHARD_2}",', 1
        ).encode(),
        "weight_map twice": text.replace(
            '"weight_map": {', '"weight_map": {}, "weight_map": {', 1
        ).encode(),
    }.items():
        yield Case(
            "index: not JSON, or ambiguous JSON", label, _replace(p.files, INDEX, new), (INDEX,)
        )

    def edited(
        category: str,
        label: str,
        edit: Callable[[dict[str, Any]], Any],
        *names: str,
        must_raise: bool = False,
    ) -> Case:
        index = p.index()  # a fresh parse: edits never leak into the next case
        edit(index)
        return Case(
            category,
            label,
            _replace(p.files, INDEX, json.dumps(index).encode()),
            (INDEX, *names),
            must_raise,
        )

    yield from _weight_map_cases(p, outside, edited)
    yield from _metadata_cases(p, edited)
    yield from _recorded_header_cases(p, edited)


Edit = Callable[..., Case]


def _set(path: tuple[str, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(index: dict[str, Any]) -> None:
        node = index
        for part in path[:-1]:
            node = node[part]
        node[path[-1]] = value

    return edit


def _drop(*path: str) -> Callable[[dict[str, Any]], None]:
    def edit(index: dict[str, Any]) -> None:
        node = index
        for part in path[:-1]:
            node = node[part]
        del node[path[-1]]

    return edit


def _weight_map_cases(p: Pristine, outside: Path, edited: Edit) -> Iterator[Case]:
    for value in ([], None, 5, "x", {}, [[k, f] for k, f in p.index()["weight_map"].items()]):
        yield edited(
            "index: type confusion",
            f"weight_map = {str(value)[:30]}",
            _set(("weight_map",), value),
            *p.tensors,
        )
    for key, file in p.index()["weight_map"].items():
        for value in (5, [file], None, {"f": file}, True, 1.5):
            yield edited(
                "index: type confusion",
                f"weight_map[{key!r}] = {value!r}",
                _set(("weight_map", key), value),
                key,
            )
        yield edited(
            "index: missing and extra keys", f"{key!r} removed", _drop("weight_map", key), key
        )
        yield edited(
            "index: missing and extra keys",
            f"{key!r} -> a missing file",
            _set(("weight_map", key), "gone.safetensors"),
            key,
            "gone.safetensors",
        )
        other = SHARD_2 if file == SHARD_1 else SHARD_1
        yield edited(
            "index: missing and extra keys",
            f"{key!r} -> {other}",
            _set(("weight_map", key), other),
            key,
            other,
        )
    yield edited(
        "index: missing and extra keys",
        "extra key in a file without it",
        _set(("weight_map", "zz"), SHARD_1),
        "zz",
    )
    yield edited(
        "index: missing and extra keys",
        "extra key in a missing file",
        _set(("weight_map", "zz"), "gone.safetensors"),
        "zz",
        "gone.safetensors",
    )
    yield edited(
        "index: missing and extra keys", "extra top-level key", _set(("extra",), {"x": [1]})
    )
    # Traversal: a copy of SHARD_1 lies outside the folder, so a loader that followed any of these
    # names would load the right tensors (their checksums match) and only the open would show.
    for name in [*TRAVERSALS, str(outside), "file://" + str(outside)]:
        for with_copy in (True, False):

            def traverse(
                index: dict[str, Any], name: str = name, with_copy: bool = with_copy
            ) -> None:
                for key in p.keys_of[SHARD_1]:
                    index["weight_map"][key] = name
                if (
                    with_copy
                ):  # the index's copy of the header, so a loader would go straight to the data
                    index["metadata"]["headers"][name] = index["metadata"]["headers"][SHARD_1]

            label = f"weight_map -> {name!r}" + (" (with a header copy)" if with_copy else "")
            yield edited("index: path traversal", label, traverse, repr(name), *p.keys_of[SHARD_1])


def _metadata_cases(p: Pristine, edited: Edit) -> Iterator[Case]:
    for value in (None, [], "x", 5):
        yield edited(
            "index: type confusion",
            f"metadata = {value!r}",
            _set(("metadata",), value),
            "checksums",
        )
    yield edited(
        "index: missing and extra keys", "metadata removed", _drop("metadata"), "checksums"
    )
    for value in (float("nan"), float("inf"), "257", -1, 10**30, 1.5, None):
        yield edited(
            "index: total_size", f"total_size = {value!r}", _set(("metadata", "total_size"), value)
        )
    yield edited("index: total_size", "total_size removed", _drop("metadata", "total_size"))
    for value in ("md5", None, 32, "CRC32"):
        yield edited(
            "index: checksums",
            f"checksum_algorithm = {value!r}",
            _set(("metadata", "checksum_algorithm"), value),
            "checksum_algorithm",
        )
    yield edited(
        "index: checksums",
        "checksum_algorithm removed",
        _drop("metadata", "checksum_algorithm"),
        "checksum_algorithm",
    )
    for value in ([], None, "x", {}):
        yield edited(
            "index: checksums",
            f"checksums = {value!r}",
            _set(("metadata", "checksums"), value),
            "checksums",
            *p.tensors,
        )
    yield edited(
        "index: checksums", "checksums removed", _drop("metadata", "checksums"), "checksums"
    )
    yield edited(
        "index: checksums", "extra checksum", _set(("metadata", "checksums", "zz"), "00000000")
    )
    for key, crc in p.index()["metadata"]["checksums"].items():
        wrong = f"{int(crc, 16) ^ 1:08x}"
        for value in (
            5,
            None,
            "xyz",
            "0x" + crc[2:],
            " " + crc[1:],
            "+" + crc[1:],
            crc + "0",
            crc[1:],
            "\u0661" * 8,
            crc[:4] + "_" + crc[5:],
        ):
            yield edited(
                "index: checksums",
                f"checksums[{key!r}] = {value!r}",
                _set(("metadata", "checksums", key), value),
                "checksums",
                key,
            )
        yield edited(
            "index: checksums",
            f"checksums[{key!r}] upper case",
            _set(("metadata", "checksums", key), crc.upper()),
        )
        yield edited(
            "index: checksums",
            f"checksums[{key!r}] wrong",
            _set(("metadata", "checksums", key), wrong),
            key,
            must_raise=True,
        )
        yield edited(
            "index: checksums",
            f"checksums[{key!r}] removed",
            _drop("metadata", "checksums", key),
            key,
        )


# One-for-one dtype swaps that keep every byte count, so only the header says which is right.
_SAME_SIZE = {"F32": "I32", "I32": "F32", "BF16": "F16", "F16": "BF16", "I64": "F64", "BOOL": "U8"}


def _recorded_header_cases(p: Pristine, edited: Edit) -> Iterator[Case]:
    for value in (None, [], "x"):
        yield edited(
            "index: metadata.headers",
            f"headers = {value!r}",
            _set(("metadata", "headers"), value),
            "headers",
        )
    yield edited("index: metadata.headers", "headers removed", _drop("metadata", "headers"))
    yield edited(
        "index: metadata.headers",
        "header of an unnamed file",
        _set(("metadata", "headers", "x.safetensors"), {"size": 8, "header": "{}"}),
    )
    for f in (SHARD_1, SHARD_2):
        entry = p.index()["metadata"]["headers"][f]
        size, header = entry["size"], entry["header"]
        for value in ("x", {}, {"size": size}, {"header": header}, None):
            yield edited(
                "index: metadata.headers",
                f"headers[{f}] = {str(value)[:20]}",
                _set(("metadata", "headers", f), value),
                f,
            )
        for value in (-1, 0, size - 1, size + 1000, str(size), True, 2**64, 1.5):
            yield edited(
                "index: metadata.headers",
                f"headers[{f}].size = {value!r}",
                _set(("metadata", "headers", f, "size"), value),
                f,
            )
        for value in (5, "", "{oops", "\ud800", "[]", '{"__metadata__": 0}'):
            yield edited(
                "index: metadata.headers",
                f"headers[{f}].header = {value!r}",
                _set(("metadata", "headers", f, "header"), value),
                f,
            )
        decoded = json.loads(header)
        for key in p.keys_of[f]:
            spec = decoded[key]
            variants = {
                f"dtype {spec['dtype']} -> {_SAME_SIZE.get(spec['dtype'])}": {
                    **spec,
                    "dtype": _SAME_SIZE.get(spec["dtype"], spec["dtype"]),
                },
                "shape reversed": {**spec, "shape": spec["shape"][::-1]},
                "shape + [1]": {**spec, "shape": [*spec["shape"], 1]},
                "offsets + 1": {**spec, "data_offsets": [o + 1 for o in spec["data_offsets"]]},
            }
            for label, new in variants.items():
                if new == spec:
                    continue
                # Padded as the writer pads: the data must start where it did, or the CRC32s alone
                # refuse it.
                text = json.dumps({**decoded, key: new}, separators=(",", ":")).ljust(len(header))
                yield edited(
                    "index: metadata.headers",
                    f"headers[{f}]: {key!r} {label}",
                    _set(("metadata", "headers", f, "header"), text),
                    f,
                    key,
                )
            others = {k: v for k, v in decoded.items() if k != key}
            text = json.dumps(others, separators=(",", ":")).ljust(len(header))
            yield edited(
                "index: metadata.headers",
                f"headers[{f}]: {key!r} left out",
                _set(("metadata", "headers", f, "header"), text),
                f,
                key,
            )


# --- running one case -----------------------------------------------------------------------------


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def _load(folder: Path, p: Pristine, threads: int) -> list[BaseException]:
    """Load the checkpoint at ``folder`` with ``verify=True``: the errors it raised, or ``[]``
    after checking that every tensor equals the saved one exactly (values and dtype).

    DCP reports what ``read_metadata`` raised as an ``AssertionError`` carrying the message only;
    the original is then taken by calling ``read_metadata`` directly, to check its type.
    """
    out = {k: torch.zeros_like(v) for k, v in p.tensors.items()}
    try:
        dcp.load(
            out,
            storage_reader=HFStorageReader(str(folder), verify=True, thread_count=threads),
            no_dist=True,
        )
    except CheckpointException as exc:
        errors = [failure for failure, _ in exc.failures.values()]
    except BaseException as exc:  # noqa: BLE001 - every outcome is classified, CheckpointException included
        errors = [exc]
    else:
        for key, saved in p.tensors.items():
            assert out[key].dtype == saved.dtype and torch.equal(out[key], saved), (
                f"{key!r} loaded without error, but wrong"
            )
        return []
    for exc in errors:
        if isinstance(exc, AssertionError) and str(exc).startswith("metadata is None"):
            with pytest.raises(Exception) as info:
                HFStorageReader(str(folder), verify=True, thread_count=threads).read_metadata()
            _refused(info.value, (ValueError, OSError))
        else:
            _refused(exc, ALLOWED)
    return errors


def _run(case: Case, work: Path, p: Pristine, threads: int = 1) -> None:
    """Write ``case``'s folder, load it, and check the contract.

    The sweeps load on one thread (the reader then runs inline: 3 ms a case instead of 13, most of
    it thread start-up); the random cases on four, as a load does by default.
    """
    folder = work / "ck"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    for name, data in case.files.items():
        (folder / name).write_bytes(data)
    before = _snapshot(work)
    where = f"{case.category} / {case.label}"
    with _recording_opens() as opened:
        try:
            errors = _within(HANG_S, lambda: _load(folder, p, threads))
        except AssertionError as exc:  # a wrong load, a forbidden error type, or a hang
            raise AssertionError(f"{where}: {exc}") from None
    assert _snapshot(work) == before, f"{where}: the load changed files"
    assert not _opened_outside(opened, folder), (
        f"{where}: opened outside the folder: {_opened_outside(opened, folder)}"
    )
    if not errors:
        assert not case.must_raise, f"{where}: loaded, but must be refused"
        _count(f"load: {case.category}", "accepted")
        return
    message = " | ".join(str(e) for e in errors)
    named = any(name in message for name in case.names) or (
        case.any_file and f"{folder}{os.sep}" in message
    )
    assert named, f"{where}: the message names none of {case.names}: {message}"
    _count(f"load: {case.category}", "refused")


@pytest.fixture
def work(tmp_path: Path, pristine: Pristine) -> Path:
    """A folder holding the checkpoint folder ``ck`` and, beside it, a copy of one shard."""
    (tmp_path / "outside.safetensors").write_bytes(pristine.files[SHARD_1])
    return tmp_path


def test_the_audit_hook_sees_a_load_open_its_files(work: Path, pristine: Pristine) -> None:
    """The guard itself: without it every "nothing opened outside" check would pass vacuously."""
    folder = work / "ck"
    folder.mkdir()
    for name, data in pristine.files.items():
        (folder / name).write_bytes(data)
    with _recording_opens() as opened:
        assert _load(folder, pristine, 4) == []
    assert {os.path.basename(p) for p in opened} >= {INDEX, SHARD_1, SHARD_2}
    assert _opened_outside([str(work / "outside.safetensors"), "/etc/passwd"], folder) == [
        str(work / "outside.safetensors"),
        "/etc/passwd",
    ]


@pytest.mark.parametrize("variant", ["recorded headers", "headers from the files"])
def test_every_file_mutation_loads_exactly_or_is_refused(
    work: Path, pristine: Pristine, variant: str
) -> None:
    """With the index's copies of the headers the loader reads the data through them (every data
    byte flipped); without, it decodes the files' own headers (every header byte flipped)."""
    if variant == "recorded headers":
        cases = _file_cases(pristine.files, variant, pristine, header_stride=3, data_stride=1)
    else:
        cases = _file_cases(
            _without_recorded_headers(pristine), variant, pristine, header_stride=1, data_stride=3
        )
    for case in cases:
        _run(case, work, pristine)


def test_every_index_mutation_loads_exactly_or_is_refused(work: Path, pristine: Pristine) -> None:
    for case in _index_cases(pristine, work / "outside.safetensors"):
        _run(case, work, pristine)


@settings(FUZZ, max_examples=80)
@given(st.data())
def test_random_byte_mutations_load_exactly_or_are_refused(
    pristine: Pristine, scratch: Path, data: st.DataObject
) -> None:
    """Several flips at once, anywhere in one file (the index included), maybe a truncation too."""
    work = scratch / "random"
    work.mkdir(exist_ok=True)
    (work / "outside.safetensors").write_bytes(pristine.files[SHARD_1])
    name = data.draw(st.sampled_from([INDEX, SHARD_1, SHARD_2]))
    raw = bytearray(pristine.files[name])
    for at, mask in data.draw(
        st.lists(
            st.tuples(st.integers(0, len(raw) - 1), st.integers(1, 255)), min_size=1, max_size=6
        )
    ):
        raw[at] ^= mask
    cut = data.draw(st.none() | st.integers(0, len(raw)))
    new = bytes(raw[:cut] if cut is not None else raw)
    # Where the flips land is not known here: a checksum digit in the index, say, makes a refusal
    # that names the data file and key, a file name's a refusal naming the file it now names; so
    # any key, or any file of the folder, will do.
    category = f"random multi-byte mutations ({'index' if name == INDEX else 'shards'})"
    _run(
        Case(
            category,
            "",
            _replace(pristine.files, name, new),
            tuple(pristine.tensors),
            any_file=True,
        ),
        work,
        pristine,
        threads=4,
    )


# -- 6. regressions: one per defect the fuzzing found ----------------------------------------------


@pytest.mark.parametrize(
    "body, kind",
    [
        (b'{"a": ' + b"9" * 5000 + b"}", "ValueError: Exceeds the limit"),
        (b"[" * 100_000, "RecursionError"),
    ],
    ids=["5000-digit-int", "nested-100000-deep"],
)
def test_json_python_cannot_build_is_refused_by_every_parser(
    tmp_path: Path, body: bytes, kind: str
) -> None:
    """Before: a bare ValueError naming no file (int digit limit) or a RecursionError escaped
    decode_header, parse_index and load_key_mapping."""
    with pytest.raises(
        HeaderError, match=rf"^f.safetensors: header is not valid UTF-8 JSON \({kind}"
    ):
        decode_header(_prefixed(body), where="f.safetensors")
    with pytest.raises(
        ValueError,
        match=rf"^{INDEX}: not valid JSON \({kind}.*restore the index from a copy or re-save",
    ):
        parse_index(body, INDEX)
    (tmp_path / "m.json").write_bytes(body)
    with pytest.raises(KeyMappingError, match=rf"m.json: not valid JSON \({kind}"):
        load_key_mapping(tmp_path / "m.json")


@pytest.mark.parametrize("value", ["0", '""', "[]", "false"])
def test_header_metadata_must_be_null_or_an_object_of_strings(value: str) -> None:
    """Before: any falsy __metadata__ (0, "", [], false) was taken for no metadata."""
    with pytest.raises(HeaderError, match=r"__metadata__ must map strings to strings, got"):
        decode_header(_prefixed(b'{"__metadata__":' + value.encode() + b"}"))
    assert decode_header(_prefixed(b'{"__metadata__":null}'))[1] == {}


def test_a_name_given_twice_in_a_header_is_refused() -> None:
    """Before: the last of two entries named alike won silently (another reader may take the
    first)."""
    spec = '{"dtype":"F32","shape":[1],"data_offsets":[0,4]}'
    with pytest.raises(
        HeaderError, match=r"^f: header names 'w' twice in one object; the file is corrupt"
    ):
        decode_header(_prefixed(f'{{"w":{spec},"w":{spec}}}'.encode()), where="f")


def test_encode_header_names_a_key_utf8_cannot_encode() -> None:
    """Before: UnicodeEncodeError ("surrogates not allowed"), naming no key."""
    with pytest.raises(ValueError, match=r"tensor name 'w\\ud800' holds a lone UTF-16 surrogate"):
        encode_header([TensorEntry("w\ud800", torch.float32, (1,), 0, 4)])
    with pytest.raises(
        ValueError, match=r"metadata value of 'k' '\\udc80' holds a lone UTF-16 surrogate"
    ):
        encode_header([], {"k": "\udc80"})


def test_a_name_given_twice_in_the_index_is_refused_naming_it() -> None:
    """Before: ``{"w": "a", "w": "b"}`` loaded ``w`` from the second file without a word."""
    raw = b'{"weight_map": {"w": "a.safetensors", "w": "b.safetensors"}}'
    with pytest.raises(
        ValueError,
        match=rf"^{INDEX}: names 'w' twice in one object, so which value holds is ambiguous",
    ):
        parse_index(raw, INDEX)


@pytest.mark.parametrize(
    "file", ["x\x00.safetensors", "x\x1f.safetensors", "\ud800.safetensors", "."]
)
def test_file_names_no_store_has_are_refused(file: str) -> None:
    """Before: accepted; os.open then failed with "embedded null byte" (naming no file), or
    "surrogates not allowed", and "." named the folder itself."""
    with pytest.raises(
        ValueError,
        match=rf"weight_map names file {re.escape(repr(file))}, which is not a plain relative path",
    ):
        parse_index(json.dumps({"weight_map": {"w": file}}).encode(), INDEX)


@pytest.mark.parametrize("file", ["..0.safetensors", "...", "sub/..x.safetensors"])
def test_names_that_only_start_with_two_dots_are_plain_names(file: str) -> None:
    """Before: refused, as if they were the parent folder."""
    assert parse_index(json.dumps({"weight_map": {"w": file}}).encode(), INDEX).weight_map == {
        "w": file
    }


@pytest.mark.parametrize(
    "value", ["0x00001f", " 000001f", "000001f ", "+0000001", "-0000001", "0000_001", "\u0661" * 8]
)
def test_checksums_that_int_would_take_are_malformed(value: str) -> None:
    """Before: int(value, 16) accepted each of these (and "-0000001" became -1)."""
    assert checksum_table({"checksum_algorithm": "crc32", "checksums": {"w": value}}, INDEX) == (
        {},
        {"w": value},
    )
    with pytest.raises(ValueError, match=r"must map tensor names to CRC32 values of 8 hex digits"):
        parse_index(
            json.dumps(
                {
                    "weight_map": {"w": "a.safetensors"},
                    "metadata": {"checksum_algorithm": "crc32", "checksums": {"w": value}},
                }
            ).encode(),
            INDEX,
        )


def test_a_lone_surrogate_in_a_recorded_header_is_refused_naming_the_file() -> None:
    """Before: UnicodeEncodeError ("surrogates not allowed"), naming neither index nor file."""
    with pytest.raises(
        ValueError,
        match=rf"^{INDEX}: metadata.headers must map .*; the header of 'a.safetensors' holds a "
        r"lone UTF-16 surrogate",
    ):
        recorded_headers(
            {"headers": {"a.safetensors": {"size": 16, "header": '{"\ud800": 1}'}}},
            ["a.safetensors"],
            INDEX,
        )


@pytest.mark.parametrize("source", ["{}" * 14 + "x", "layers.{}{}.w", "layers.{}1{}.w", "{}00{}"])
def test_placeholders_with_only_digits_between_them_are_refused(source: str) -> None:
    """Before: accepted, and matching a 26-digit key against the first took a second (each more
    {} doubles it): (\\d+)(\\d+)... backtracks through every split of the digits."""
    with pytest.raises(
        KeyMappingError, match=r"has two \{\} placeholders with only digits between them"
    ):
        _within(HANG_S, lambda: KeyMapping({source: "t" + ".{}" * source.count("{}")}))
    mapping = KeyMapping({"l.{}.{}x{}": "m.{}.{}.{}"})  # separated by non-digits: linear, and fine
    assert _within(HANG_S, lambda: mapping("l." + "1" * 5000)) == "l." + "1" * 5000


def test_step_names_with_other_scripts_digits_are_not_steps() -> None:
    """Before: "step_1\\u0662" parsed as step 12 (re's \\d and int() read any script's digits),
    a folder that step_name(12) does not name."""
    assert parse_step("step_1\u0662") is None and parse_step("step_\u0661") is None
    assert parse_step("step_12") == 12


@pytest.mark.parametrize("keep_last_n, keep_every", [(True, None), (2, True), (2, False)])
def test_retention_counts_refuse_bools(keep_last_n: Any, keep_every: Any) -> None:
    """Before: RetentionPolicy(True) passed as keep_last_n=1, and keep_every=True as 1."""
    with pytest.raises(ValueError, match=r"=(True|False) must be"):
        RetentionPolicy(keep_last_n, keep_every)


def test_verify_refuses_a_recorded_header_that_says_another_dtype(
    work: Path, pristine: Pristine
) -> None:
    """Before: verify=True loaded F32 bytes as I32 (converted to float: garbage) without a word,
    since the CRC32 covers the bytes, not the dtype the index's copy of the header gives them."""
    index = pristine.index()
    entry = index["metadata"]["headers"][SHARD_1]
    entry["header"] = entry["header"].replace('"a.w":{"dtype":"F32"', '"a.w":{"dtype":"I32"')
    folder = work / "ck"
    folder.mkdir()
    for name, data in _replace(pristine.files, INDEX, json.dumps(index).encode()).items():
        (folder / name).write_bytes(data)
    with pytest.raises(
        ValueError,
        match=rf"{SHARD_1}: the file's header differs from the copy in {INDEX} "
        r"\(metadata.headers\): tensor 'a.w' is torch.int32 \[4, 8\] at \[0, 128\] in the "
        r"copy, torch.float32 \[4, 8\] at \[0, 128\] in the file",
    ):
        HFStorageReader(str(folder), verify=True).read_metadata()
    HFStorageReader(str(folder)).read_metadata()  # without verify the copy is trusted, as before


def test_verify_checkpoint_reports_a_recorded_size_that_is_not_the_files(
    work: Path, pristine: Pristine
) -> None:
    """Before: a copy recording a larger size than its (sound) file passed verification."""
    from hf_dcp_storage.tools.verify import verify_checkpoint

    index = pristine.index()
    index["metadata"]["headers"][SHARD_2]["size"] += 1000
    folder = work / "ck"
    folder.mkdir()
    for name, data in _replace(pristine.files, INDEX, json.dumps(index).encode()).items():
        (folder / name).write_bytes(data)
    size = len(pristine.files[SHARD_2])
    messages = [p.message for p in verify_checkpoint(folder, thread_count=1).problems]
    assert any(
        re.search(
            rf"metadata.headers\['{SHARD_2}'\] records a size of {size + 1000} bytes, but "
            rf".*{SHARD_2} has {size}",
            m,
        )
        for m in messages
    ), messages
