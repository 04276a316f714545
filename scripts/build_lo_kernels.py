#!/usr/bin/env python3
"""Build the lo kernels (`csrc/lo_mma.cu`, or the sources given, each with the headers it includes)
into the kernel cache, as `lo_cuda.build` would on first use: a GPU machine's first run then does not
wait ~20 s for nvcc, and a source edited by hand is checked to compile.

    python scripts/build_lo_kernels.py [SOURCE.cu ...] [--arch 90]

`--arch` defaults to the CUDA device's ("90" for sm_90); with it given, no GPU is needed, only nvcc.
Prints each library's path; a missing source, a failed build or no nvcc is one line on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from moetide.compute import lo_cuda


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sources", nargs="*", type=Path, default=[lo_cuda.SOURCE])
    ap.add_argument("--arch", default=None, help='e.g. "90"; default: the CUDA device\'s')
    args = ap.parse_args()
    missing = [str(s) for s in args.sources if not s.is_file()]
    if missing:
        print(f"build_lo_kernels: no such source: {', '.join(missing)}", file=sys.stderr)
        return 2
    compiler = lo_cuda.nvcc()
    if compiler is None:
        print("build_lo_kernels: no nvcc (PATH, CUDA_HOME)", file=sys.stderr)
        return 2
    arch = args.arch
    if arch is None:
        import torch

        if not torch.cuda.is_available():
            print("build_lo_kernels: no CUDA device; give --arch", file=sys.stderr)
            return 2
        arch = "".join(str(v) for v in torch.cuda.get_device_capability())
    with ThreadPoolExecutor(max_workers=len(args.sources)) as pool:  # each build is an nvcc process
        builds = [pool.submit(lo_cuda.build, arch, compiler, lo_cuda.cache_dir(), s) for s in args.sources]
    try:
        for done in builds:
            print(done.result())
    except RuntimeError as error:
        print(f"build_lo_kernels: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
