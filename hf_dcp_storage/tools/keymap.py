"""Renaming checkpoint keys on conversion: exact rules and ``{}`` templates, or drop (``None``).

Pure: rules in, a mapping of the actual keys out, every ambiguity refused with the rule named.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ..format.strictjson import loads_strict
from ..io import fsio

__all__ = ["KeyMapping", "KeyMappingError", "Renaming", "load_key_mapping"]

_PLACEHOLDER = "{}"


class KeyMappingError(ValueError):
    """A key mapping that is malformed, ambiguous, or maps two source keys onto one target key."""


@dataclass(frozen=True)
class _Template:
    """A rule with ``{}`` placeholders: each matches one run of digits (a layer number)."""

    source: str
    target: str | None
    pattern: re.Pattern[str]

    def render(self, numbers: Sequence[str]) -> str | None:
        if self.target is None:
            return None
        pieces = self.target.split(_PLACEHOLDER)
        return "".join(p + n for p, n in zip(pieces[:-1], numbers, strict=True)) + pieces[-1]


@dataclass(frozen=True)
class Renaming:
    """What a :class:`KeyMapping` does to one checkpoint's keys.

    ``targets``: source key -> target key, for every key kept, in source order.
    ``dropped``: source keys mapped to ``null``, in source order.
    ``unused_rules``: rules (their source side) that matched none of the keys: usually a typo,
    or a mapping meant for another model.
    """

    targets: Mapping[str, str]
    dropped: tuple[str, ...]
    unused_rules: tuple[str, ...]


class KeyMapping:
    """Rename or drop checkpoint keys: source key -> target key, or ``None`` to drop the key.

    Keys and targets may hold ``{}`` placeholders, each matching one run of digits (layer
    numbers), as in torchtitan's state-dict adapters::

        KeyMapping({
            "tok_embeddings.weight": "model.embed_tokens.weight",
            "layers.{}.attention.wq.weight": "model.layers.{}.self_attn.q_proj.weight",
            "freqs_cis": None,
        })

    Exact rules win over templates; keys no rule matches keep their names. The constructor
    validates the rules; :meth:`apply` validates them against actual keys (a key matching two
    templates, two keys landing on one target).

    Args:
        rules: source key (or template) -> target key (or template), or ``None`` to drop.
        origin: how error messages name the mapping (e.g. the JSON file it came from).

    Raises:
        KeyMappingError: not a mapping of non-empty strings to non-empty strings or ``None``;
            braces other than ``{}``; different placeholder counts on the two sides of a rule;
            two placeholders of a source with only digits between them (``{}{}``, ``{}1{}``):
            ambiguous, and matching keys against such a rule takes time exponential in the
            number of placeholders.
    """

    def __init__(self, rules: Mapping[str, str | None], *, origin: str = "key_mapping") -> None:
        if not isinstance(rules, Mapping):
            raise KeyMappingError(
                f"{origin} must be a JSON object mapping source keys to target keys (or null to "
                f"drop a key), got {type(rules).__name__}"
            )
        self.origin = origin
        self._exact: dict[str, str | None] = {}
        self._templates: list[_Template] = []
        for source, target in rules.items():
            _check_rule(source, target, origin)
            if _PLACEHOLDER in source:
                pattern = re.compile(
                    r"(\d+)".join(re.escape(p) for p in source.split(_PLACEHOLDER))
                )
                self._templates.append(_Template(source, target, pattern))
            else:
                self._exact[source] = target

    @property
    def rules(self) -> dict[str, str | None]:
        """The rules as given (exact rules first)."""
        return {**self._exact, **{t.source: t.target for t in self._templates}}

    def __call__(self, key: str) -> str | None:
        """The target of ``key`` (``None``: dropped); raises ``KeyMappingError`` if ambiguous."""
        return self._lookup(key)[0]

    def __repr__(self) -> str:
        return f"KeyMapping({self.rules!r}, origin={self.origin!r})"

    def apply(self, keys: Iterable[str]) -> Renaming:
        """Map every key; nothing is renamed unless all of them map cleanly.

        Raises:
            KeyMappingError: a key matching two templates, or two keys (mapped, or kept as
                they are) landing on the same target key; the message names both.
        """
        targets: dict[str, str] = {}
        dropped: list[str] = []
        used: set[str] = set()
        origin_of: dict[str, str] = {}  # target -> source key
        for key in keys:
            target, rule = self._lookup(key)
            if rule is not None:
                used.add(rule)
            if target is None:
                dropped.append(key)
                continue
            if target in origin_of:
                raise KeyMappingError(
                    f"{self.origin}: both {origin_of[target]!r} and {key!r} would become "
                    f"{target!r}; each target key must come from one source key. Change one of "
                    "the rules, or map one of the keys to null to drop it"
                )
            origin_of[target] = key
            targets[key] = target
        unused = tuple(r for r in self.rules if r not in used)
        return Renaming(targets, tuple(dropped), unused)

    def _lookup(self, key: str) -> tuple[str | None, str | None]:
        """``(target, source side of the rule that matched or None)``."""
        if key in self._exact:
            return self._exact[key], key
        hits = [(t, m) for t in self._templates if (m := t.pattern.fullmatch(key)) is not None]
        if not hits:
            return key, None
        if len(hits) > 1:
            raise KeyMappingError(
                f"{self.origin}: key {key!r} matches several templates "
                f"{[t.source for t, _ in hits]}; make them distinct (each {{}} matches one run of "
                "digits) or add an exact rule for the key"
            )
        template, match = hits[0]
        return template.render(match.groups()), template.source


def _check_rule(source: object, target: object, origin: str) -> None:
    if not isinstance(source, str) or not source:
        raise KeyMappingError(f"{origin}: key {source!r} must be a non-empty string")
    if target is not None and (not isinstance(target, str) or not target):
        raise KeyMappingError(
            f"{origin}: {source!r} maps to {target!r}; a target must be a non-empty string, or "
            "null to drop the key"
        )
    for side in (source, target):
        if side is not None and (
            "{" in side.replace(_PLACEHOLDER, "") or "}" in side.replace(_PLACEHOLDER, "")
        ):
            raise KeyMappingError(
                f"{origin}: rule {source!r}: {target!r} has braces other than {{}}; the only "
                f"placeholder is {{}} (one run of digits, such as a layer number)"
            )
    if re.search(r"\{\}\d*\{\}", source):
        raise KeyMappingError(
            f"{origin}: rule {source!r} has two {{}} placeholders with only digits between them, "
            "so a key's digits could be split between them in several ways; separate them with a "
            "non-digit, such as '.'"
        )
    if target is not None and source.count(_PLACEHOLDER) != target.count(_PLACEHOLDER):
        raise KeyMappingError(
            f"{origin}: rule {source!r}: {target!r} has {source.count(_PLACEHOLDER)} {{}} "
            f"placeholder(s) on the left and {target.count(_PLACEHOLDER)} on the right; both "
            "sides need the same number, in the same order"
        )


def load_key_mapping(
    source: str | os.PathLike[str] | Mapping[str, str | None] | KeyMapping,
) -> KeyMapping:
    """A :class:`KeyMapping` from a JSON file (local path or fsspec URL) or from a dict.

    The JSON file holds one object: ``{"source key": "target key" or null, ...}``; a key given
    twice is refused (JSON would silently keep the last one).

    Raises:
        KeyMappingError: the file cannot be read, is not JSON, is not an object of strings or
            null, or has a bad rule (see :class:`KeyMapping`); the message names the file.
    """
    if isinstance(source, KeyMapping):
        return source
    if isinstance(source, Mapping):
        return KeyMapping(source)
    if not isinstance(source, (str, os.PathLike)):
        raise KeyMappingError(
            "key_mapping must be a JSON file path, a dict or a KeyMapping, got "
            f"{type(source).__name__}"
        )
    where = os.fspath(source)
    try:
        fs, path = fsio.resolve(where, None)
        raw = fsio.read_all(fs, path)
    except (OSError, ValueError, ImportError) as exc:
        raise KeyMappingError(
            f"cannot read key mapping {where}: {exc}; pass the path of a JSON file"
        ) from exc
    rules = loads_strict(
        raw,
        duplicate=lambda key: KeyMappingError(
            f"{where}: key {key!r} appears twice; give each source key one rule"
        ),
        invalid=lambda exc: KeyMappingError(
            f"{where}: not valid JSON ({type(exc).__name__}: {str(exc)[:200]}); a key mapping is "
            "one object such as "
            f'{{"layers.{{}}.attention.wq.weight": "model.layers.{{}}.self_attn.q_proj.weight", '
            f'"freqs_cis": null}}'
        ),
    )
    return KeyMapping(rules, origin=where)
