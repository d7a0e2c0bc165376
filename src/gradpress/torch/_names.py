"""Parameter names of :func:`~gradpress.torch.optimizer.DistributedOptimizer`.

Internal to :mod:`gradpress.torch`: the unique name of every optimizer parameter (the key its
gradient travels under on every worker) and the matching of names against exact names or
``fnmatch`` patterns (``uncompressed_params``). :func:`match_names` is public as
``gradpress.torch.optimizer.match_names``.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["match_names"]


def _param_names(groups: list[dict[str, Any]], named: Iterable[tuple[str, Any]] | None
                 ) -> dict[torch.Tensor, str]:
    """Map every parameter of the optimizer to a unique name (checked)."""
    params = [p for g in groups for p in g["params"]]
    if named is None:
        return {p: f"group{gi}.param{i}" for gi, g in enumerate(groups)
                for i, p in enumerate(g["params"])}
    by_param: dict[torch.Tensor, str] = {}
    seen: set[str] = set()
    for name, p in named:
        if not isinstance(name, str):
            raise TypeError(f"named_parameters must yield (str, Tensor) pairs, got name {name!r}")
        if name in seen:
            raise ValueError(f"named_parameters has the name {name!r} twice")
        seen.add(name)
        by_param.setdefault(p, name)
    missing = [i for i, p in enumerate(params) if p not in by_param]
    if missing:
        raise ValueError(f"{len(missing)} optimizer parameter(s) (indices {missing[:5]}) are not "
                         "in named_parameters; pass model.named_parameters() of the same model")
    return {p: by_param[p] for p in params}


def match_names(names: Iterable[str], patterns: Iterable[str], what: str) -> frozenset[str]:
    """The names matched by any of ``patterns`` (exact names or ``fnmatch`` patterns).

    Raises:
        TypeError: ``patterns`` is a single string or holds a non-string.
        ValueError: a pattern matches no name (the message names it and lists some names).
    """
    if isinstance(patterns, str):
        raise TypeError(f"{what} must be a collection of names or patterns, got the string "
                        f"{patterns!r}; write [{patterns!r}]")
    names = list(names)
    out: set[str] = set()
    for pat in patterns:
        if not isinstance(pat, str):
            raise TypeError(f"{what} must hold strings, got {pat!r}")
        hits = [n for n in names if fnmatch.fnmatchcase(n, pat)]
        if not hits:
            shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
            raise ValueError(f"{what}: {pat!r} matches no parameter name; names are: {shown}")
        out.update(hits)
    return frozenset(out)
