"""`python -m bench <scenario> [options]`: benchmarks that print ratios against a baseline measured
in the same run and write bench/results/<scenario>.json."""
from __future__ import annotations

import logging
import os
import sys

SCENARIOS = {
    "autoscale": "bench.autoscale_bench",
    "choices": "bench.choices_bench",
    "engine": "bench.engine_bench",
    "formats": "bench.formats_bench",
    "plato": "bench.plato_bench",
    "prediction": "bench.prediction_bench",
    "judge": "bench.judge",
    "priority": "bench.priority_bench",
    "routing": "bench.routing_bench",
    "schedule": "bench.schedule_bench",
    "schedule-sim": "bench.schedule_sim",
    "scoring": "bench.scoring_bench",
    "serve": "bench.serve_bench",
    "steps": "bench.step_bench",
    "stream": "bench.stream_bench",
    "turns": "bench.turns_bench",
}


def main(argv: list[str]) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(level=logging.WARNING)
    if not argv or argv[0] not in SCENARIOS:
        print(f"usage: python -m bench {{{','.join(SCENARIOS)}}} [--quick] [options]", file=sys.stderr)
        return 2
    import importlib

    importlib.import_module(SCENARIOS[argv[0]]).run(argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
