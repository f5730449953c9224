"""Run every kernel benchmark in one process and print (and optionally save) one markdown table.

Usage: ``python bench/bench_all.py [--json PATH] [--markdown PATH]`` on a machine with a CUDA
device; the header states the device and library versions the figures were measured with.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_decode_attention
import bench_gated_rms_norm
import bench_gdn_gates
import bench_glu
import bench_rms_norm
from bench_common import markdown

BENCHES = (bench_rms_norm, bench_glu, bench_gated_rms_norm, bench_gdn_gates, bench_decode_attention)


def environment() -> dict[str, str]:
    import transformers

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", type=Path, help="write the rows and environment as JSON here")
    parser.add_argument("--markdown", type=Path, help="write the markdown table here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_all needs a CUDA device")
    env = environment()
    rows = [r for bench in BENCHES for r in bench.bench()]
    text = "\n".join(f"- {k}: {v}" for k, v in env.items()) + "\n\n" + markdown(rows)
    print(text)
    if args.json:
        args.json.write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
    if args.markdown:
        args.markdown.write_text(text + "\n")


if __name__ == "__main__":
    main()
