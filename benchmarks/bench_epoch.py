"""Wall time of one CIFAR-sized training epoch (50,000 images) of one model.

Uses the real input pipeline (uint8 images on the device, batch augmentation,
normalisation) and the real optimizer, on random images so that it runs on a
machine without the dataset. The GPU target of the project: one QSV epoch in
≤ 20 s on an H100/H200-class GPU.

    python benchmarks/bench_epoch.py --device cuda --batch-size 256 --amp bf16
    python benchmarks/bench_epoch.py --images 2048            # a short CPU check
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info, resolve_device, sync, write_json  # noqa: E402

from qsv_pyg.data import BatchAugment, DeviceLoader, ImageDataset  # noqa: E402
from qsv_pyg.models import build_model  # noqa: E402
from qsv_pyg.training.optim import build_optimizer  # noqa: E402

AMP = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qsv")
    parser.add_argument("--images", type=int, default=50_000)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--amp", default="none", choices=list(AMP))
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--out", default="benchmarks/out/bench_epoch.json")
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    if args.amp != "none" and device.type != "cuda":
        parser.error("--amp needs a CUDA device")

    gen = torch.Generator().manual_seed(0)
    data = ImageDataset(torch.randint(0, 256, (args.images, 3, 32, 32), dtype=torch.uint8,
                                      generator=gen),
                        torch.randint(0, 10, (args.images,), generator=gen),
                        [str(i) for i in range(10)])
    loader = DeviceLoader(data, args.batch_size, augment=BatchAugment.for_dataset("cifar10", True),
                          device=device, shuffle=True, seed=0, drop_last=True)
    torch.manual_seed(0)
    model = build_model(args.model, num_classes=10).to(device)
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.05)
    run_model = torch.compile(model) if args.compile else model
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")

    def epoch(index: int) -> float:
        sync(device)
        t0 = time.perf_counter()
        for images, labels in loader.epoch(index):
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=AMP[args.amp], enabled=AMP[args.amp] is not None):
                loss = F.cross_entropy(run_model(images).float(), labels) + model.auxiliary_loss()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        sync(device)
        return time.perf_counter() - t0

    # A short warm-up pass (allocator, cuDNN/compile) on a slice, then the timed epoch.
    warm = DeviceLoader(ImageDataset(data.images[: 4 * args.batch_size],
                                     data.labels[: 4 * args.batch_size], data.classes),
                        args.batch_size, augment=BatchAugment.for_dataset("cifar10", True),
                        device=device, shuffle=True, seed=1, drop_last=True)
    loader, timed = warm, loader
    epoch(0)
    loader = timed
    seconds = epoch(0)
    res = {"model": args.model, "images": len(loader) * args.batch_size,
           "epoch_seconds": seconds, "images_per_s": len(loader) * args.batch_size / seconds,
           "epoch_seconds_50k": seconds * 50_000 / (len(loader) * args.batch_size)}
    print(f"{args.model}: {res['images']} images in {seconds:.2f} s "
          f"({res['images_per_s']:.0f} img/s; a 50k-image epoch = {res['epoch_seconds_50k']:.1f} s)"
          f" on {device}, batch {args.batch_size}, amp {args.amp}")
    payload = {"args": vars(args), "machine": machine_info(device), "result": res}
    write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
