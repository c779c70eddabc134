"""Compressed activations and gradients on real links: wire bytes per
sample of the demo job under each codec, against none."""
import unittest

from cluster import Cluster, job_path


def wire_bytes(test, codec):
    with Cluster(job_path("gpt-tiny.textproto"),
                 ["--steps=6", f"--activation_codec={codec}", f"--gradient_codec={codec}"]) as c:
        status = c.train(3, timeout=300).status()
        sent = raw = 0
        for w in status["workers"]:
            for link in w["links"]:
                test.assertEqual(link["codec"], codec)
                test.assertIn(link["direction"], ("upstream", "downstream"))
                test.assertTrue(link["peer"].startswith("127.0.0.1:"))
                sent += int(link["bytes_sent"])
                raw += int(link["raw_bytes_sent"])
                test.assertGreater(link["goodput_bps"], 0)
        test.assertEqual(len([l for w in status["workers"] for l in w["links"]]), 4)
        samples = int(status["samples"])
        return sent / samples, raw / samples, status["loss"]


class CodecWireTest(unittest.TestCase):
    def test_wire_bytes_per_sample(self):
        results = {codec: wire_bytes(self, codec) for codec in ("none", "fp16", "int8", "int4")}
        none = results["none"][0]
        for codec, (sent, raw, loss) in results.items():
            print(f"{codec:5s}: {sent:10.0f} wire bytes/sample ({sent / none:.3f}x of none), "
                  f"raw {raw:.0f}, loss after 6 steps {loss:.3f}")
        self.assertLessEqual(results["fp16"][0] / none, 0.51)
        self.assertLessEqual(results["int8"][0] / none, 0.27)
        self.assertLess(results["int4"][0], results["int8"][0])
        for codec in ("fp16", "int8", "int4"):  # it still trains
            self.assertLess(results[codec][2], 5.0)


    def test_int8_converges_like_none(self):
        """The demo GPT with int8 both ways ends within 2% of none's
        validation loss after the same samples."""
        val = {}
        for codec in ("none", "int8"):
            with Cluster(job_path("gpt-tiny.textproto"),
                         [f"--activation_codec={codec}", f"--gradient_codec={codec}"]) as c:
                val[codec] = c.train(3).evals()[-1]["val_loss"]
        print(f"gpt-tiny val_loss: none {val['none']:.4f}, int8 {val['int8']:.4f} "
              f"({val['int8'] / val['none'] - 1:+.2%})")
        self.assertLessEqual(abs(val["int8"] / val["none"] - 1), 0.02)


if __name__ == "__main__":
    unittest.main(verbosity=2)
