"""Gradient codecs: ``build(spec, numel, ef=None, momentum=None, seed=0)`` returns a codec with
``payload_bytes``, ``compress(x, key=, step=, lr=, out=)`` and ``decompress(payload, out=)``.

Families: ``none``/``fp16``/``bf16`` (:mod:`.cast`), ``onebit`` (:mod:`.onebit`),
``topk``/``randomk`` (:mod:`.sparse`), ``dithering`` (:mod:`.dithering`); error feedback
(:mod:`.ef`, configured by an :class:`EFSpec`) and Nesterov momentum (:mod:`.momentum`) wrap
any of them.
"""

from .base import Codec
from .header import HEADER_BYTES, Header, read_header
from .registry import MOMENTUM_KINDS, build, codec_class, codec_names
from .spec import EF_KINDS, CodecSpec, EFSpec, parse_ef, parse_spec
from .wrapper import CodecWrapper

__all__ = ["Codec", "CodecWrapper", "HEADER_BYTES", "Header", "read_header", "build",
           "codec_class", "codec_names", "CodecSpec", "parse_spec", "EFSpec", "parse_ef",
           "EF_KINDS", "MOMENTUM_KINDS"]
