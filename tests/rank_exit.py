"""`python -m rank_exit ARGS`: `blockdraft ARGS` as `blockdraft`'s entry runs it, the exit code also
written to $RANK_EXIT_DIR/rank-$RANK, for tests that launch ranks under torchrun, which reports no rank's
code when it is itself signalled."""

import os
import sys
from pathlib import Path

from blockdraft.cli import exit_after_group, main

rc = main(sys.argv[1:])
Path(os.environ["RANK_EXIT_DIR"], f"rank-{os.environ.get('RANK', '0')}").write_text(str(rc))
exit_after_group(rc)
sys.exit(rc)
