"""Which device a worker runs on: CANVASQ_DEVICE resolved against what CUDA shows (`resolve_device`),
and that device made current before the model loads (`bind_cuda_device`)."""

from __future__ import annotations

import os


def resolve_device(setting: str, visible: int | None = None, current: int | None = None) -> str:
    """CANVASQ_DEVICE -> "cpu" or "cuda:N". `auto` and `cuda` take the current CUDA device (index 0 of
    what CUDA_VISIBLE_DEVICES shows, unless something selected another); `cuda:N` must be visible.
    `visible` / `current` default to what torch reports (given explicitly by the CPU tests)."""
    if setting == "cpu":
        return "cpu"
    if visible is None or current is None:
        import torch

        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        current = torch.cuda.current_device() if visible else 0
    if setting == "auto" and not visible:
        return "cpu"
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    where = "CUDA_VISIBLE_DEVICES unset" if cvd is None else f"CUDA_VISIBLE_DEVICES={cvd!r}"
    if setting in ("auto", "cuda"):
        if not visible:
            raise ValueError(f"CANVASQ_DEVICE=cuda: no CUDA device is visible ({where}); use auto or cpu")
        return f"cuda:{current}"
    head, _, index = setting.partition(":")
    if head != "cuda" or not index.isdigit():
        raise ValueError(f"CANVASQ_DEVICE={setting!r}: expected auto, cpu, cuda or cuda:N")
    if int(index) >= visible:
        raise ValueError(
            f"CANVASQ_DEVICE={setting}: {visible} CUDA device(s) visible ({where}); "
            f"N counts the visible devices from 0"
        )
    return f"cuda:{int(index)}"


def bind_cuda_device(device: str) -> None:
    """Make `device` ("cuda" or "cuda:N") the current CUDA device. The kernels launch, and the decode
    graphs capture, on the current device's stream, so a worker pinned with CANVASQ_DEVICE=cuda:N
    (rather than CUDA_VISIBLE_DEVICES) must select N before it loads the model. `set_device` needs an
    index: a bare "cuda" keeps the current device."""
    if device.startswith("cuda"):
        import torch

        _, _, index = device.partition(":")
        torch.cuda.set_device(torch.device("cuda", int(index) if index else torch.cuda.current_device()))
