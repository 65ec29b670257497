"""Does torch's DataParallel accept the same GPU twice (device_ids=[0, 0])? One real scatter/gather on one GPU if so.

    python bench/dp_repeat_probe.py          # prints what happened; exit 0 either way, 2 without CUDA

Lightning refuses repeated device ids before DataParallel sees them ("Device ID's (GPU) must be unique"), so this
asks torch directly: one forward and backward of a small ResNet, and whether the result matches a single replica.
"""

import sys

import torch
import torch.nn.functional as F
from torchvision.models import resnet18


def main() -> int:
    if not torch.cuda.is_available():
        print("dp_repeat_probe: no CUDA device; nothing to try")
        return 2
    torch.manual_seed(0)
    network = resnet18(num_classes=10).cuda().eval()  # eval: BatchNorm then does not depend on the split
    images, targets = torch.randn(16, 3, 64, 64, device="cuda"), torch.randint(10, (16,), device="cuda")
    reference = network(images)
    F.cross_entropy(reference, targets).backward()
    grad = network.fc.weight.grad.clone()
    network.zero_grad()
    try:
        parallel = torch.nn.DataParallel(network, device_ids=[0, 0])
        output = parallel(images)
        F.cross_entropy(output, targets).backward()
    except Exception as error:  # the answer we are after, whatever torch raises
        print(f"dp_repeat_probe: torch {torch.__version__} refused device_ids=[0, 0]: {type(error).__name__}: {error}")
        return 0
    same_out = torch.allclose(output, reference, rtol=1e-4, atol=1e-5)
    same_grad = torch.allclose(network.fc.weight.grad, grad, rtol=1e-4, atol=1e-5)
    print(f"dp_repeat_probe: torch {torch.__version__} ran device_ids=[0, 0]: outputs match one replica: {same_out}, "
          f"fc gradients match: {same_grad}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
