"""geotrain's byte-level GPT training, re-done in PyTorch.

The peer systems of bench/vs_ddp (PyTorch DDP, one plain process) must train
the maths that geotrain trains, or their times to a validation loss compare
nothing. This module is that maths, taken from the C++ it mirrors:

  model       worker/models.cc      GptEmbedding, GptBlock, GptHead; layer i
                                    built right after torch::manual_seed(
                                    LayerSeed(seed, i)), so its weights are a
                                    function of (seed, i) alone
  data        worker/datasets.cc    TextDataset: the corpus, its validation
                                    tail, and microbatch g's windows from
                                    std::mt19937_64(MixSeed(seed, 1, g))
  optimizer   worker/optimizer.cc   AdamW (decoupled decay on every
                                    parameter), LearningRateScale
  step        worker/stage_runtime.cc, worker/pipeline_driver.cc
                                    sync: `microbatches` forward/backwards on
                                    one weight version, the gradients summed
                                    in order and divided by their count, one
                                    update at progress = microbatches done /
                                    (steps * microbatches); the step's loss is
                                    the mean of its microbatches' losses

Under SCHEDULE_SYNC the pipeline's stage cuts change nothing here: every stage
differentiates its own layers of the same graph, so one process computes
the same numbers (the integration tests check 1 worker against 3).

Not thread-safe; call torch.set_num_threads() before training.
"""
import dataclasses
import math
import os
import re

import torch
import torch.nn.functional as F

VOCAB = 256  # the GPT's bytes
MASK64 = (1 << 64) - 1

# --------------------------------------------------------------------------
# Job files: the few fields a GPT `text` job has, with ApplyJobDefaults'.


def parse_textproto(text):
    """A small textproto reader: nested messages as dicts; a field seen
    twice becomes a list. Enough for deploy/jobs/*.textproto."""
    tokens = re.findall(r'#[^\n]*|"(?:[^"\\]|\\.)*"|[{}:;,]|[^\s{}:;,"#]+', text)
    tokens = [t for t in tokens if not t.startswith("#")]
    pos = 0

    def value(tok):
        if tok.startswith('"'):
            return bytes(tok[1:-1], "utf-8").decode("unicode_escape")
        if re.fullmatch(r"[-+]?\d+", tok):
            return int(tok)
        try:
            return float(tok)
        except ValueError:
            return {"true": True, "false": False}.get(tok, tok)  # enums stay names

    def message(end):
        nonlocal pos
        out = {}
        while pos < len(tokens) and tokens[pos] != end:
            name = tokens[pos]
            pos += 1
            if tokens[pos] == ":":
                pos += 1
            if tokens[pos] == "{":
                pos += 1
                v = message("}")
                pos += 1
            else:
                v = value(tokens[pos])
                pos += 1
            if pos < len(tokens) and tokens[pos] in (";", ","):
                pos += 1
            if name in out:
                if not isinstance(out[name], list):
                    out[name] = [out[name]]
                out[name].append(v)
            else:
                out[name] = v
        return out

    return message(None)


@dataclasses.dataclass
class Job:
    """A GPT job on text data, with geotrain's defaults (common/job_spec.cc)."""
    context: int = 64
    d_model: int = 128
    heads: int = 4
    blocks: int = 4
    mlp_ratio: int = 4
    paths: tuple = ("/usr/share/games/fortunes",)
    validation_fraction: float = 0.05
    optimizer: str = "KIND_ADAMW"
    lr: float = 1e-3
    weight_decay: float = 0.0
    momentum: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    warmup_fraction: float = 0.0
    decay: str = "DECAY_UNSPECIFIED"
    min_lr_fraction: float = 0.0
    schedule: str = "SCHEDULE_SYNC"
    steps: int = 300
    microbatches: int = 4
    microbatch_size: int = 16
    seed: int = 0
    eval_every: int = 0
    eval_batches: int = 8

    @property
    def samples_per_step(self):
        return self.microbatches * self.microbatch_size


