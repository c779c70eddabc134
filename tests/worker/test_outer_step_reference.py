"""The outer optimizer against PyTorch: H AdamW inner steps on each of R
pipelines, then the Nesterov outer step on the samples-weighted mean of the
pseudo-gradients (torch.optim.SGD(nesterov=True) with grad = outer - inner),
for a few rounds, on a small MLP on Fashion-MNIST. Two comparisons: every
round's outer step, applied by PyTorch to geotrain's own inner weights, must
agree with geotrain's outer weights to 1e-6; and the whole run, inner steps
included, must agree with PyTorch training the same to 1e-5. geotrain's side is
outer_step_check (the StageRuntime code a stage's replicas run); PyTorch's
is the MLP and its data re-done here from worker/models.cc and
worker/datasets.cc, with bench/vs_ddp's reference.py for the seeds, the
Mersenne Twister and geotrain's AdamW, plus the outer loop. Every
pipeline's weights must be bit-identical after each round.

Run with a Python that has torch (tests/run.sh: the wheel tree's venv):
  GEOTRAIN_BIN_DIR=build-wheel/bin python tests/worker/test_outer_step_reference.py
"""
import gzip
import os
import struct
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE_DIR = os.environ.get("GEOTRAIN_SOURCE_DIR", os.path.abspath(os.path.join(HERE, "..", "..")))
sys.path.insert(0, os.path.join(SOURCE_DIR, "bench", "vs_ddp"))

import torch  # noqa: E402

import reference  # noqa: E402

TOLERANCE = 1e-6  # the outer step on geotrain's own inner weights, every round
# Inner and outer steps together against PyTorch training: the kernels'
# rounding differs (~1e-7 after a few AdamW steps), AdamW magnifies it where
# a gradient is near eps, and Nesterov momentum adds it up over the rounds.
END_TO_END_TOLERANCE = 1e-5
FASHION_MNIST = "/usr/share/datasets/fashion-mnist"
HIDDEN = (32, 16)
SEED = 7
LR = 0.003
WEIGHT_DECAY = 0.01
MICROBATCHES = 2
MICROBATCH_SIZE = 8
STEPS = 100  # the run's length for the learning-rate schedule (constant here)
# An MLP: no parameter has a gradient that is zero but for rounding (a GPT's
# attention key bias does, and AdamW turns that noise into lr-sized steps
# that differ between any two LibTorch builds).
JOB = f"""
name: "outer-step-check"
mlp {{ hidden: {HIDDEN[0]} hidden: {HIDDEN[1]} }}
fashion_mnist {{ dir: "{FASHION_MNIST}" }}
optimizer {{ kind: KIND_ADAMW lr: {LR} weight_decay: {WEIGHT_DECAY} }}
schedule: SCHEDULE_SYNC
steps: {STEPS}
microbatches: {MICROBATCHES}
microbatch_size: {MICROBATCH_SIZE}
seed: {SEED}
"""


class Mlp(torch.nn.Module):
    """worker/models.cc DenseLayer i, built right after
    torch::manual_seed(LayerSeed(seed, i)): Linear, then ReLU but on the last."""

    def __init__(self):
        super().__init__()
        widths = (28 * 28,) + HIDDEN + (10,)
        layers = []
        for i in range(len(widths) - 1):
            torch.manual_seed(reference.layer_seed(SEED, i))
            layers.append(torch.nn.Linear(widths[i], widths[i + 1]))
        self.layers = torch.nn.ModuleList(layers)

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i + 1 < len(self.layers):
                x = torch.relu(x)
        return x


def read_idx(path, dims):
    with gzip.open(path, "rb") as f:
        blob = f.read()
    shape = struct.unpack(f">{dims}i", blob[4:4 + 4 * dims])
    data = torch.frombuffer(bytearray(blob[4 + 4 * dims:]), dtype=torch.uint8)
    if dims == 3:
        return data.reshape(shape[0], shape[1] * shape[2])
    return data.to(torch.int64)


