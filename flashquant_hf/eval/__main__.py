"""``python -m flashquant_hf.eval``: the same as ``flashquant-hf ppl``."""

import sys

from .command import main

if __name__ == "__main__":
    sys.exit(main())
