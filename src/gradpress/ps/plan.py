"""What the worker pipeline (``worker.py``) keeps per tensor and per chunk in flight.

``Plan``: how one named tensor travels (signature, generation, chunk states); ``ChunkState``:
one key's descriptor, codecs and step counter; ``Job``: one chunk of one ``push_pull`` call
moving through the pipeline's five steps (``worker.py``'s module docstring).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from ..compress.base import Codec
from .handle import Handle
from .protocol import CTRL_BYTES, KeyDescriptor
from .transport import Op


@dataclass
class ChunkState:
    """Per-key state on the worker: descriptor, codecs, buffers and step counter."""

    key: int
    desc: KeyDescriptor
    server_rank: int
    server_name: str
    enc: Codec
    dec: Codec
    nbytes: int  # payload bytes each way (the wire buffers are lent per step by the pool)
    ctrl: torch.Tensor = field(default_factory=lambda: torch.empty(CTRL_BYTES,
                                                                     dtype=torch.uint8))
    step: int = 0

    @property
    def label(self) -> str:
        return f"key {self.key} ({self.desc.label})"


@dataclass
class Plan:
    """How one named tensor travels: its signature, generation and chunk states."""

    name: str
    signature: tuple
    generation: int
    numel: int
    chunks: list[ChunkState]
    offsets: list[int]
    last: threading.Event | None = None  # completion of the key's previous push_pull
    device: torch.device | None = None  # compress_on="device": where the codec state lives


@dataclass
class Job:
    """One chunk of one ``push_pull`` call moving through the pipeline."""

    cs: ChunkState
    x: torch.Tensor
    out: torch.Tensor
    handle: Handle
    lr: float | None
    stream: Any = None  # the CUDA stream current at submit (None for other devices)
    step: int = 0
    send: torch.Tensor | None = None  # lent by the buffer pool from dispatch to finish
    recv: torch.Tensor | None = None
    ops: list[Op] = field(default_factory=list)
    recv_op: Op | None = None
    t_sent: float = 0.0
