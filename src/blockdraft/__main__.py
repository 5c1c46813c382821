"""`python -m blockdraft` (and `torchrun -m blockdraft`) == the `blockdraft` command."""

import sys

from .cli import entry

if __name__ == "__main__":  # engines that spawn processes (vLLM) re-import the main module
    sys.exit(entry())
