"""Side-by-side comparison: lorahook vs numpy, PyTorch and PEFT (``lorahook.cli.bench``, the harness behind ``lorahook bench``).

    python benchmarks/compare.py [--quick]
"""
import sys

from lorahook.cli.bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
