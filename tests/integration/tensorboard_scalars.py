"""Reads a TensorBoard log directory with the stock PyPI tensorboard
package's EventAccumulator (run under the test tools' venv,
deploy/install-test-tools.sh) and prints every scalar series as JSON:
{"tag": [[step, value], ...], ...}.

  tensorboard_scalars.py DIR
"""
import json
import sys

from tensorboard.backend.event_processing.event_accumulator import (
    SCALARS, EventAccumulator)


def main():
    accumulator = EventAccumulator(sys.argv[1], size_guidance={SCALARS: 0})  # keep every point
    accumulator.Reload()
    print(json.dumps({tag: [[e.step, e.value] for e in accumulator.Scalars(tag)]
                      for tag in accumulator.Tags()[SCALARS]}))


if __name__ == "__main__":
    main()
