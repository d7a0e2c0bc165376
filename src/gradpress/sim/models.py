"""Exact parameter tensors and per-op forward FLOPs of ResNet50, VGG16 and BERT-base.

The simulator needs, for every parameter tensor, its size (it fixes the bytes on the wire) and
when backward produces its gradient (it fixes how much communication overlaps with compute). A
model is therefore a sequence of :class:`Op` in forward order; each op has its forward
multiply-accumulates per sample (MACs) and the parameter tensors whose gradients are final once
backward has passed it. Everything is generated from the architecture definitions (no
torchvision, no transformers):

1. ResNet50 v1.5 as in torchvision ``resnet50`` (He et al., "Deep Residual Learning for Image
   Recognition", CVPR 2016; stride 2 in the 3x3 conv of the bottleneck), 224x224 input:
   conv1 + bn1, four stages of [3, 4, 6, 3] bottlenecks (planes 64, 128, 256, 512, expansion 4,
   a 1x1 projection + BN on each stage's first block), fc 2048 -> 1000. Parameters: 25,557,032
   (BN running statistics are buffers, not parameters); 4.09 GMACs per image.
2. VGG16 (configuration "D" of Simonyan and Zisserman, "Very Deep Convolutional Networks for
   Large-Scale Image Recognition", ICLR 2015) as in torchvision ``vgg16`` (no BN): thirteen 3x3
   convs with biases, classifier 25088 -> 4096 -> 4096 -> 1000. Parameters: 138,357,544;
   15.47 GMACs per image.
3. BERT-base (Devlin et al., NAACL 2019) in the pre-training form of Hugging Face
   ``BertForPreTraining`` (bert-base-uncased config: vocabulary 30522, 512 positions, 2 token
   types, hidden 768, 12 layers, 12 heads, FFN 3072): embeddings + LayerNorm, 12 encoder layers,
   pooler, MLM head (transform dense + LayerNorm + decoder bias; the decoder weight is tied to the
   word embeddings) and the NSP classifier. Parameters: 110,106,428; the encoder alone
   (``BertModel``: embeddings, layers, pooler) has 109,482,240.

FLOP conventions: a conv costs k*k*c_in*c_out*H_out*W_out MACs, a linear layer in*out per
position. BN, LayerNorm, bias and element-wise work is folded into the owning op (it is small).
BERT's attention score and context products (2*L*L*hidden per layer) have no parameters and are
separate ops with no tensors. The MLM decoder (hidden x vocab) runs on all L positions, as in
``BertForPreTraining``; it owns the decoder bias, while the tied word-embedding gradient is only
final after the embedding lookup, at the very end of backward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Tensor", "Op", "Model", "MODELS", "get_model", "resnet50", "vgg16", "bert_base"]


@dataclass(frozen=True)
class Tensor:
    """One parameter tensor: its name (as in the PyTorch module) and number of elements."""

    name: str
    numel: int


@dataclass(frozen=True)
class Op:
    """One forward op: MACs per sample and the parameter tensors it owns (may be none)."""

    name: str
    macs: float
    tensors: tuple[Tensor, ...] = ()


@dataclass(frozen=True)
class Model:
    """A model as ops in forward order, with the compute defaults of its paper setting.

    ``batch_per_gpu`` and ``samples_per_s`` (one V100, mixed precision) give the default
    compute time per iteration; ``source`` says where these numbers come from.
    """

    name: str
    ops: tuple[Op, ...]
    sample: str
    batch_per_gpu: int
    samples_per_s: float
    source: str

    @property
    def tensors(self) -> list[Tensor]:
        """All parameter tensors in forward (declaration) order."""
        return [t for op in self.ops for t in op.tensors]

    @property
    def num_params(self) -> int:
        return sum(t.numel for t in self.tensors)

    @property
    def macs(self) -> float:
        """Forward multiply-accumulates per sample."""
        return sum(op.macs for op in self.ops)

    @property
    def default_compute_ms(self) -> float:
        """Forward + backward time of one iteration on one GPU at the default batch."""
        return 1000.0 * self.batch_per_gpu / self.samples_per_s


def _conv(name: str, cin: int, cout: int, k: int, hw_out: int, *, bias: bool = False,
          bn: str | None = None) -> Op:
    """A k x k conv (optionally with bias) and the BN that follows it (named ``bn``)."""
    ts = [Tensor(f"{name}.weight", k * k * cin * cout)]
    if bias:
        ts.append(Tensor(f"{name}.bias", cout))
    if bn:
        ts += [Tensor(f"{bn}.weight", cout), Tensor(f"{bn}.bias", cout)]
    return Op(name, float(k * k * cin * cout * hw_out * hw_out), tuple(ts))


def _linear(name: str, fin: int, fout: int, positions: int = 1, *, bias: bool = True) -> Op:
    ts = [Tensor(f"{name}.weight", fin * fout)] + ([Tensor(f"{name}.bias", fout)] if bias else [])
    return Op(name, float(fin * fout * positions), tuple(ts))


def resnet50() -> Model:
    """ResNet50 v1.5 (torchvision layout and names), 224x224 input; see the module docstring."""
    ops = [_conv("conv1", 3, 64, 7, 112, bn="bn1")]  # step 1: stem, then 3x3/2 max pool -> 56
    inplanes, hw = 64, 56
    for stage, (planes, blocks) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3)), start=1):
        for b in range(blocks):  # step 2: bottlenecks; the first of stages 2-4 has stride 2
            stride = 2 if (b == 0 and stage > 1) else 1
            out_hw = hw // stride
            p = f"layer{stage}.{b}"
            ops += [_conv(f"{p}.conv1", inplanes, planes, 1, hw, bn=f"{p}.bn1"),
                    _conv(f"{p}.conv2", planes, planes, 3, out_hw, bn=f"{p}.bn2"),
                    _conv(f"{p}.conv3", planes, planes * 4, 1, out_hw, bn=f"{p}.bn3")]
            if b == 0:  # projection shortcut: 1x1 conv + BN (torchvision: downsample.0/.1)
                ops.append(_conv(f"{p}.downsample.0", inplanes, planes * 4, 1, out_hw,
                                 bn=f"{p}.downsample.1"))
            inplanes, hw = planes * 4, out_hw
    ops.append(_linear("fc", 2048, 1000))  # step 3: global average pool, classifier
    return Model("resnet50", tuple(ops), "images", batch_per_gpu=64, samples_per_s=1200.0,
                 source="1,200 images/s: NVIDIA DeepLearningExamples PyTorch ResNet50 v1.5, "
                        "one V100 16GB, mixed precision (FP32: 367); batch 64/GPU = the paper's "
                        "4k batch over 64 GPUs (assumed)")


_VGG16_CFG: tuple[int | str, ...] = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512,
                                     512, "M", 512, 512, 512, "M")


def vgg16() -> Model:
    """VGG16 (torchvision ``vgg16`` layout and names, no BN), 224x224 input."""
    ops: list[Op] = []
    cin, hw = 3, 224
    for idx, v in enumerate(_VGG16_CFG):  # step 1: features; index counts conv, ReLU and pool
        if v == "M":
            hw //= 2
        else:  # torchvision's module index: each conv is followed by a ReLU, each "M" a pool
            mod = sum(1 if c == "M" else 2 for c in _VGG16_CFG[:idx])
            ops.append(_conv(f"features.{mod}", cin, int(v), 3, hw, bias=True))
            cin = int(v)
    # step 2: classifier (Linear, ReLU, Dropout) x 2 + Linear -> indices 0, 3, 6
    ops += [_linear("classifier.0", 512 * 7 * 7, 4096), _linear("classifier.3", 4096, 4096),
            _linear("classifier.6", 4096, 1000)]
    return Model("vgg16", tuple(ops), "images", batch_per_gpu=64, samples_per_s=400.0,
                 source="estimate: 400 images/s = V100 fp16 inference (PaddlePaddle float16 "
                        "benchmark: 64 images in 60.2 ms) / 2.5, the inference/training ratio "
                        "of NVIDIA's ResNet50 figures (2,984 / 1,200); batch 64/GPU (assumed, "
                        "as ResNet50)")


def _layer_norm(name: str, hidden: int) -> tuple[Tensor, Tensor]:
    return Tensor(f"{name}.weight", hidden), Tensor(f"{name}.bias", hidden)


def _bert_ops(hidden: int, layers: int, ffn: int, seq_len: int) -> tuple[Op, ...]:
    """Ops of ``BertForPreTraining`` (vocabulary 30522, 512 positions, 2 token types)."""
    vocab, positions, types, h, L = 30522, 512, 2, hidden, seq_len
    emb = "bert.embeddings"
    # step 1: embeddings (lookups: no MACs; the adds and LayerNorm are a few per element)
    ops = [Op(emb, float(3 * L * h), (Tensor(f"{emb}.word_embeddings.weight", vocab * h),
                                      Tensor(f"{emb}.position_embeddings.weight", positions * h),
                                      Tensor(f"{emb}.token_type_embeddings.weight", types * h),
                                      *_layer_norm(f"{emb}.LayerNorm", h)))]
    for i in range(layers):  # step 2: encoder layers
        p = f"bert.encoder.layer.{i}"
        ops += [_linear(f"{p}.attention.self.{m}", h, h, L) for m in ("query", "key", "value")]
        ops.append(Op(f"{p}.attention.scores", float(2 * L * L * h)))  # QK^T and AV
        out = _linear(f"{p}.attention.output.dense", h, h, L)
        ops.append(Op(out.name, out.macs, out.tensors + _layer_norm(
            f"{p}.attention.output.LayerNorm", h)))
        ops.append(_linear(f"{p}.intermediate.dense", h, ffn, L))
        out = _linear(f"{p}.output.dense", ffn, h, L)
        ops.append(Op(out.name, out.macs, out.tensors + _layer_norm(f"{p}.output.LayerNorm", h)))
    ops.append(_linear("bert.pooler.dense", h, h))  # step 3: pooler on the [CLS] position
    tr = _linear("cls.predictions.transform.dense", h, h, L)  # step 4: MLM head
    ops.append(Op(tr.name, tr.macs, tr.tensors + _layer_norm("cls.predictions.transform.LayerNorm",
                                                             h)))
    ops.append(Op("cls.predictions.decoder", float(h * vocab * L),
                  (Tensor("cls.predictions.bias", vocab),)))
    ops.append(_linear("cls.seq_relationship", h, 2))  # step 5: next-sentence classifier
    return tuple(ops)


#: BERT-large pre-training on one V100 (32 GB), mixed precision, sequence length 128, batch 64:
#: 171.52 sequences/s (NVIDIA DeepLearningExamples, PyTorch BERT README, pytorch:19.07 NGC).
_BERT_LARGE_V100_SEQ_PER_S = 171.52


def bert_base(seq_len: int = 128) -> Model:
    """BERT-base pre-training model (``BertForPreTraining`` names), sequences of ``seq_len``.

    Default throughput: the published BERT-large V100 figure scaled by the ratio of the two
    models' forward MACs (as generated here: 3.05 at length 128), about 520 sequences/s.
    """
    ops = _bert_ops(768, 12, 3072, seq_len)
    large = sum(op.macs for op in _bert_ops(1024, 24, 4096, seq_len))
    rate = _BERT_LARGE_V100_SEQ_PER_S * large / sum(op.macs for op in ops)
    return Model("bert-base", ops, "sequences", batch_per_gpu=32, samples_per_s=float(round(rate)),
                 source=f"estimate: {round(rate)} sequences/s at length {seq_len} = NVIDIA's "
                        f"BERT-large V100 mixed-precision pre-training figure "
                        f"({_BERT_LARGE_V100_SEQ_PER_S} seq/s) x the MAC ratio "
                        f"{large / sum(op.macs for op in ops):.2f}; batch 32/GPU = the paper's "
                        "2k batch over 64 GPUs (assumed)")


#: model name -> constructor (all default to the paper's input sizes).
MODELS: dict[str, Callable[[], Model]] = {
    "resnet50": resnet50, "vgg16": vgg16, "bert-base": bert_base,
}


def get_model(name: str) -> Model:
    """The model called ``name``; ValueError listing the valid names otherwise."""
    key = str(name).strip().lower() if isinstance(name, str) else name
    if key not in MODELS:
        raise ValueError(f"unknown model {name!r}; valid models: {', '.join(MODELS)}")
    return MODELS[key]()
