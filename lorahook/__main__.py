"""``python -m lorahook``: the same command line as the ``lorahook`` script."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
