r"""Data-parallel training of a small CNN on Fashion-MNIST with the BytePS API of dynamix_byteps.

    bpslaunch --num-workers 4 -- python examples/torch_fashion_mnist.py
    python examples/torch_fashion_mnist.py --limit-train 5000 --epochs 1      # one worker

    bpslaunch --num-workers 4 -- python examples/torch_fashion_mnist.py \
        --batch-size 32,48,80,96 --batch-schedule "100:64"      # per-worker batches
    bpslaunch -n 4 -- python examples/torch_fashion_mnist.py --batch-size 256 --warmup-steps 100   # large batches
    bpslaunch -n 4 --policy proportional -- python examples/torch_fashion_mnist.py \
        --time-budget 120 --eval-every 15 --output run.json     # accuracy against training time
    bpslaunch -n 2 --engine nccl -- python examples/torch_fashion_mnist.py --device cuda    # one GPU each

Porting a byteps.torch script means changing one import. ``DynamicBatchSampler`` gives each
worker its own batch size (changeable at any step with ``bps.set_batch_sizes``); gradients are
averaged weighted by batch size and the learning rate follows the global batch.
Data: Fashion-MNIST (MIT, Zalando), ``apt-get install dataset-fashion-mnist`` or ``--data-dir``.
"""
import argparse
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import dynamix_byteps.torch as bps
from dynamix_byteps.argtypes import int_in
from dynamix_byteps.assignment import add_batch_arguments, parse_batch_schedule, parse_batch_sizes
from dynamix_byteps.data import add_dataset_arguments, load_fashion_mnist
from dynamix_byteps.run_metrics import RunMetrics, add_run_arguments, stop_reason

MEAN, STD = 0.2860, 0.3530  # Fashion-MNIST training pixels, after scaling to [0, 1]
TEST_IMAGES = 10_000  # Fashion-MNIST's test set


class Net(nn.Module):
    """conv32-pool-conv64-pool-fc128-fc10 (421,642 parameters); ``--model cnn``."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.fc1 = nn.Linear(64 * 7 * 7, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers with an identity (or 1x1 strided) shortcut (He et al. 2016)."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet8(nn.Module):
    """ResNet-8 for 28x28 inputs: conv16, three basic blocks (16, 32, 64 channels), fc10 (77,754 parameters); ``--model resnet8``."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.blocks = nn.Sequential(BasicBlock(16, 16, 1), BasicBlock(16, 32, 2), BasicBlock(32, 64, 2))
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        return self.fc(F.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1).flatten(1))


MODELS = {"cnn": Net, "resnet8": ResNet8}


def to_tensors(images, labels):
    """uint8 (N, 28, 28) -> float (N, 1, 28, 28), normalised; int64 labels."""
    x = torch.from_numpy(images).unsqueeze(1).float().div_(255).sub_(MEAN).div_(STD)
    return x, torch.from_numpy(labels)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=2, help="epochs to train (with --time-budget: at most; default 2)")
    p.add_argument("--model", choices=sorted(MODELS), default="cnn")
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd",
                   help="SGD with momentum 0.9 (default lr 0.01 per 64 samples) or Adam (default lr 1e-3)")
    p.add_argument("--lr", type=float, default=None,
                   help="learning rate for the first step's global batch (default: 0.01 x global batch / 64)")
    p.add_argument("--warmup-steps", type=int_in(0), default=0, metavar="N",
                   help="gradual warm-up (Goyal et al., 2017): the learning rate rises linearly from lr / workers "
                        "to lr over the first N steps; for a large first global batch (default 0: none)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--fp16-pushpull", action="store_true",
                   help="send gradients as float16 (half the bytes; for slow links)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the model trains: cuda is the GPU the nccl engine gave this worker "
                        "(start the job with --engine nccl or auto); cpu goes with gloo and ps")
    add_batch_arguments(p)
    add_run_arguments(p, TEST_IMAGES)
    add_dataset_arguments(p)
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error(f"--device cuda: torch {torch.__version__} sees no CUDA device (CUDA build: {torch.version.cuda or 'no'}); "
                "train on the CPU with --device cpu")
    return args


