"""The peers geotrain is compared with: PyTorch DistributedDataParallel
over gloo, or one plain process (--single), training reference.py's model,
data, AdamW and schedule.

A step is geotrain's: microbatches x microbatch_size samples, microbatch
ids step * microbatches + i. Under DDP the step's ids are cut into `world`
contiguous runs (the first microbatches % world ranks take one more), each
rank accumulates its run locally (no_sync) and DDP all-reduces on the last
backward; each microbatch's loss is scaled by world / microbatches, so the
averaged gradient is the step's mean, as in geotrain (up to float
reduction order). Every process uses one thread unless --threads says
otherwise. Evaluation (every eval_every steps and at the last, as geotrain)
splits the eval batches across ranks and sums them in float64.

Rank 0 (or the --single process) prints one JSON line per step:
  step, loss            1-based step, mean loss of its microbatches
  time_s                wall time since training started (evaluations included)
  samples_per_s         samples trained / time spent training (evaluations excluded)
  val_loss              where evaluated
  grad_bytes            bytes of gradient one rank hands to the all-reduce
                        per step (fp16 with --fp16_hook; 0 for --single)
  net_bytes             bytes this process's network namespace sent and
                        received on interfaces other than lo since the last
                        line, when there are any (one namespace per worker)
and a last line {"done": true, ...} with the totals and, with
--target_val_loss, the step and time at which it was first reached (the
run stops there).

  python ddp_train.py --job deploy/jobs/gpt-tiny.textproto --single
  python ddp_train.py --job ... --rank R --world 3 --master 127.0.0.1:29500
  (or RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment)
"""
import argparse
import contextlib
import json
import os
import sys
import time
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import reference  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="DDP (gloo) or single-process peer of geotrain")
    p.add_argument("--job", required=True, help="geotrain job file (gpt on text)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a job field (reference.Job's names), e.g. microbatches=6")
    p.add_argument("--steps", type=int, help="override the job's steps (the schedule follows)")
    p.add_argument("--eval_every", type=int, help="override the job's eval_every")
    p.add_argument("--stop_after", type=int,
                   help="train only this many of the schedule's steps (it still spans --steps)")
    p.add_argument("--target_val_loss", type=float, help="stop once a val_loss is <= this")
    p.add_argument("--time_limit_s", type=float,
                   help="stop at the first evaluation after this long (rank 0's clock decides)")
    p.add_argument("--single", action="store_true", help="one process, no DDP")
    p.add_argument("--rank", type=int, default=int(os.environ.get("RANK", 0)))
    p.add_argument("--world", type=int, default=int(os.environ.get("WORLD_SIZE", 1)))
    p.add_argument("--master", default=(f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
                                        if "MASTER_ADDR" in os.environ else "127.0.0.1:29500"),
                   help="HOST:PORT of rank 0's rendezvous (init_method tcp://)")
    p.add_argument("--ifname", help="GLOO_SOCKET_IFNAME: the interface gloo's links use")
    p.add_argument("--bucket_cap_mb", type=float, help="DDP bucket size (default DDP's 25)")
    p.add_argument("--fp16_hook", action="store_true", help="DDP's fp16_compress_hook")
    p.add_argument("--gradient_as_bucket_view", action="store_true")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--timeout_s", type=float, default=600, help="rendezvous and collective timeout")
    return p.parse_args(argv)


def load_job(args):
    overrides = {}
    for item in args.set:
        name, _, text = item.partition("=")
        if not hasattr(reference.Job, name):
            raise SystemExit(f"--set {item}: no job field {name}")
        default = getattr(reference.Job, name)
        overrides[name] = type(default)(text) if not isinstance(default, tuple) else (text,)
    if args.steps is not None:
        overrides["steps"] = args.steps
    if args.eval_every is not None:
        overrides["eval_every"] = args.eval_every
    job = reference.load_job(args.job, **overrides)
    if job.schedule != "SCHEDULE_SYNC":
        print(f"note: the job's schedule is {job.schedule}; the peers always run sync maths",
              file=sys.stderr)
    return job


def last_step(job, args):
    return job.steps if args.stop_after is None else min(job.steps, args.stop_after)


def net_bytes():
    """Bytes received + sent on this namespace's interfaces other than lo."""
    total = 0
    try:
        with open("/proc/net/dev") as f:
            for line in f.readlines()[2:]:
                name, _, rest = line.partition(":")
                if name.strip() == "lo":
                    continue
                fields = rest.split()
                total += int(fields[0]) + int(fields[8])
    except OSError:
        return 0
    return total


def share(job, step, rank, world):
    """This rank's contiguous run of the step's microbatch ids."""
    ids = list(reference.microbatch_ids(job, step))
    base, extra = divmod(len(ids), world)
    begin = rank * base + min(rank, extra)
    return ids[begin:begin + base + (1 if rank < extra else 0)]