class FashionMnist:
    """worker/datasets.cc FashionMnistDataset: sample s of the run is row
    Permutation(s / n)[s % n], a Fisher-Yates shuffle per epoch drawn from
    std::mt19937_64(MixSeed(seed, 3, epoch))."""

    def __init__(self):
        images = read_idx(os.path.join(FASHION_MNIST, "train-images-idx3-ubyte.gz"), 3)
        self.images = ((images.to(torch.float32) / 255.0) - 0.2860) / 0.3530
        self.labels = read_idx(os.path.join(FASHION_MNIST, "train-labels-idx1-ubyte.gz"), 1)
        self.perm_epoch, self.perm = -1, None

    def permutation(self, epoch):
        if epoch != self.perm_epoch:
            perm = list(range(self.images.shape[0]))
            rng = reference.Mt19937_64(reference.mix_seed(SEED, 3, epoch))
            for i in range(len(perm) - 1, 0, -1):
                j = rng() % (i + 1)
                perm[i], perm[j] = perm[j], perm[i]
            self.perm_epoch, self.perm = epoch, perm
        return self.perm

    def train_microbatch(self, index):
        n = self.images.shape[0]
        rows = []
        for b in range(MICROBATCH_SIZE):
            sample = index * MICROBATCH_SIZE + b
            rows.append(self.permutation(sample // n)[sample % n])
        idx = torch.tensor(rows, dtype=torch.int64)
        return self.images.index_select(0, idx), self.labels.index_select(0, idx)


class Pipeline:
    """Pipeline r of R, trained as the sync schedule does: inner step g runs
    ids g*R*M + j*R + r, sums their gradients in order, divides by M, and
    takes one AdamW step (reference.AdamW: geotrain's)."""

    def __init__(self, r, pipelines, data):
        self.r, self.pipelines, self.data = r, pipelines, data
        self.model = Mlp()
        self.params = list(self.model.parameters())
        job = reference.Job(lr=LR, weight_decay=WEIGHT_DECAY)
        self.optimizer = reference.AdamW(job, self.params)

    def step(self, g):
        grad_sum = None
        for j in range(MICROBATCHES):
            inputs, targets = self.data.train_microbatch(
                g * self.pipelines * MICROBATCHES + j * self.pipelines + self.r)
            loss = torch.nn.functional.cross_entropy(self.model(inputs), targets)
            grads = torch.autograd.grad(loss, self.params)
            if grad_sum is None:
                grad_sum = list(grads)
            else:
                for s, d in zip(grad_sum, grads):
                    s.add_(d)
        for s in grad_sum:
            s.div_(float(MICROBATCHES))
        self.optimizer.step(grad_sum, 1.0)


def reference_run(pipelines, inner, rounds, lr, momentum):
    data = FashionMnist()
    trainers = [Pipeline(r, pipelines, data) for r in range(pipelines)]
    outer_params = [torch.nn.Parameter(p.detach().clone()) for p in trainers[0].params]
    outer = torch.optim.SGD(outer_params, lr=lr, momentum=momentum, nesterov=momentum > 0)
    samples = inner * MICROBATCHES * MICROBATCH_SIZE
    for round_ in range(rounds):
        deltas = []
        for t in trainers:
            for k in range(inner):
                t.step(round_ * inner + k)
            deltas.append([o.detach() - p.detach() for o, p in zip(outer_params, t.params)])
        total = samples * pipelines
        for i, o in enumerate(outer_params):
            mean = torch.zeros_like(o)
            for d in deltas:
                mean.add_(d[i], alpha=samples / total)
            o.grad = mean
        outer.step()
        with torch.no_grad():
            for t in trainers:
                for p, o in zip(t.params, outer_params):
                    p.copy_(o)
    return [p.detach() for p in outer_params]


def read_weight_sets(path):
    """Every weight set outer_step_check wrote, in order."""
    with open(path, "rb") as f:
        blob = f.read()
    sets, at = [], 0
    while at < len(blob):
        tensors, at = read_weights(blob, at)
        sets.append(tensors)
    return sets


def read_weights(blob, at):
    (count,) = struct.unpack_from("<i", blob, at)
    at += 4
    tensors = []
    for _ in range(count):
        (ndim,) = struct.unpack_from("<i", blob, at)
        at += 4
        dims = struct.unpack_from(f"<{ndim}q", blob, at)
        at += 8 * ndim
        n = 1
        for d in dims:
            n *= d
        values = torch.frombuffer(bytearray(blob[at:at + 4 * n]), dtype=torch.float32)
        at += 4 * n
        tensors.append(values.reshape(dims))
    return tensors, at


def outer_steps_on(sets, pipelines, rounds, lr, momentum):
    """The outer step alone, in PyTorch, on geotrain's own inner weights:
    the largest difference from geotrain's outer weights over the rounds."""
    per_round = pipelines + 1
    start = [p.detach().clone() for p in Mlp().parameters()]
    outer_params = [torch.nn.Parameter(p) for p in start]
    outer = torch.optim.SGD(outer_params, lr=lr, momentum=momentum, nesterov=momentum > 0)
    worst = 0.0
    for round_ in range(rounds):
        inner = sets[round_ * per_round: round_ * per_round + pipelines]
        after = sets[round_ * per_round + pipelines]
        for i, o in enumerate(outer_params):
            mean = torch.zeros_like(o)
            for r in range(pipelines):
                mean.add_(o.detach() - inner[r][i], alpha=1.0 / pipelines)
            o.grad = mean
        outer.step()
        worst = max(worst, max((o.detach() - a).abs().max().item()
                               for o, a in zip(outer_params, after)))
        with torch.no_grad():  # the next round starts from geotrain's
            for o, a in zip(outer_params, after):
                o.copy_(a)
    return worst


def main():
    torch.set_num_threads(1)
    bin_dir = os.environ.get("GEOTRAIN_BIN_DIR", os.path.join(SOURCE_DIR, "build", "bin"))
    failures = []
    for pipelines, inner, rounds, lr, momentum in [(2, 3, 3, 0.7, 0.9), (3, 2, 2, 0.5, 0.0)]:
        with tempfile.TemporaryDirectory(prefix="outer-step-") as d:
            job_file = os.path.join(d, "job.textproto")
            with open(job_file, "w") as f:
                f.write(JOB)
            out = os.path.join(d, "weights.bin")
            run = subprocess.run(
                [os.path.join(bin_dir, "outer_step_check"), f"--job={job_file}",
                 f"--pipelines={pipelines}", f"--inner_steps={inner}", f"--rounds={rounds}",
                 f"--lr={lr}", f"--momentum={momentum}", f"--out={out}"],
                capture_output=True, text=True, timeout=600)
            if run.returncode != 0:
                failures.append(f"outer_step_check failed: {run.stderr[-2000:]}")
                continue
            rounds_seen = 0
            for line in run.stdout.splitlines():
                if not line.startswith("round "):
                    continue
                rounds_seen += 1
                digests = line.split()[2:]
                if len(digests) != pipelines or len(set(digests)) != 1:
                    failures.append(f"R={pipelines}: pipelines differ after {line.split()[1]}: "
                                    f"{digests}")
            if rounds_seen != rounds:
                failures.append(f"R={pipelines}: {rounds_seen} rounds reported, want {rounds}")
            sets = read_weight_sets(out)
            if len(sets) != rounds * (pipelines + 1):
                failures.append(f"R={pipelines}: {len(sets)} weight sets written")
                continue
            geotrain = sets[-1]
            step_only = outer_steps_on(sets, pipelines, rounds, lr, momentum)
            initial = [p.detach().clone() for p in Mlp().parameters()]
            expected = reference_run(pipelines, inner, rounds, lr, momentum)
        if len(geotrain) != len(expected):
            failures.append(f"{len(geotrain)} tensors from geotrain, {len(expected)} expected")
            continue
        worst = 0.0
        for g, e in zip(geotrain, expected):
            if tuple(g.shape) != tuple(e.shape):
                failures.append(f"shape {tuple(g.shape)} against {tuple(e.shape)}")
                break
            worst = max(worst, (g - e).abs().max().item())
        moved = max((e - p).abs().max().item() for e, p in zip(expected, initial))
        print(f"R={pipelines} H={inner} rounds={rounds} lr={lr} momentum={momentum}: "
              f"outer step {step_only:.2e}, end to end {worst:.2e} "
              f"(weights moved up to {moved:.2e})", flush=True)
        if step_only > TOLERANCE:
            failures.append(f"R={pipelines}: the outer step differs by {step_only:.2e} > "
                            f"{TOLERANCE:g}")
        if worst > END_TO_END_TOLERANCE:
            failures.append(f"R={pipelines}: end to end {worst:.2e} > {END_TO_END_TOLERANCE:g}")
        if moved < 1e-3:
            failures.append(f"R={pipelines}: the weights hardly moved ({moved:.2e})")
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        return 1
    print(f"the outer step matches PyTorch's to {TOLERANCE:g} every round, training end to end "
          f"to {END_TO_END_TOLERANCE:g}; pipelines bit-identical after each round")
    return 0


if __name__ == "__main__":
    sys.exit(main())