def load_job(path, **overrides):
    """Reads a geotrain job file (a `gpt {}` model on `text {}` data);
    `overrides` replace fields afterwards, as the coordinator's flags do."""
    with open(path) as f:
        spec = parse_textproto(f.read())
    if "gpt" not in spec or "text" not in spec:
        raise ValueError(f"{path}: the reference knows only gpt {{}} models on text {{}} data")
    job = Job()
    fields = dict(spec["gpt"])
    text = spec["text"]
    if "paths" in text:
        paths = text["paths"]
        fields["paths"] = tuple(paths if isinstance(paths, list) else [paths])
    if "validation_fraction" in text:
        fields["validation_fraction"] = text["validation_fraction"]
    opt = spec.get("optimizer", {})
    for key in ("lr", "weight_decay", "momentum", "beta1", "beta2", "warmup_fraction",
                "decay", "min_lr_fraction"):
        if key in opt:
            fields[key] = opt[key]
    if "kind" in opt:
        fields["optimizer"] = opt["kind"]
    for key in ("schedule", "steps", "microbatches", "microbatch_size", "seed", "eval_every",
                "eval_batches"):
        if key in spec:
            fields[key] = spec[key]
    fields.update(overrides)
    for name, v in fields.items():
        setattr(job, name, v)
    # Zero means "unset" in proto3; these are ApplyJobDefaults' fill-ins.
    for name, default in (("mlp_ratio", 4), ("lr", 1e-3), ("beta1", 0.9), ("beta2", 0.999),
                          ("microbatches", 4), ("microbatch_size", 16), ("eval_batches", 8),
                          ("validation_fraction", 0.05)):
        if getattr(job, name) == 0:
            setattr(job, name, default)
    for name in ("lr", "weight_decay", "momentum", "beta1", "beta2", "warmup_fraction",
                 "min_lr_fraction", "validation_fraction"):
        setattr(job, name, float(getattr(job, name)))
    if job.d_model % job.heads != 0:
        raise ValueError("d_model must be a multiple of heads")
    return job


# --------------------------------------------------------------------------
# Seeds and the C++ standard library's 64-bit Mersenne Twister.


def layer_seed(job_seed, index):
    """worker/models.cc LayerSeed: the torch seed layer `index` is built from."""
    x = (job_seed * 0x9E3779B97F4A7C15 + index + 1) & MASK64
    x ^= x >> 31
    x = (x * 0xBF58476D1CE4E5B9) & MASK64
    x ^= x >> 27
    return x & ((1 << 62) - 1)


def mix_seed(seed, stream, index):
    """worker/datasets.cc MixSeed: stream 1 is training, 2 is validation."""
    x = ((seed * 0x9E3779B97F4A7C15) & MASK64) ^ ((stream << 48) & MASK64) ^ (index & MASK64)
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & MASK64
    x ^= x >> 33
    return x


class Mt19937_64:
    """std::mt19937_64 (C++11 [rand.predef]): same seed, same draws."""
    N, M = 312, 156
    UPPER, LOWER = 0xFFFFFFFF80000000, 0x7FFFFFFF
    MATRIX_A = 0xB5026F5AA96619E9

    def __init__(self, seed=5489):
        mt = [0] * self.N
        mt[0] = seed & MASK64
        for i in range(1, self.N):
            prev = mt[i - 1]
            mt[i] = (6364136223846793005 * (prev ^ (prev >> 62)) + i) & MASK64
        self.mt = mt
        self.index = self.N

    def _twist(self):
        mt, n, m = self.mt, self.N, self.M
        upper, lower, a = self.UPPER, self.LOWER, self.MATRIX_A
        for i in range(n):
            y = (mt[i] & upper) | (mt[(i + 1) % n] & lower)
            mt[i] = mt[(i + m) % n] ^ (y >> 1) ^ (a if y & 1 else 0)
        self.index = 0

    def __call__(self):
        if self.index >= self.N:
            self._twist()
        y = self.mt[self.index]
        self.index += 1
        y ^= (y >> 29) & 0x5555555555555555
        y ^= (y << 17) & 0x71D67FFFEDA60000
        y ^= (y << 37) & 0xFFF7EEE000000000
        y ^= y >> 43
        return y & MASK64