class Reporter:
    """Rank 0's JSON lines; the other ranks print nothing."""

    def __init__(self, job, enabled, grad_bytes):
        self.job, self.enabled, self.grad_bytes = job, enabled, grad_bytes
        self.start = time.monotonic()
        self.eval_s = 0.0
        self.samples = 0
        self.net_last = net_bytes()
        self.reached = None

    def line(self, record):
        if self.enabled:
            print(json.dumps(record), flush=True)

    def mark(self):
        """The figures of the step that has just finished, for step()."""
        return time.monotonic() - self.start, self.samples, self.eval_s

    def step(self, step, loss, val_loss=None, mark=None):
        elapsed, samples, eval_s = mark or self.mark()
        record = {"step": step, "loss": loss, "time_s": round(elapsed, 4),
                  "samples_per_s": round(samples / max(elapsed - eval_s, 1e-9), 2)}
        if val_loss is not None:
            record["val_loss"] = val_loss
        record["grad_bytes"] = self.grad_bytes
        net = net_bytes()
        if net - self.net_last > 0:
            record["net_bytes"] = net - self.net_last
        self.net_last = net
        self.line(record)

    def finish(self, steps):
        elapsed = time.monotonic() - self.start
        record = {"done": True, "steps": steps, "samples": self.samples,
                  "time_s": round(elapsed, 4), "eval_s": round(self.eval_s, 4),
                  "samples_per_s": round(self.samples / max(elapsed - self.eval_s, 1e-9), 2)}
        if self.reached is not None:
            record["target_step"], record["target_time_s"] = self.reached
        self.line(record)


def over_time(report, args):
    return (args.time_limit_s is not None and
            time.monotonic() - report.start > args.time_limit_s)


def run_single(job, args):
    trainer = reference.SyncTrainer(job)
    report = Reporter(job, True, 0)
    done = 0
    for step in range(last_step(job, args)):
        loss, _ = trainer.step(step)
        report.samples += job.samples_per_step
        done = step + 1
        val = None
        if reference.eval_due(job, done):
            began = time.monotonic()
            val = trainer.validation_loss()
            report.eval_s += time.monotonic() - began
        report.step(done, loss, val)
        if val is not None and args.target_val_loss is not None and val <= args.target_val_loss:
            report.reached = (done, round(time.monotonic() - report.start, 4))
            break
        if val is not None and over_time(report, args):
            break
    report.finish(done)


def run_ddp(job, args):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    if job.microbatches < args.world:
        raise SystemExit(f"{job.microbatches} microbatches cannot be shared by {args.world} ranks")
    if args.ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = args.ifname
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}", rank=args.rank,
                            world_size=args.world, timeout=timedelta(seconds=args.timeout_s))
    try:
        model = reference.Gpt(job)
        data = reference.TextDataset(job)
        options = {"gradient_as_bucket_view": args.gradient_as_bucket_view}
        if args.bucket_cap_mb is not None:
            options["bucket_cap_mb"] = args.bucket_cap_mb
        ddp = DistributedDataParallel(model, **options)
        if args.fp16_hook:
            ddp.register_comm_hook(dist.group.WORLD, default_hooks.fp16_compress_hook)
        params = list(model.parameters())
        optimizer = reference.make_optimizer(job, params)
        grad_bytes = sum(p.numel() for p in params) * (2 if args.fp16_hook else 4)
        report = Reporter(job, args.rank == 0, grad_bytes)
        scale = args.world / job.microbatches
        pending = None  # (step, loss-sum tensor, its reduce) printed a step late
        done = 0
        for step in range(last_step(job, args)):
            mine = share(job, step, args.rank, args.world)
            local = 0.0
            for k, g in enumerate(mine):
                inputs, targets = data.train_microbatch(g)
                sync = k == len(mine) - 1
                with (contextlib.nullcontext() if sync else ddp.no_sync()):
                    loss = reference.compute_loss(ddp(inputs), targets)
                    (loss * scale).backward()
                local += loss.item()
            optimizer.step([p.grad for p in params],
                           reference.learning_rate_scale(job, reference.progress_after(job, step)))
            for p in params:
                p.grad = None
            report.samples += job.samples_per_step
            done = step + 1
            # The loss reaches rank 0 while the next step computes; a line
            # is printed once it has, so the reduce adds no round trip.
            loss_sum = torch.tensor([local], dtype=torch.float64)
            work = dist.reduce(loss_sum, dst=0, async_op=True)
            if pending is not None:
                pending[2].wait()
                report.step(pending[0], pending[1].item() / job.microbatches, mark=pending[3])
            pending = (done, loss_sum, work, report.mark())
            if reference.eval_due(job, done):
                began = time.monotonic()
                batches = range(args.rank, job.eval_batches, args.world)
                s, n = reference.evaluate(model, data, job, batches)
                # The third sum is rank 0's "out of time", so all ranks stop together.
                stop = 1.0 if args.rank == 0 and over_time(report, args) else 0.0
                totals = torch.tensor([s, float(n), stop], dtype=torch.float64)
                dist.all_reduce(totals)
                val = totals[0].item() / totals[1].item()
                report.eval_s += time.monotonic() - began
                pending[2].wait()
                report.step(done, pending[1].item() / job.microbatches, val)  # after the eval
                pending = None
                if args.target_val_loss is not None and val <= args.target_val_loss:
                    report.reached = (done, round(time.monotonic() - report.start, 4))
                    break
                if totals[2].item() > 0:
                    break
        if pending is not None:
            pending[2].wait()
            report.step(pending[0], pending[1].item() / job.microbatches, mark=pending[3])
        report.finish(done)
    finally:
        dist.destroy_process_group()


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    job = load_job(args)
    if args.single:
        run_single(job, args)
    else:
        run_ddp(job, args)


if __name__ == "__main__":
    main()
