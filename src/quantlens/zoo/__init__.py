"""A small bundled model zoo for tests, the demo and the profiler.

Each entry is a tiny eager PyTorch model (a forward takes a few ms on CPU) with its deployment boundaries
marked by :class:`~quantlens.sites.stubs.QuantStub` / :class:`~quantlens.sites.stubs.DeQuantStub`,
and each exercises a different quantization feature (see ``docs/zoo.md``). Everything is deterministic:
models are built under a fixed seed, example inputs and calibration batches come from seeded generators, and
the digits CNN ships trained weights.

    >>> from quantlens import zoo
    >>> model = zoo.get_model("tiny_resnet")
    >>> out = model(*zoo.example_inputs("tiny_resnet", batch_size=2))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from quantlens.errors import QuantLensError
from quantlens.zoo.multitask import MultiTaskNet
from quantlens.zoo.postprocess import DetectorWithPostProcess
from quantlens.zoo.resnet import TinyResNet
from quantlens.zoo.transformer import TinyTransformerEncoder

__all__ = [
    "ZooEntry",
    "ZOO",
    "list_models",
    "get_model",
    "example_inputs",
    "sample_batches",
    "DigitsCNN",
    "DigitsData",
    "digits_cnn",
    "evaluate_accuracy",
    "load_digits_data",
    "train_digits_cnn",
    "TinyResNet",
    "TinyTransformerEncoder",
    "MultiTaskNet",
    "DetectorWithPostProcess",
]


# The digits names are imported lazily (PEP 562): importing quantlens.zoo.digits here would make
# `python -m quantlens.zoo.digits --retrain` execute a module that is already in sys.modules (runpy warns).
_DIGITS_EXPORTS = (
    "DigitsCNN",
    "DigitsData",
    "digits_cnn",
    "evaluate_accuracy",
    "load_digits_data",
    "train_digits_cnn",
)


def __getattr__(name: str):
    if name in _DIGITS_EXPORTS:
        from quantlens.zoo import digits

        return getattr(digits, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def _digits():
    from quantlens.zoo import digits

    return digits


@dataclass(frozen=True)
class ZooEntry:
    """One zoo model.

    ``build()`` returns a fresh model in eval mode (identical weights on every call).
    ``example_inputs(batch_size)`` returns the tuple of positional arguments for ``model(*args)``
    (identical on every call for a given batch size).
    """

    name: str
    description: str
    build: Callable[[], nn.Module]
    example_inputs: Callable[[int], tuple]


# --------------------------------------------------------------------------------------------------------------
# Seeded input generation. Each model has its own base seed; example inputs use the base seed and calibration
# batch i uses base + 1 + i, so the two never coincide. BN warm-up (below) uses base + _WARMUP_OFFSET.

_BASE_SEEDS = {
    "digits_cnn": 1000,
    "tiny_resnet": 2000,
    "tiny_transformer": 3000,
    "multitask": 4000,
    "detector_postprocess": 5000,
}
_WARMUP_OFFSET = 500
_TRANSFORMER_KW = dict(vocab_size=64, seq_len=16)


def _image(gen: torch.Generator, batch_size: int) -> torch.Tensor:
    # Uniform in [-1, 1): the same symmetric range the digits data uses, a natural fit for a fixed 1/128 scale.
    return torch.rand(batch_size, 3, 16, 16, generator=gen) * 2.0 - 1.0


def _random_inputs(name: str, batch_size: int, seed: int) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    if name in ("tiny_resnet", "detector_postprocess"):
        return (_image(gen, batch_size),)
    if name == "tiny_transformer":
        ids = torch.randint(
            0, _TRANSFORMER_KW["vocab_size"], (batch_size, _TRANSFORMER_KW["seq_len"]), generator=gen
        )
        return (ids,)
    if name == "multitask":
        image = _image(gen, batch_size)
        meta = torch.randn(batch_size, 8, generator=gen)
        return ({"image": image, "meta": meta}, ["cls", "reg"])
    raise AssertionError(f"no random input recipe for {name!r}")  # pragma: no cover - internal table


def _digits_rows(x: torch.Tensor, start: int, batch_size: int) -> torch.Tensor:
    # Wrap around so any batch size works, even one larger than the split.
    idx = torch.arange(start, start + batch_size) % x.shape[0]
    return x[idx]


def _check_batch_size(batch_size: int) -> None:
    if not isinstance(batch_size, int) or batch_size < 1:
        raise QuantLensError(f"batch_size must be a positive int, got {batch_size!r}.")


def _digits_example_inputs(batch_size: int) -> tuple:
    # Real test images rather than noise: the example output then means something (a digit prediction).
    _check_batch_size(batch_size)
    return (_digits_rows(_digits().load_digits_data().x_test, 0, batch_size),)


def _example_inputs_for(name: str) -> Callable[[int], tuple]:
    def make(batch_size: int) -> tuple:
        _check_batch_size(batch_size)
        return _random_inputs(name, batch_size, _BASE_SEEDS[name])

    make.__name__ = f"example_inputs_{name}"
    return make


# --------------------------------------------------------------------------------------------------------------
# Deterministic builds of the randomly initialised models.


@torch.no_grad()
def _make_norms_nontrivial(model: nn.Module, name: str) -> None:
    """Give norm layers realistic, non-identity parameters and statistics.

    Freshly initialised BatchNorm is the identity (mean 0, var 1, weight 1, bias 0) and LayerNorm has unit
    affine, so BN folding or per-channel scales would be tested against a no-op. Instead: random affine
    parameters, then BN running stats measured on a few seeded batches (cumulative average), as training would
    leave them.
    """
    gen = torch.Generator().manual_seed(_BASE_SEEDS[name] + _WARMUP_OFFSET)
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for m in model.modules():
        if isinstance(m, (nn.modules.batchnorm._BatchNorm, nn.LayerNorm)) and m.weight is not None:
            m.weight.copy_(torch.rand(m.weight.shape, generator=gen) + 0.5)  # U[0.5, 1.5)
            m.bias.copy_(torch.randn(m.bias.shape, generator=gen) * 0.1)
    if not bns:
        return
    saved_momentum = [m.momentum for m in bns]
    for m in bns:
        m.reset_running_stats()
        m.momentum = None  # cumulative moving average: the stats are the plain mean over the warm-up batches
    model.train()
    for i in range(4):
        model(*_random_inputs(name, 16, _BASE_SEEDS[name] + _WARMUP_OFFSET + 1 + i))
    for m, momentum in zip(bns, saved_momentum):
        m.momentum = momentum
    model.eval()


def _seeded_builder(name: str, factory: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        # fork_rng: building a zoo model must not disturb the caller's global RNG stream.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = factory()
            _make_norms_nontrivial(model, name)
        return model.eval()

    build.__name__ = f"build_{name}"
    return build


ZOO: dict[str, ZooEntry] = {
    "digits_cnn": ZooEntry(
        name="digits_cnn",
        description="Trained conv-BN-ReLU CNN on sklearn's 8x8 digits (~99% test accuracy); input [B,1,8,8].",
        build=lambda: _digits().digits_cnn(pretrained=True),
        example_inputs=_digits_example_inputs,
    ),
    "tiny_resnet": ZooEntry(
        name="tiny_resnet",
        description="Two residual blocks (one with strided downsample shortcut) and a channel concat; "
        "input [B,3,16,16].",
        build=_seeded_builder("tiny_resnet", lambda: TinyResNet(num_classes=10)),
        example_inputs=_example_inputs_for("tiny_resnet"),
    ),
    "tiny_transformer": ZooEntry(
        name="tiny_transformer",
        description="One pre-norm encoder layer: embeddings, LayerNorm, hand-written attention "
        "(matmul/softmax), GELU MLP; input token ids [B,16] int64.",
        build=_seeded_builder("tiny_transformer", lambda: TinyTransformerEncoder(**_TRANSFORMER_KW)),
        example_inputs=_example_inputs_for("tiny_transformer"),
    ),
    "multitask": ZooEntry(
        name="multitask",
        description="Dict input (image [B,3,16,16], meta [B,8]), two QuantStubs, heads 'cls'/'reg' chosen "
        "by Python control flow; dict output.",
        build=_seeded_builder("multitask", MultiTaskNet),
        example_inputs=_example_inputs_for("multitask"),
    ),
    "detector_postprocess": ZooEntry(
        name="detector_postprocess",
        description="Anchor detector (16 anchors, 3 classes) followed by float sigmoid/max/topk/gather "
        "post-processing; input [B,3,16,16].",
        build=_seeded_builder("detector_postprocess", DetectorWithPostProcess),
        example_inputs=_example_inputs_for("detector_postprocess"),
    ),
}


def _entry(name: str) -> ZooEntry:
    try:
        return ZOO[name]
    except (KeyError, TypeError):
        raise QuantLensError(f"Unknown zoo model {name!r}. Known models: {list_models()}.") from None


def list_models() -> list[str]:
    """Names of the zoo models, in registry order."""
    return list(ZOO)


def get_model(name: str) -> nn.Module:
    """A fresh instance of zoo model ``name`` in eval mode; the same weights on every call.

    ``digits_cnn`` carries its trained weights; the others are random but deterministic (seed 0, with
    non-trivial norm-layer parameters and BN statistics).
    """
    return _entry(name).build().eval()


def example_inputs(name: str, batch_size: int = 2) -> tuple:
    """Positional arguments for ``get_model(name)(*args)``; deterministic for a given ``batch_size``."""
    return _entry(name).example_inputs(batch_size)


def sample_batches(name: str, num_batches: int, batch_size: int) -> list[tuple]:
    """``num_batches`` distinct, deterministic argument tuples for calibration loops.

    Each tuple is used like :func:`example_inputs`'s: ``model(*batch)``. ``digits_cnn`` gets consecutive slices
    of the real training images (wrapping around after 1437 samples); the other models get seeded random data
    that differs from :func:`example_inputs` and between batches.
    """
    entry = _entry(name)
    _check_batch_size(batch_size)
    if not isinstance(num_batches, int) or num_batches < 0:
        raise QuantLensError(f"num_batches must be a non-negative int, got {num_batches!r}.")
    if entry.name == "digits_cnn":
        x_train = _digits().load_digits_data().x_train
        return [(_digits_rows(x_train, i * batch_size, batch_size),) for i in range(num_batches)]
    base = _BASE_SEEDS[entry.name]
    return [_random_inputs(entry.name, batch_size, base + 1 + i) for i in range(num_batches)]