# --------------------------------------------------------------------------
# Data: worker/datasets.cc TextDataset.


def _has_extension(name):
    """std::filesystem::path::has_extension() of a file name."""
    if name in (".", ".."):
        return False
    dot = name.rfind(".")
    return dot > 0 or (dot == 0 and name.count(".") > 1)


def corpus_files(paths):
    """ReadCorpus' files: each directory's regular, non-symlink files whose
    names have no extension (not fortune's .dat/.u8), and plain files as
    given; all sorted by path (bytewise)."""
    files = []
    for path in paths:
        if os.path.isdir(path):
            for entry in os.scandir(path):
                if entry.is_file() and not entry.is_symlink() and not _has_extension(entry.name):
                    files.append(os.path.join(path, entry.name))
        elif os.path.isfile(path):
            files.append(path)
        else:
            raise FileNotFoundError(f"text data {path} not found (install the `fortunes` package?)")
    return sorted(files, key=os.fsencode)


class TextDataset:
    """Byte windows of `context` + 1 from the corpus; the last
    validation_fraction of its bytes is held out."""

    def __init__(self, job):
        data = b"".join(open(f, "rb").read() for f in corpus_files(job.paths))
        if len(data) < (job.context + 2) / job.validation_fraction:
            raise ValueError(f"text corpus of {len(data)} bytes is too small for context "
                             f"{job.context}")
        total = len(data)
        val = int(total * job.validation_fraction)
        everything = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.train = everything[:total - val]
        self.val = everything[total - val:]
        self.seed = job.seed
        self.batch = job.microbatch_size
        self.context = job.context
        self.eval_batches = job.eval_batches

    def _windows(self, source, seed):
        rng = Mt19937_64(seed)
        span = source.numel() - self.context - 1  # as TextDataset: the last start never drawn
        starts = [rng() % span for _ in range(self.batch)]
        windows = torch.stack([source[s:s + self.context + 1] for s in starts]).to(torch.int64)
        return windows[:, :self.context].contiguous(), windows[:, 1:].contiguous()

    def train_microbatch(self, index):
        """(inputs, targets) of training microbatch `index` (step * microbatches + i)."""
        return self._windows(self.train, mix_seed(self.seed, 1, index))

    def eval_microbatch(self, index):
        return self._windows(self.val, mix_seed(self.seed, 2, index))


# --------------------------------------------------------------------------
# Model: worker/models.cc. The parameters are created in the C++ order, so
# each layer draws the same numbers from the same torch CPU generator state.


class GptEmbedding(torch.nn.Module):
    def __init__(self, context, d_model):
        super().__init__()
        # Embedding's own init draws N(0, 1) first (LibTorch's does too),
        # then the positions, then the token matrix is redrawn N(0, 0.02).
        self.tokens = torch.nn.Embedding(VOCAB, d_model)
        self.positions = torch.nn.Parameter(torch.randn(context, d_model) * 0.02)
        with torch.no_grad():
            self.tokens.weight.normal_(0.0, 0.02)

    def forward(self, tokens):
        return (F.embedding(tokens, self.tokens.weight)
                + self.positions[:tokens.size(1)].unsqueeze(0))


