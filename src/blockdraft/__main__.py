"""`python -m blockdraft` (and `torchrun -m blockdraft`) == the `blockdraft` command."""

import sys

from .cli import main

sys.exit(main())
