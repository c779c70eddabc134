"""The shipped jobs learn: the demo GPT on 3 workers and the Fashion-MNIST
MLP on 2 workers, run in full over real processes."""
import unittest

from cluster import Cluster, job_path


def run_job(test, job, workers):
    with Cluster(job_path(job)) as c:
        c.start_coordinator()
        for i in range(workers):
            c.start_worker(f"w{i}")
        try:
            c.wait_done(timeout=900)
        except Exception:
            print(c.dump_logs())
            raise
        test.assertEqual(len(c.status()["workers"]), workers)
        return c.steps(), c.evals()


class ConvergenceTest(unittest.TestCase):
    def test_demo_gpt_on_three_workers(self):
        steps, evals = run_job(self, "gpt-tiny.textproto", 3)
        first = steps[0]["loss"]
        last = sum(m["loss"] for m in steps[-10:]) / 10
        drop = 1 - last / first
        print(f"gpt-tiny: {len(steps)} steps, loss {first:.3f} -> {last:.3f} "
              f"(mean of last 10), drop {drop:.1%}, val_loss {evals[-1]['val_loss']:.3f}, "
              f"{steps[-1]['samples'] / steps[-1]['time_s']:.0f} samples/s")
        self.assertGreaterEqual(drop, 0.40)

        # Resident memory of every worker between step 20 and the last step.
        at20 = next(m for m in steps if m["step"] == 20)["rss_bytes"]
        final = steps[-1]["rss_bytes"]
        for name, rss in at20.items():
            growth = final[name] / rss - 1
            print(f"  {name}: RSS {rss / 2**20:.1f} MiB at step 20, "
                  f"{final[name] / 2**20:.1f} MiB at step {steps[-1]['step']} ({growth:+.1%})")
            self.assertLessEqual(growth, 0.10, f"{name} grew {growth:.1%}")

    def test_fashion_mnist_mlp_on_two_workers(self):
        steps, evals = run_job(self, "fmnist-mlp.textproto", 2)
        accuracy = evals[-1]["accuracy"]
        print(f"fmnist-mlp: {len(steps)} steps, {steps[-1]['samples']} samples, "
              f"test accuracy {accuracy:.4f} on {evals[-1]['samples']} images, "
              f"val_loss {evals[-1]['val_loss']:.4f}")
        self.assertEqual(evals[-1]["samples"], 10000)
        self.assertGreaterEqual(accuracy, 0.85)


if __name__ == "__main__":
    unittest.main(verbosity=2)
