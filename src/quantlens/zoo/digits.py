"""A real, trained model on real data: a small CNN on scikit-learn's bundled 8x8 digits.

The digits set ships inside scikit-learn (no download), so tests, the demo and the profiler can measure the
accuracy a quantized model actually loses instead of comparing random tensors. The trained weights are cached
in ``weights/digits_cnn.safetensors``; ``python -m quantlens.zoo.digits --retrain`` rewrites them.
"""

from __future__ import annotations

import argparse
import functools
import importlib.resources
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from quantlens.errors import QuantLensError
from quantlens.sites.stubs import DeQuantStub, QuantStub

__all__ = [
    "DigitsData",
    "load_digits_data",
    "DigitsCNN",
    "train_digits_cnn",
    "evaluate_accuracy",
    "digits_cnn",
    "WEIGHTS_FILENAME",
]

WEIGHTS_FILENAME = "digits_cnn.safetensors"
NUM_TRAIN = 1437  # of 1797 samples; the remaining 360 are the test set
_SPLIT_SEED = 0


@dataclass
class DigitsData:
    """The digits split. Images are ``[N, 1, 8, 8]`` float32 in [-1, 1]; labels are ``[N]`` int64 in 0..9."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


@functools.lru_cache(maxsize=1)
def _raw_digits() -> tuple[torch.Tensor, torch.Tensor]:
    # Cached because sklearn parses a CSV on every call; callers get fresh tensors (see load_digits_data).
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise QuantLensError(
            "The digits zoo model needs scikit-learn for its bundled dataset. "
            "Install it with `pip install quantlens[zoo]` (or `pip install scikit-learn`)."
        ) from exc
    bunch = load_digits()
    images = torch.as_tensor(bunch.images, dtype=torch.float32)  # [1797, 8, 8], values 0..16
    labels = torch.as_tensor(bunch.target, dtype=torch.int64)
    return images, labels


def load_digits_data() -> DigitsData:
    """Load scikit-learn's 8x8 digits with a fixed, seeded train/test split (1437 train, 360 test).

    Pixels 0..16 map to ``x / 8 - 1``, i.e. symmetric about 0 in [-1, 1], which suits the march's symmetric
    (zero point 0) int8 input quantization.
    """
    images, labels = _raw_digits()
    x = (images / 8.0 - 1.0).unsqueeze(1).contiguous()  # new tensor: the cache is never handed out
    y = labels.clone()
    # A seeded permutation rather than sklearn's order: the raw file is grouped by writer, so a plain head/tail
    # split would test on unseen writers only. The split is fixed so accuracies are comparable across runs.
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(_SPLIT_SEED))
    train_idx, test_idx = perm[:NUM_TRAIN], perm[NUM_TRAIN:]
    return DigitsData(x_train=x[train_idx], y_train=y[train_idx], x_test=x[test_idx], y_test=y[test_idx])


class DigitsCNN(nn.Module):
    """Three conv-BN-ReLU blocks, a max pool, global average pool and a linear classifier for 8x8 digits.

    Input ``[B, 1, 8, 8]`` float in [-1, 1]; output ``[B, 10]`` logits. Each ReLU is its own module
    (``relu1``..``relu3``) so conv-BN-ReLU fusion and per-layer profiling see one module per op.
    """

    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(32)
        self.relu2 = nn.ReLU()
        self.pool = nn.MaxPool2d(2)
        self.conv3 = nn.Conv2d(32, 32, 3, padding=1)
        self.bn3 = nn.BatchNorm2d(32)
        self.relu3 = nn.ReLU()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(32, 10)
        self.dequant = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.quant(x)
        x = self.relu1(self.bn1(self.conv1(x)))
        x = self.relu2(self.bn2(self.conv2(x)))
        x = self.pool(x)
        x = self.relu3(self.bn3(self.conv3(x)))
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        x = self.fc(x)
        return self.dequant(x)


def train_digits_cnn(epochs: int = 30, seed: int = 0, verbose: bool = False) -> DigitsCNN:
    """Train a :class:`DigitsCNN` from scratch with Adam; deterministic for a given ``seed``.

    Takes a few seconds on one CPU core and reaches about 98-99% test accuracy. The global RNG state and the
    intra-op thread count are restored afterwards.
    """
    data = load_digits_data()
    # One thread: multi-threaded CPU kernels may reduce in a different order on machines with a different core
    # count, which would make the "deterministic" weights differ in the last bits between machines.
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = DigitsCNN()
            shuffle_gen = torch.Generator().manual_seed(seed)
            batch_size = 64
            steps_per_epoch = (data.x_train.shape[0] + batch_size - 1) // batch_size
            opt = torch.optim.Adam(model.parameters(), lr=3e-3, weight_decay=1e-4)
            # Cosine decay settles the weights (and BN running stats) at the end instead of on a noisy step.
            sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs * steps_per_epoch)
            loss_fn = nn.CrossEntropyLoss()
            for epoch in range(epochs):
                model.train()
                perm = torch.randperm(data.x_train.shape[0], generator=shuffle_gen)
                for start in range(0, perm.numel(), batch_size):
                    idx = perm[start : start + batch_size]
                    opt.zero_grad(set_to_none=True)
                    loss = loss_fn(model(data.x_train[idx]), data.y_train[idx])
                    loss.backward()
                    opt.step()
                    sched.step()
                if verbose:
                    acc = evaluate_accuracy(model, data.x_test, data.y_test)
                    print(f"epoch {epoch + 1:3d}/{epochs}  loss {loss.item():.4f}  test acc {acc:.2f}%")
    finally:
        torch.set_num_threads(prev_threads)
    return model.eval()


def evaluate_accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 256) -> float:
    """Top-1 accuracy of ``model`` on ``(x, y)`` in percent (a float in [0, 100]).

    Runs in eval mode without gradients; the model's previous train/eval mode is restored afterwards.
    """
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"x has {x.shape[0]} samples but y has {y.shape[0]}")
    if x.shape[0] == 0:
        raise ValueError("cannot compute accuracy on an empty dataset")
    was_training = model.training
    model.eval()
    correct = 0
    try:
        with torch.no_grad():
            for start in range(0, x.shape[0], batch_size):
                logits = model(x[start : start + batch_size])
                correct += int((logits.argmax(dim=-1) == y[start : start + batch_size]).sum())
    finally:
        model.train(was_training)
    return 100.0 * correct / x.shape[0]


def _weights_resource():
    return importlib.resources.files("quantlens.zoo").joinpath("weights", WEIGHTS_FILENAME)


def digits_cnn(pretrained: bool = True) -> DigitsCNN:
    """Build a :class:`DigitsCNN` in eval mode, with the bundled trained weights when ``pretrained``.

    The weights include the BatchNorm running statistics. Without ``pretrained`` the model is randomly
    initialised from the current global RNG.
    """
    if not pretrained:
        return DigitsCNN().eval()
    from safetensors.torch import load_file

    resource = _weights_resource()
    if not resource.is_file():
        raise QuantLensError(
            f"The pretrained digits CNN weights ({WEIGHTS_FILENAME}) are missing from the quantlens.zoo "
            "package. Regenerate them with `python -m quantlens.zoo.digits --retrain` "
            "(a few seconds on CPU), or use digits_cnn(pretrained=False) for random weights."
        )
    with importlib.resources.as_file(resource) as path:
        state = load_file(str(path))
    # The random init is overwritten by the weights; fork_rng keeps it from consuming the caller's RNG stream.
    with torch.random.fork_rng(devices=[]):
        model = DigitsCNN()
    model.load_state_dict(state)
    return model.eval()


def main(argv: list[str] | None = None) -> None:
    """``python -m quantlens.zoo.digits [--retrain]``: report the bundled model's accuracy, or retrain it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--retrain", action="store_true", help="train from scratch and rewrite the weights file")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    data = load_digits_data()
    if args.retrain:
        from safetensors.torch import save_file

        model = train_digits_cnn(epochs=args.epochs, seed=args.seed, verbose=True)
        # Written next to this source file: regenerating is a developer action on a source checkout.
        out = Path(__file__).resolve().parent / "weights" / WEIGHTS_FILENAME
        out.parent.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        save_file(state, str(out), metadata={"epochs": str(args.epochs), "seed": str(args.seed)})
        print(f"wrote {out} ({out.stat().st_size} bytes)")
    model = digits_cnn(pretrained=True)
    print(f"test accuracy: {evaluate_accuracy(model, data.x_test, data.y_test):.2f}%")


if __name__ == "__main__":
    main()
