"""The models, batches and losses the benchmarks train. Weights come from torch's global seed at
the call, as in a training script; a builder that returns a batch draws it right after the model.
Builders of whole workloads return ``(model, (x, y), loss)``, ``loss(output, y)`` a scalar."""

import torch
from torch import nn


def square_loss(out, _):
    return out.square().mean()


def cross_entropy(out, y):
    return nn.functional.cross_entropy(out, y)


def token_loss(logits, targets):
    """A language model's loss over every position, in float32 (logits may be bf16 under autocast)."""
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def stack(width, depth, act=nn.ReLU, norm=False, bias=True, head=None):
    """``depth`` x (Linear(width, width)[, LayerNorm][, act]) [+ Linear(width, head)]."""
    layers = []
    for _ in range(depth):
        layers.append(nn.Linear(width, width, bias=bias))
        layers += [nn.LayerNorm(width)] if norm else []
        layers += [act()] if act else []
    return nn.Sequential(*layers, *([nn.Linear(width, head)] if head else []))


class Block(nn.Module):
    """Residual and normalised, so a deep narrow stack keeps its gradients clear of denormal floats
    (a plain deep tanh MLP underflows and would time the CPU's denormal path instead)."""

    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + self.fc(torch.relu(self.norm(x)))


def encoder(d_model=128, heads=4, ff=512, layers=4, dropout=0.0):
    layer = nn.TransformerEncoderLayer(d_model, heads, ff, dropout=dropout, batch_first=True)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


def transformer():
    """4 x TransformerEncoderLayer(128, 4, 512), batch 8 x 32 tokens."""
    return encoder(), (torch.randn(8, 32, 128), None), square_loss


def many_small():
    """100 residual blocks of width 64, batch 32: hundreds of small tensors."""
    return nn.Sequential(*[Block(64) for _ in range(100)]), (torch.randn(32, 64), None), square_loss


def linear_relu(width, depth, batch):
    """``depth`` x (Linear(width, width), ReLU), batch ``batch``: few large tensors."""
    return stack(width, depth), (torch.randn(batch, width), None), square_loss


# -- MobileNetV2, built here (no torchvision, no download) ----------------------------------------
def _divisible(v, d=8):
    """MobileNetV2's channel rounding: to a multiple of 8, never below 90% of ``v``."""
    n = max(d, int(v + d / 2) // d * d)
    return n + d if n < 0.9 * v else n


class InvertedResidual(nn.Module):
    """Expand (1x1), depthwise 3x3, project (1x1); a skip connection where shapes allow."""

    def __init__(self, cin, cout, stride, expand):
        super().__init__()
        hidden = cin * expand
        layers = []
        if expand != 1:
            layers += [nn.Conv2d(cin, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6(inplace=True)]
        layers += [nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False),
                   nn.BatchNorm2d(hidden), nn.ReLU6(inplace=True),
                   nn.Conv2d(hidden, cout, 1, bias=False), nn.BatchNorm2d(cout)]
        self.conv = nn.Sequential(*layers)
        self.skip = stride == 1 and cin == cout

    def forward(self, x):
        return x + self.conv(x) if self.skip else self.conv(x)


# (expansion, channels, blocks, stride) of MobileNetV2 (Sandler et al., 2018, table 2).
MOBILENET_V2 = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
                (6, 160, 3, 2), (6, 320, 1, 1)]


def mobilenet_v2(width=0.35, classes=100):
    """MobileNetV2 at ``width``; 158 parameter tensors at any width."""
    cin, last = _divisible(32 * width), _divisible(1280 * max(1.0, width))
    layers = [nn.Sequential(nn.Conv2d(3, cin, 3, 2, 1, bias=False), nn.BatchNorm2d(cin), nn.ReLU6(inplace=True))]
    for t, c, n, s in MOBILENET_V2:
        cout = _divisible(c * width)
        for i in range(n):
            layers.append(InvertedResidual(cin, cout, s if i == 0 else 1, t))
            cin = cout
    layers.append(nn.Sequential(nn.Conv2d(cin, last, 1, bias=False), nn.BatchNorm2d(last), nn.ReLU6(inplace=True)))
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(last, classes))
