"""Hugging Face ``Trainer`` integration: gradpress's two-way compressed DDP hook, registered by a
``TrainerCallback``, with no change to ``transformers`` (see docs/integrations.md)::

    from gradpress.huggingface import TwoWayCompressionCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds)
    trainer.add_callback(TwoWayCompressionCallback(trainer, compression="onebit"))
    trainer.train()        # under torchrun --nproc-per-node N

What it does, per event:

1. ``on_train_begin`` (after the Trainer wrapped the model in DDP, before the first backward):
   registers :func:`~gradpress.ddp.two_way_compression_hook` with this callback's
   :class:`~gradpress.ddp.TwoWayCompressionState` on ``trainer.model_wrapped``. When the
   run resumes from ``output_dir/checkpoint-<step>`` (``trainer.train(resume_from_checkpoint=
   ...)``), the hook's residuals saved there by step 3 are loaded first.
2. ``on_step_begin``: gives the hook the current learning rate (``ef="corrected"`` and
   ``anneal=1`` need it).
3. ``on_save``: every rank writes its hook state (error-feedback residuals, step counters) to
   ``checkpoint-<step>/gradpress_ddp_hook/rank<r>.pt``, beside the Trainer's own files.

A one-process run (no DDP) trains unchanged and the hook is not used. The model must be wrapped
in :class:`torch.nn.parallel.DistributedDataParallel` (not FSDP or DeepSpeed).

Importing this module needs ``transformers`` (``pip install "gradpress[hf]"``); ``import
gradpress`` never imports it.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist

try:
    from transformers import TrainerCallback
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError('gradpress.huggingface needs the transformers package: '
                      'pip install "gradpress[hf]"') from e

from . import defaults
from .compress import EFSpec
from .compress.spec import Compression
from .ddp import TwoWayCompressionState, two_way_compression_hook

__all__ = ["TwoWayCompressionCallback", "STATE_DIR"]

log = logging.getLogger(__name__)

#: Directory inside a Trainer checkpoint that holds the hook state of every rank.
STATE_DIR = "gradpress_ddp_hook"


class TwoWayCompressionCallback(TrainerCallback):
    """Averages the Trainer's gradients with gradpress's two-way compressed DDP hook.

    Args:
        trainer: the ``transformers.Trainer`` (its ``model_wrapped`` is the DDP model once
            training begins; callbacks are not otherwise given it).
        state: a :class:`~gradpress.ddp.TwoWayCompressionState`; by default one built from
            ``compression`` (a spec string, a BytePS-style dict or a ``CodecSpec``), ``ef``,
            ``min_compress_bytes``, ``dense_steps`` and ``seed``, which have that class's
            meanings and defaults (``min_compress_bytes`` 1 MiB: lower it for a small model,
            whose DDP buckets are smaller); ignored when ``state`` is given.
        save_state: write the hook state into every Trainer checkpoint (``on_save``) and load it
            when training resumes from one. Default True.

    After training, ``callback.state.compression_stats()`` tells what the hook did
    (``compressed_buckets``, ``payload_bytes`` against ``dense_bytes``).
    """

    def __init__(self, trainer: Any, state: TwoWayCompressionState | None = None, *,
                 compression: Compression = defaults.COMPRESSION,
                 ef: str | EFSpec | None = defaults.EF,
                 min_compress_bytes: int = defaults.HOOK_MIN_COMPRESS_BYTES,
                 dense_steps: int = defaults.WRAPPER_DENSE_STEPS, seed: int = 0,
                 save_state: bool = True) -> None:
        if state is not None and not isinstance(state, TwoWayCompressionState):
            raise TypeError(f"TwoWayCompressionCallback: state must be a "
                            f"TwoWayCompressionState, got {type(state).__name__}")
        if not hasattr(trainer, "model_wrapped"):
            raise TypeError(f"TwoWayCompressionCallback: trainer must be a transformers.Trainer, "
                            f"got {type(trainer).__name__}")
        self.trainer = trainer
        self.state = state if state is not None else TwoWayCompressionState(
            compression, ef, min_compress_bytes=min_compress_bytes, dense_steps=dense_steps,
            seed=seed)
        self.save_state = save_state
        self._hooked: Any = None  # the DDP module the hook is registered on

    @property
    def registered(self) -> bool:
        """Whether the hook is registered on a DDP model."""
        return self._hooked is not None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        ddp = self.trainer.model_wrapped
        if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                raise TypeError(f"TwoWayCompressionCallback: the Trainer's model is wrapped in "
                                f"{type(ddp).__name__}, not DistributedDataParallel; the hook "
                                f"works with DDP only (not FSDP or DeepSpeed)")
            log.info("TwoWayCompressionCallback: one process, no DDP: nothing to communicate")
            return
        if self.save_state and state.global_step > 0:
            self._load(os.path.join(args.output_dir, f"checkpoint-{state.global_step}"))
        if ddp is not self._hooked:  # a second train() on the same wrapper keeps its hook
            ddp.register_comm_hook(self.state, two_way_compression_hook)
            self._hooked = ddp
            log.info("TwoWayCompressionCallback: registered %r", self.state)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        sched = kwargs.get("lr_scheduler")
        if self._hooked is not None and sched is not None:
            lr = sched.get_last_lr()[0]
            if lr > 0:
                self.state.lr = lr

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not (self.save_state and self._hooked is not None):
            return
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}", STATE_DIR)
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"rank{dist.get_rank()}.pt")
        torch.save(self.state.state_dict(), path + ".tmp")
        os.replace(path + ".tmp", path)

    def _load(self, checkpoint: str) -> None:
        path = os.path.join(checkpoint, STATE_DIR, f"rank{dist.get_rank()}.pt")
        if not os.path.exists(path):
            log.warning("TwoWayCompressionCallback: resuming at %s without %s: the hook's "
                        "residuals restart from zero", checkpoint, path)
            return
        self.state.load_state_dict(torch.load(path, weights_only=True))
        log.info("TwoWayCompressionCallback: hook state loaded from %s", path)
