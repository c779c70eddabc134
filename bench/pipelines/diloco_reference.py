#!/usr/bin/env python3
"""DiLoCo on the demo GPT in plain PyTorch: what the outer optimizer's
algorithm gives, apart from geotrain's pipelines, links and schedules.

It trains with bench/vs_ddp/reference.py's maths (the model, data, AdamW and
learning-rate schedule geotrain's sync schedule computes). R replicas start
from the same weights. Each trains on its own microbatches: with --split,
its share of the job's batch (pipeline r of R takes ids r*M/R..(r+1)*M/R-1
of each step's M); without it, a whole batch of its own. Every H steps the
replicas' pseudo-gradients (outer weights minus their weights) are averaged,
optionally through int8 blockwise absmax with error feedback (--int8, as
geotrain's outer codec), and the outer step (Nesterov SGD, --outer_lr,
--momentum) moves the outer weights. Every replica then restarts from them.
Blocking rounds; no pipeline staleness. --per_microbatch updates after every
microbatch, as geotrain's async-stash schedule does, instead of once a step.

It prints, ten times a run: the step, the replicas' mean training loss, and
replica 0's validation loss (on its inner weights, mid-round).

Run it with the venv that bench/vs_ddp uses (deploy/install-libtorch.sh):
  build-wheel/torch-venv/bin/python bench/pipelines/diloco_reference.py \\
      --replicas 2 --inner_steps 50 --split --steps 1200
"""
import argparse
import copy
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "vs_ddp"))
import reference as ref  # noqa: E402

BLOCK = 64  # geotrain's int8 block (common/codec.h)


def int8_round_trip(x):
    """Blockwise absmax int8 of `x`, decoded again."""
    flat = x.reshape(-1)
    n = flat.numel()
    blocks = torch.cat([flat, flat.new_zeros((-n) % BLOCK)]).reshape(-1, BLOCK)
    scale = blocks.abs().amax(1, keepdim=True) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    decoded = (torch.round(blocks / scale).clamp(-127, 127) * scale).reshape(-1)[:n]
    return decoded.reshape(x.shape)


class ErrorFeedback:
    """What a lossy codec left out is added to the next value sent."""

    def __init__(self, enabled):
        self.enabled = enabled
        self.residual = {}

    def send(self, key, value):
        if not self.enabled:
            return value
        value = value + self.residual.get(key, torch.zeros_like(value))
        sent = int8_round_trip(value)
        self.residual[key] = value - sent
        return sent


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", default=os.path.join(HERE, "..", "..", "deploy", "jobs",
                                                      "gpt-tiny.textproto"))
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--inner_steps", type=int, default=50, help="H")
    parser.add_argument("--outer_lr", type=float, default=0.7)
    parser.add_argument("--momentum", type=float, default=0.9, help="Nesterov; 0: none")
    parser.add_argument("--steps", type=int, default=300, help="the job's steps")
    parser.add_argument("--microbatches", type=int, default=0, help="M (0: the job's)")
    parser.add_argument("--split", action="store_true", help="the replicas share the batch")
    parser.add_argument("--per_microbatch", action="store_true",
                        help="an AdamW update after every microbatch (async-stash)")
    parser.add_argument("--int8", action="store_true", help="int8 pseudo-gradients and means")
    parser.add_argument("--stop", type=int, default=0, help="stop after this step (0: the end)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    overrides = {"steps": args.steps, "eval_every": max(1, args.steps // 10)}
    if args.microbatches:
        overrides["microbatches"] = args.microbatches
    job = ref.load_job(args.job, **overrides)
    replicas, m = args.replicas, job.microbatches
    if args.split and m % replicas:
        sys.exit(f"--split needs the replicas ({replicas}) to divide M ({m})")
    share = m // replicas if args.split else m
    first = ref.SyncTrainer(job)
    trainers = [first] + [ref.SyncTrainer(job, model=copy.deepcopy(first.model), data=first.data)
                          for _ in range(replicas - 1)]
    outer = [p.detach().clone() for p in first.params]
    momentum = None
    replica_codec, mean_codec = ErrorFeedback(args.int8), ErrorFeedback(args.int8)

    def ids(step, r):
        if args.split:
            return range(step * m + r * share, step * m + (r + 1) * share)
        return range((step * replicas + r) * m, (step * replicas + r + 1) * m)

    print(f"# replicas {replicas}, H {args.inner_steps}, outer lr {args.outer_lr} momentum "
          f"{args.momentum}, {args.steps} steps of M {m}{' split' if args.split else ''}"
          f"{', per microbatch' if args.per_microbatch else ''}{', int8' if args.int8 else ''}")
    print("# step train_loss val_loss")
    for step in range(args.steps):
        losses = []
        for r, t in enumerate(trainers):
            grads, count, loss_sum = None, 0, 0.0
            microbatches = list(ids(step, r))
            for j, g in enumerate(microbatches):
                inputs, targets = t.data.train_microbatch(g)
                loss = ref.compute_loss(t.model(inputs), targets)
                these = torch.autograd.grad(loss, t.params)
                grads = list(these) if grads is None else [s.add_(d) for s, d in zip(grads, these)]
                count += 1
                loss_sum += loss.item()
                if args.per_microbatch:
                    progress = (step + (j + 1) / len(microbatches)) / job.steps
                    t.optimizer.step(grads, ref.learning_rate_scale(job, progress))
                    grads = None
            if not args.per_microbatch:
                for s in grads:
                    s.div_(count)
                t.optimizer.step(grads, ref.learning_rate_scale(job, (step + 1) / job.steps))
            losses.append(loss_sum / count)
        if replicas > 1 and (step + 1) % args.inner_steps == 0:
            with torch.no_grad():
                mean = []
                for i, o in enumerate(outer):
                    total = sum(replica_codec.send((r, i), o - t.params[i])
                                for r, t in enumerate(trainers))
                    mean.append(mean_codec.send(i, total / replicas))
                update = mean
                if args.momentum:
                    if momentum is None:
                        momentum = [x.clone() for x in mean]
                    else:
                        for b, x in zip(momentum, mean):
                            b.mul_(args.momentum).add_(x)
                    update = [x + args.momentum * b for x, b in zip(mean, momentum)]
                for o, u in zip(outer, update):
                    o.sub_(args.outer_lr * u)
                for t in trainers:
                    for p, o in zip(t.params, outer):
                        p.copy_(o)
        if (step + 1) % max(1, args.steps // 10) == 0 or step + 1 == args.steps:
            print(step + 1, round(sum(losses) / len(losses), 4),
                  round(trainers[0].validation_loss(), 4), flush=True)
        if args.stop and step + 1 >= args.stop:
            break


if __name__ == "__main__":
    main()