def evaluate(model, test_x, test_y, rank, size):
    """Test loss and accuracy: each worker scores every size-th image, the sums cover all once."""
    model.eval()
    stats = torch.zeros(3, dtype=torch.float64, device=test_x.device)  # [sum of losses, correct, samples]
    with torch.no_grad():
        for x, y in zip(test_x[rank::size].split(1000), test_y[rank::size].split(1000)):
            out = model(x)
            stats[0] += F.cross_entropy(out, y, reduction="sum")
            stats[1] += (out.argmax(1) == y).sum()
            stats[2] += len(y)
    model.train()
    stats = bps.push_pull(stats, average=False, name="test_stats")
    test_loss, accuracy = (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()
    if rank == 0:  # TensorBoard, with bpslaunch --log-dir
        bps.log_scalar("test/accuracy", accuracy)
        bps.log_scalar("test/loss", test_loss)
    return test_loss, accuracy


def eval_subset(test_x, test_y, n):
    """``n`` (1..len(test_y)) test images drawn by a permutation seeded with 0, independent of
    ``--seed``, so that every run and configuration scores the same images."""
    chosen = torch.randperm(len(test_y), generator=torch.Generator().manual_seed(0))[:n]
    return test_x[chosen], test_y[chosen]


def training_clock(rank, size, seconds, device="cpu"):
    """The job's seconds of training, the same number on every worker (a collective): the largest of
    the workers' own ``seconds``. Workers that finish a step early wait for the others in this
    collective, which is untimed; the worker that arrives last (under ``ps``, the one behind the slow
    link, still pulling its sums) waited least, so its clock is the job's."""
    mine = torch.zeros(size, dtype=torch.float64, device=device)
    mine[rank] = seconds
    return bps.push_pull(mine, average=False, name="training_clock").max().item()


def worker_statistics(rank, size, device):
    """Every worker's step statistics (steps, samples, compute_s, push_pull_s), one row per rank."""
    rows = torch.zeros(size, 4, dtype=torch.float64, device=device)
    stats = bps.step_statistics()
    rows[rank] = torch.tensor([stats.steps, stats.samples, stats.compute_s, stats.push_pull_s], dtype=torch.float64)
    rows = bps.push_pull(rows, average=False, name="worker_statistics").cpu()
    return [{"rank": r, "steps": int(row[0]), "samples": int(row[1]), "compute_s": row[2].item(),
             "push_pull_s": row[3].item(), "samples_per_s": row[1].item() / row[2].item() if row[2] > 0 else 0.0}
            for r, row in enumerate(rows)]


def main():
    args = parse_args()
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)  # several workers share this machine's cores
    bps.init()
    rank, size = bps.rank(), bps.size()
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    batch_sizes = parse_batch_sizes(args.batch_size, size)  # before the data loads: a typo fails at once
    schedule = parse_batch_schedule(args.batch_schedule, size)
    torch.manual_seed(args.seed)
    log = print if rank == 0 else (lambda *a, **k: None)

    train_x, train_y = to_tensors(*load_fashion_mnist("train", root=args.data_dir))
    test_x, test_y = to_tensors(*load_fashion_mnist("test", root=args.data_dir))
    if args.eval_subset is not None:
        test_x, test_y = eval_subset(test_x, test_y, args.eval_subset)
    test_x, test_y = test_x.to(device), test_y.to(device)
    if args.limit_train:
        train_x, train_y = train_x[:args.limit_train], train_y[:args.limit_train]
    train_set = TensorDataset(train_x, train_y)
    # One shared permutation per epoch, cut by each worker's batch size: every sample once.
    sampler = bps.DynamicBatchSampler(train_set, batch_sizes, seed=args.seed)
    for step, sizes in schedule:
        bps.set_batch_sizes(sizes, at_step=step)
    loader = DataLoader(train_set, batch_sampler=sampler)

    model = MODELS[args.model]().to(device)
    if args.optimizer == "adam":
        lr = args.lr if args.lr is not None else 1e-3
        optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    else:
        lr = args.lr if args.lr is not None else 0.01 * sum(batch_sizes) / 64
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    compression = bps.Compression.fp16 if args.fp16_pushpull else bps.Compression.none
    optimizer = bps.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression, lr_scaling=args.lr_scaling)
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    bps.broadcast_optimizer_state(optimizer, root_rank=0)
    # On top of the rate the wrapper scales with the global batch (lr_scaling): the two multiply.
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1 / size, total_iters=args.warmup_steps) \
        if args.warmup_steps else None

    show_bar = rank == 0 and sys.stderr.isatty()
    try:
        from tqdm import tqdm
    except ImportError:
        show_bar, tqdm = False, None
    log(f"workers={size} model={args.model} optimizer={args.optimizer} batch_sizes={list(batch_sizes)} lr={lr:g} "
        f"warmup_steps={args.warmup_steps} "
        f"train_samples={len(train_set)}", flush=True)

    budget = args.time_budget if args.time_budget is not None else float("inf")
    next_eval = args.eval_every if args.eval_every else float("inf")
    curve = []  # (seconds of training, global samples, test accuracy, test loss)
    started = time.perf_counter()
    clock, untimed_s, samples_seen, all_steps, out_of_time = 0.0, 0.0, 0, 0, False
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        stats = torch.zeros(2, dtype=torch.float64, device=device)  # [sum of losses, samples] on this worker
        t0, steps = time.perf_counter(), 0
        batches = tqdm(loader, desc=f"epoch {epoch + 1}", leave=False) if show_bar else loader
        for x, y in batches:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            if warmup is not None:
                warmup.step()
            bps.report_loss(loss)  # the loss trend the batch-size policy watches
            stats[0] += loss.detach().double() * len(y)  # in place on the device: no copy, no wait for the GPU
            stats[1] += len(y)
            steps += 1
            if budget == float("inf") and next_eval == float("inf"):
                continue
            pause = time.perf_counter()
            with bps.untimed():  # the clock, evaluation and logging are not training
                clock = training_clock(rank, size, pause - started - untimed_s, device)
                if clock >= next_eval or clock >= budget:
                    seen = samples_seen + int(bps.push_pull(stats[1:].clone(), average=False, name="seen"))
                    test_loss, accuracy = evaluate(model, test_x, test_y, rank, size)
                    curve.append((clock, seen, accuracy, test_loss))
                    log(f"t={clock:.1f}s samples={seen} test_accuracy={accuracy:.4f}", flush=True)
                    next_eval += args.eval_every or float("inf")
            untimed_s += time.perf_counter() - pause
            if clock >= budget:
                out_of_time = True
                break
        stats = bps.push_pull(stats, average=False, name="train_stats").cpu()
        elapsed = time.perf_counter() - t0
        samples_seen += int(stats[1])
        all_steps += steps
        noise = bps.gradient_noise_scale()
        log(f"epoch {epoch + 1}/{args.epochs} train_loss={stats[0] / max(stats[1], 1):.4f} "
            f"steps={steps} mean_global_batch={stats[1] / max(steps, 1):.0f} time={elapsed:.1f}s "
            f"noise_scale={'n/a' if noise is None else f'{noise:.0f}'}", flush=True)
        if out_of_time:
            if stop_reason(True, samples_seen / len(train_set), args.epochs) == "time_budget":
                log(f"time budget of {args.time_budget:g} s ran out at t={clock:.1f}s of training: stopped in epoch "
                    f"{epoch + 1}/{args.epochs} after {steps} steps of it; {all_steps} steps, {samples_seen} samples "
                    f"({samples_seen / len(train_set):.2f} epochs) trained in all", flush=True)
            break
    trained_s = training_clock(rank, size, time.perf_counter() - started - untimed_s, device)  # without the evaluation below

    workers = worker_statistics(rank, size, device)
    if out_of_time:  # evaluated at the budget's last step already
        accuracy, test_loss = curve[-1][2:]
    else:
        test_loss, accuracy = evaluate(model, test_x, test_y, rank, size)
    wall = time.perf_counter() - started
    if rank == 0:
        train_clock = trained_s if not curve else max(clock, curve[-1][0])
        if args.output:
            RunMetrics(test_accuracy=accuracy, test_loss=test_loss, epochs=args.epochs, model=args.model,
                       wall_s=wall, train_s=train_clock, samples=samples_seen, workers=size,
                       batch_sizes=list(batch_sizes), batch_schedule=args.batch_schedule, lr=lr,
                       lr_scaling=args.lr_scaling, warmup_steps=args.warmup_steps, test_samples=len(test_y), curve=curve,
                       worker_statistics=workers, stopped_by=stop_reason(out_of_time, samples_seen / len(train_set), args.epochs),
                       epochs_trained=samples_seen / len(train_set)).write(args.output)
        print(f"test_accuracy={accuracy:.4f} test_loss={test_loss:.4f}", flush=True)
    bps.shutdown()


if __name__ == "__main__":
    main()
