"""The shipped jobs learn under every schedule: the demo GPT on 3 workers
(sync, async-stash, and sync with int8 on every link) and the Fashion-MNIST
MLP on 2 workers, over real processes.

The MLP runs 3 of its job's 5 epochs, to keep CI under its 45 minutes
(9 runs in 155 s, 0.867-0.877 test accuracy; after 2 epochs they measured
0.853-0.867, too close to the 0.85 bound). The GPT runs its job in full: at 200 steps
async-stash's validation loss measured -1.9% and -2.9% of sync's, too close
to the 3% bound (-0.6% at 300 steps)."""
import unittest

from cluster import Cluster, job_path


def run_job(test, job, workers, schedule="sync", flags=()):
    # Join order: every worker holds a stage of the schedule under test, and
    # int8 is on every link (the network planner may leave a worker out
    # and leave fast links uncompressed).
    with Cluster(job_path(job), [f"--schedule={schedule}", "--planner=join-order"]
                 + list(flags)) as c:
        status = c.train(workers).status()
        test.assertEqual(len(status["workers"]), workers)
        for w in status["workers"]:
            test.assertEqual(w["schedule"], schedule)
        return c.steps(), c.evals(), status


def fitted_growth(points):
    """The least-squares line through (step, value) points: its rise from the
    first step to the last, as a fraction of its start, and both ends."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sxx
    first, last = points[0][0], points[-1][0]
    start = mean_y + slope * (first - mean_x)
    end = mean_y + slope * (last - mean_x)
    return end / start - 1, start, end


MLP_STEPS = ["--steps=1410"]  # 3 epochs of 60k at 128 samples a step


class ConvergenceTest(unittest.TestCase):
    def test_demo_gpt_on_three_workers(self):
        steps, evals, _ = run_job(self, "gpt-tiny.textproto", 3)
        first = steps[0]["loss"]
        last = sum(m["loss"] for m in steps[-10:]) / 10
        drop = 1 - last / first
        sync_val = evals[-1]["val_loss"]
        print(f"gpt-tiny sync: {len(steps)} steps, loss {first:.3f} -> {last:.3f} "
              f"(mean of last 10), drop {drop:.1%}, val_loss {sync_val:.4f}, "
              f"{steps[-1]['samples'] / steps[-1]['time_s']:.0f} samples/s")
        self.assertGreaterEqual(drop, 0.40)

        # Resident memory of every worker, judged by its trend. A heartbeat
        # samples RSS at a random point of a step, and within one step it
        # moves by up to 100 MiB (the microbatches' saved activations, the
        # allocator's arenas): w0 read 229-321 MiB over one 300-step run,
        # and the peak of steps 20-100 against that of the last 100 read
        # -16% in one run and +17% in the next with nothing leaking, and
        # +42% once in CI. A least-squares line through every sample from
        # step 20 averages that out (about 5 MiB of standard error over
        # 280 samples); a leak moves the whole line. Clean runs have read
        # from -1.2% to +16.4% this way (2026-12-07, six runs: one worker's
        # line rose by 34-39 MiB over the run in two of them, every other
        # under 8%); whether such a rise levels off over an hour is for the
        # soak test to measure. A bound of 25% still fails what a leak of a copy
        # per message does (+204% with the commitment log's byte bound
        # removed).
        last = steps[-1]["step"]
        for name in steps[-1]["rss_bytes"]:
            points = [(m["step"], m["rss_bytes"][name] / 2**20) for m in steps
                      if m["step"] >= 20 and name in m["rss_bytes"]]
            growth, start, end = fitted_growth(points)
            peak_early = max(r for s, r in points if s <= 100)
            peak_late = max(r for s, r in points if s > last - 100)
            print(f"  {name}: RSS trend {start:.1f} -> {end:.1f} MiB over steps 20-{last} "
                  f"({growth:+.1%}); peaks {peak_early:.1f} (steps 20-100), "
                  f"{peak_late:.1f} (last 100)")
            self.assertLessEqual(growth, 0.25, f"{name} grew {growth:.1%}")

        # async-stash after the same number of samples: within 3% of sync.
        a_steps, a_evals, status = run_job(self, "gpt-tiny.textproto", 3, "async-stash")
        self.assertEqual(a_steps[-1]["samples"], steps[-1]["samples"])
        async_val = a_evals[-1]["val_loss"]
        print(f"gpt-tiny async-stash: val_loss {async_val:.4f} vs sync {sync_val:.4f} "
              f"({async_val / sync_val - 1:+.2%}), "
              f"{a_steps[-1]['samples'] / a_steps[-1]['time_s']:.0f} samples/s")
        # The claim is that async-stash loses at most 3% against sync. It has
        # also ended better by more than that, with nothing wrong: its
        # staleness follows the stages' timing on the machine, and fresh
        # runs read -3.17% and -3.01% (as well as +0.37% and -0.6%). A
        # result far better than sync would mean something other than the
        # same model was evaluated, so that side keeps a bound too, at twice
        # the largest seen.
        self.assertLessEqual(async_val / sync_val - 1, 0.03)
        self.assertGreaterEqual(async_val / sync_val - 1, -0.065)
        stage0 = next(w for w in status["workers"] if w["stage"] == 0)
        self.assertGreater(int(stage0["staleness_max"]), 0)
        self.assertLessEqual(stage0["max_weight_versions"], 3)

        # int8 both ways (sync, the same samples) ends within 2% of none's
        # validation loss. It shares the sync run above with this test rather
        # than repeating it in the codecs suite (one 300-step run less).
        _, i_evals, status = run_job(self, "gpt-tiny.textproto", 3, "sync",
                                     ["--activation_codec=int8", "--gradient_codec=int8"])
        for w in status["workers"]:
            for link in w["links"]:
                self.assertEqual(link["codec"], "int8", link)
        int8_val = i_evals[-1]["val_loss"]
        print(f"gpt-tiny int8: val_loss {int8_val:.4f} vs none {sync_val:.4f} "
              f"({int8_val / sync_val - 1:+.2%})")
        self.assertLessEqual(abs(int8_val / sync_val - 1), 0.02)

    # One seed's final accuracy moves by up to a point with the BLAS kernel
    # alone (async-2bw, seed 1: 0.8721 with OpenBLAS's Prescott kernel,
    # 0.8637 with its AVX2 ones; sync 0.8729 and 0.8745), so each schedule
    # is judged by its mean over three seeds.
    SEEDS = (1, 2, 3)

    def test_fashion_mnist_mlp_on_two_workers(self):
        accuracy = {}
        for schedule in ("sync", "async-stash", "async-2bw"):
            runs = []
            for seed in self.SEEDS:
                steps, evals, _ = run_job(self, "fmnist-mlp.textproto", 2, schedule,
                                          MLP_STEPS + [f"--seed={seed}"])
                runs.append(evals[-1]["accuracy"])
                print(f"fmnist-mlp {schedule} seed {seed}: {len(steps)} steps, "
                      f"{steps[-1]['samples']} samples, test accuracy {runs[-1]:.4f} on "
                      f"{evals[-1]['samples']} images, val_loss {evals[-1]['val_loss']:.4f}",
                      flush=True)
                self.assertEqual(evals[-1]["samples"], 10000)
                self.assertGreaterEqual(runs[-1], 0.85, f"{schedule} seed {seed}")
            accuracy[schedule] = sum(runs) / len(runs)
            print(f"fmnist-mlp {schedule}: mean test accuracy {accuracy[schedule]:.4f}")
        for schedule in ("async-stash", "async-2bw"):
            self.assertLessEqual(abs(accuracy[schedule] - accuracy["sync"]), 0.01, schedule)


if __name__ == "__main__":
    unittest.main(verbosity=2)
