"""A toy anchor detector whose forward ends in float post-processing (sigmoid, max, top-k, gather).

The network part runs on the NPU and ends at two DeQuantStubs; what follows them is float host-side code
that the quantization tools must leave alone. ``post_process=False`` (or :meth:`head_only`) gives the same
network without it, so the profiler can compare the two.
"""

from __future__ import annotations

import torch
from torch import nn

from quantlens.sites.stubs import DeQuantStub, QuantStub

__all__ = ["DetectorWithPostProcess"]


class DetectorWithPostProcess(nn.Module):
    """Input ``[B, 3, 16, 16]`` float. One anchor per cell of a 4x4 feature map: ``A = 16`` anchors.

    Raw head outputs: class logits ``[B, A, C]`` (``C = num_classes``) and box offsets ``[B, A, 4]``, each
    behind a DeQuantStub. With ``post_process=True`` (default) forward returns
    ``{"scores": [B, k] float (descending), "boxes": [B, k, 4] float, "labels": [B, k] int64}`` for the
    ``k = top_k`` best anchors by their best class probability; with ``post_process=False`` it returns the raw
    ``(logits, boxes)`` tuple.
    """

    def __init__(self, num_classes: int = 3, top_k: int = 5, post_process: bool = True) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.top_k = top_k
        self.post_process = post_process
        self.quant = QuantStub()
        # Two stride-2 convs: 16x16 -> 8x8 -> 4x4, i.e. 16 anchors for a 16x16 input.
        self.conv1 = nn.Conv2d(3, 16, 3, stride=2, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(16, 32, 3, stride=2, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(32)
        self.relu2 = nn.ReLU()
        self.cls_conv = nn.Conv2d(32, num_classes, 1)
        self.box_conv = nn.Conv2d(32, 4, 1)
        self.dequant_logits = DeQuantStub()
        self.dequant_boxes = DeQuantStub()

    def head(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The network part: ``(logits [B, A, C], boxes [B, A, 4])``, already through the DeQuantStubs."""
        x = self.quant(x)
        x = self.relu1(self.bn1(self.conv1(x)))
        x = self.relu2(self.bn2(self.conv2(x)))
        # [B, C, H, W] -> [B, C, A] -> [B, A, C]: anchors in row-major cell order.
        logits = self.cls_conv(x).flatten(2).permute(0, 2, 1)
        boxes = self.box_conv(x).flatten(2).permute(0, 2, 1)
        return self.dequant_logits(logits), self.dequant_boxes(boxes)

    def forward(self, x: torch.Tensor):
        logits, boxes = self.head(x)
        if not self.post_process:
            return logits, boxes
        # Float post-processing after the NPU boundary.
        probs = torch.sigmoid(logits)
        best, labels = probs.max(dim=-1)  # [B, A] each; labels are int64 class ids
        k = min(self.top_k, best.shape[1])
        scores, idx = torch.topk(best, k, dim=1)  # sorted=True: descending scores
        top_boxes = torch.gather(boxes, 1, idx.unsqueeze(-1).expand(-1, -1, boxes.shape[-1]))
        top_labels = torch.gather(labels, 1, idx)
        return {"scores": scores, "boxes": top_boxes, "labels": top_labels}

    def head_only(self) -> "DetectorWithPostProcess":
        """An independent copy with the same weights (and BN stats) and ``post_process=False``, in the same
        train/eval mode."""
        copy = DetectorWithPostProcess(num_classes=self.num_classes, top_k=self.top_k, post_process=False)
        copy.load_state_dict(self.state_dict())
        return copy.train(self.training)