class GptBlock(torch.nn.Module):
    def __init__(self, context, d_model, heads, mlp_ratio):
        super().__init__()
        self.heads, self.width = heads, d_model
        self.norm1 = torch.nn.LayerNorm(d_model)
        self.qkv = torch.nn.Linear(d_model, 3 * d_model)
        self.proj = torch.nn.Linear(d_model, d_model)
        self.norm2 = torch.nn.LayerNorm(d_model)
        self.fc1 = torch.nn.Linear(d_model, mlp_ratio * d_model)
        self.fc2 = torch.nn.Linear(mlp_ratio * d_model, d_model)
        # A constant, not a buffer: DDP then has no buffers to synchronise.
        self.future = torch.triu(torch.ones(context, context), 1).to(torch.bool)

    def forward(self, x):
        batch, time = x.size(0), x.size(1)
        head_dim = self.width // self.heads
        h = F.layer_norm(x, (self.width,), self.norm1.weight, self.norm1.bias)  # eps 1e-5
        qkv = (F.linear(h, self.qkv.weight, self.qkv.bias)
               .view(batch, time, 3, self.heads, head_dim).permute(2, 0, 3, 1, 4))
        q, k, v = qkv[0], qkv[1], qkv[2]
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(head_dim)
        scores = scores.masked_fill(self.future[:time, :time], float("-inf"))
        mixed = torch.matmul(torch.softmax(scores, -1), v).transpose(1, 2).reshape(
            batch, time, self.width)
        y = x + F.linear(mixed, self.proj.weight, self.proj.bias)
        m = F.layer_norm(y, (self.width,), self.norm2.weight, self.norm2.bias)
        return y + F.linear(F.gelu(F.linear(m, self.fc1.weight, self.fc1.bias)),  # erf GELU
                            self.fc2.weight, self.fc2.bias)


class GptHead(torch.nn.Module):
    def __init__(self, d_model):
        super().__init__()
        self.width = d_model
        self.norm = torch.nn.LayerNorm(d_model)
        self.out = torch.nn.Linear(d_model, VOCAB)  # its own matrix: no tying

    def forward(self, x):
        return F.linear(F.layer_norm(x, (self.width,), self.norm.weight, self.norm.bias),
                        self.out.weight, self.out.bias)


class Gpt(torch.nn.Module):
    """Layers 0 .. blocks+1: embedding, blocks, head; logits [B, T, 256]."""

    def __init__(self, job):
        super().__init__()
        layers = []
        for i in range(job.blocks + 2):
            torch.manual_seed(layer_seed(job.seed, i))
            if i == 0:
                layers.append(GptEmbedding(job.context, job.d_model))
            elif i == job.blocks + 1:
                layers.append(GptHead(job.d_model))
            else:
                layers.append(GptBlock(job.context, job.d_model, job.heads, job.mlp_ratio))
        self.layers = torch.nn.ModuleList(layers)

    def forward(self, tokens):
        x = tokens
        for layer in self.layers:
            x = layer(x)
        return x


def compute_loss(logits, targets):
    """models.cc ComputeLoss: mean cross-entropy over every byte."""
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def parameter_count(model):
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------
# Optimizer: worker/optimizer.cc.


def learning_rate_scale(job, progress):
    """LearningRateScale: linear warm-up over warmup_fraction of the run's
    samples, then constant or cosine down to min_lr_fraction."""
    progress = min(max(progress, 0.0), 1.0)
    warmup = job.warmup_fraction
    if warmup > 0 and progress < warmup:
        return progress / warmup
    if job.decay != "DECAY_COSINE":
        return 1.0
    t = (progress - warmup) / (1 - warmup) if warmup < 1 else 1.0
    floor = job.min_lr_fraction
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t))


class AdamW:
    """geotrain's AdamW, applied in place: decoupled weight decay on every
    parameter (biases, norms and embeddings too), eps 1e-8 added to
    sqrt(v) as eps * sqrt(1 - beta2^t), no gradient clipping."""
    EPS = 1e-8

    def __init__(self, job, params):
        self.job = job
        self.params = list(params)
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]
        self.t = 0

    @torch.no_grad()
    def step(self, grads, lr_scale):
        self.t += 1
        job = self.job
        lr, b1, b2 = job.lr * lr_scale, job.beta1, job.beta2
        correction1 = 1 - b1 ** self.t
        correction2 = 1 - b2 ** self.t
        for p, g, m, v in zip(self.params, grads, self.m, self.v):
            m.lerp_(g, 1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = v.sqrt().add_(self.EPS * math.sqrt(correction2))
            p.mul_(1 - lr * job.weight_decay)
            p.addcdiv_(m, denom, value=-lr * math.sqrt(correction2) / correction1)


class Sgd:
    """geotrain's SGD: g + wd * p, optional momentum buffer, p - lr * g."""

    def __init__(self, job, params):
        self.job = job
        self.params = list(params)
        self.buffers = [None] * len(self.params)

    @torch.no_grad()
    def step(self, grads, lr_scale):
        lr = self.job.lr * lr_scale
        for i, (p, g) in enumerate(zip(self.params, grads)):
            g = g + self.job.weight_decay * p
            if self.job.momentum > 0:
                if self.buffers[i] is None:
                    self.buffers[i] = g.clone()
                else:
                    self.buffers[i].mul_(self.job.momentum).add_(g)
                g = self.buffers[i]
            p.copy_(p - lr * g)


def make_optimizer(job, params):
    return Sgd(job, params) if job.optimizer == "KIND_SGD" else AdamW(job, params)


# --------------------------------------------------------------------------
# Training and evaluation, as the sync pipeline does them.


def microbatch_ids(job, step):
    """Training microbatches of 0-based `step`, in the order sync runs them."""
    return range(step * job.microbatches, (step + 1) * job.microbatches)


def progress_after(job, step):
    """Learning-rate schedule position at the update ending 0-based `step`."""
    return ((step + 1) * job.microbatches) / (float(job.steps) * job.microbatches)


@torch.no_grad()
def evaluate(model, data, job, batches=None):
    """Mean loss over every byte of eval microbatches `batches` (default
    all eval_batches); returns (loss_sum, elements), summed in double as
    StageRuntime::EvalForward does."""
    loss_sum, elements = 0.0, 0
    for i in (range(job.eval_batches) if batches is None else batches):
        inputs, targets = data.eval_microbatch(i)
        n = targets.numel()
        loss_sum += compute_loss(model(inputs), targets).item() * n
        elements += n
    return loss_sum, elements


def eval_due(job, done):
    """Whether geotrain evaluates after the update of 1-based step `done`."""
    return done == job.steps or (job.eval_every > 0 and done % job.eval_every == 0)


class SyncTrainer:
    """One process doing what geotrain's sync pipeline does, a step at a time."""

    def __init__(self, job, model=None, data=None):
        self.job = job
        self.model = model or Gpt(job)
        self.data = data or TextDataset(job)
        self.params = list(self.model.parameters())
        self.optimizer = make_optimizer(job, self.params)

    def step(self, step):
        """Trains 0-based `step`; returns (mean microbatch loss, lr scale)."""
        grad_sum, count, loss_sum = None, 0, 0.0
        for g in microbatch_ids(self.job, step):
            inputs, targets = self.data.train_microbatch(g)
            loss = compute_loss(self.model(inputs), targets)
            grads = torch.autograd.grad(loss, self.params)
            if grad_sum is None:
                grad_sum = list(grads)  # the first kept as is, later ones added
            else:
                for s, d in zip(grad_sum, grads):
                    s.add_(d)
            count += 1
            loss_sum += loss.item()
        if count > 1:
            for s in grad_sum:
                s.div_(float(count))
        scale = learning_rate_scale(self.job, progress_after(self.job, step))
        self.optimizer.step(grad_sum, scale)
        return loss_sum / count, scale

    def validation_loss(self):
        s, n = evaluate(self.model, self.data, self.job)
        return s / n


def train(job, steps=None, with_eval=True):
    """Trains single-process as geotrain's sync schedule does and yields
    one dict per step: {"step" (1-based), "loss", "lr_scale"}, plus
    "val_loss" where geotrain evaluates (every eval_every steps and at the
    last, after that step's update) when `with_eval`. `steps` stops early
    without changing the schedule (which runs over job.steps)."""
    trainer = SyncTrainer(job)
    for step in range(job.steps if steps is None else steps):
        loss, scale = trainer.step(step)
        record = {"step": step + 1, "loss": loss, "lr_scale": scale}
        if with_eval and eval_due(job, step + 1):
            record["val_loss"] = trainer.validation_loss()
        yield record
