"""Re-save the bundled drafter in the layout engines load unchanged (issue 33 item 8).

The committed directory stores its draft vocabulary as `draft_vocab` ids, which vLLM refuses ("no
module or parameter named draft_vocab"). `save_drafter` now writes `d2t` offsets and the target
head's rows for the draft ids (`lm_head.weight`), the bytes `convert --to zlab` writes. This
loads the drafter, loads SmolLM2 as the CLI does, writes the drafter with `save_drafter` in bf16
into a temporary directory beside the asset, checks it, and moves model.safetensors into the
asset. config.json is kept as committed (the layout change is in the weights only; the script
checks that the committed config reads back as the same drafter config as a fresh one and
prints a fresh one's differences, if any). The asset carries no ownership marker, and none is
added.

    python benchmarks/resave_default_drafter.py            # in place
    python benchmarks/resave_default_drafter.py --out DIR  # a copy in DIR instead (the asset untouched)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path


def main() -> None:
    import torch
    from safetensors.torch import load_file

    from blockdraft.checkpoint.native import CONFIG, DEFAULT_DRAFTER, WEIGHTS, load_drafter, read_config, save_drafter
    from blockdraft.engines.exports import convert
    from blockdraft.target import TargetModel

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the re-saved directory here instead of replacing the asset's weights")
    a = p.parse_args()
    asset = DEFAULT_DRAFTER
    old = load_file(str(asset / WEIGHTS))
    print(f"{asset / WEIGHTS}: {(asset / WEIGHTS).stat().st_size} bytes")
    if "draft_vocab" not in old:
        print(f"{asset / WEIGHTS} already holds {sorted(k for k in old if k in ('d2t', 'lm_head.weight'))}; "
              "nothing to do")
        return
    drafter = load_drafter(asset)  # fp32: the bf16 weights widen exactly and narrow back to the same bits
    target = TargetModel.from_pretrained("smollm2", layer_ids=drafter.config.target_layer_ids, device="cpu")
    rows = target.head_rows(drafter.draft_vocab)

    work = Path(tempfile.mkdtemp(prefix=".resave-", dir=asset.parent))  # same file system: os.replace is atomic
    try:
        new_dir = save_drafter(drafter, work / "drafter", head_rows=rows, dtype=torch.bfloat16, owner="resave")
        new = load_file(str(new_dir / WEIGHTS))
        # every trained tensor bit for bit, the ids as d2t, the head rows the target's own
        assert set(new) == (set(old) - {"draft_vocab"}) | {"d2t", "lm_head.weight"}, sorted(new)
        for k, v in old.items():
            if k != "draft_vocab":
                assert v.dtype == new[k].dtype and torch.equal(v, new[k]), k
        assert torch.equal(torch.arange(new["d2t"].numel()) + new["d2t"], old["draft_vocab"])
        assert new["lm_head.weight"].dtype == torch.bfloat16
        assert torch.equal(new["lm_head.weight"], rows.to(torch.bfloat16))
        # what `convert --to zlab` makes of the committed directory: the same tensors
        convert(asset, work / "zlab", "zlab")
        zl = load_file(str(work / "zlab" / WEIGHTS))
        assert zl.keys() == new.keys() and all(torch.equal(zl[k], new[k]) for k in zl)
        # the committed config with the new weights is the same drafter
        fresh, committed = json.loads((new_dir / CONFIG).read_text()), json.loads((asset / CONFIG).read_text())
        differ = sorted(k for k in fresh.keys() | committed.keys() if fresh.get(k) != committed.get(k))
        differ += sorted(f"blockdraft.{k}" for k in fresh.get("blockdraft", {}).keys() | committed.get("blockdraft", {})
                         if fresh.get("blockdraft", {}).get(k) != committed.get("blockdraft", {}).get(k))
        if differ:
            print(f"config.json kept as committed; a fresh one differs in {differ}")
        assert read_config(new_dir)[1] == read_config(asset)[1], "the committed config reads as another drafter"
        shutil.copyfile(asset / CONFIG, new_dir / CONFIG)
        back = load_drafter(new_dir)
        assert torch.equal(back.draft_vocab, drafter.draft_vocab)
        assert all(torch.equal(v, drafter.state_dict()[k]) for k, v in back.state_dict().items())

        if a.out:
            out = Path(a.out)
            out.mkdir(parents=True, exist_ok=True)
            for f in (CONFIG, WEIGHTS):
                shutil.copyfile(new_dir / f, out / f)
            dest = out
        else:
            os.replace(new_dir / WEIGHTS, asset / WEIGHTS)  # config.json: unchanged
            dest = asset
    finally:
        shutil.rmtree(work, ignore_errors=True)
    size = (dest / WEIGHTS).stat().st_size
    print(f"wrote {dest / WEIGHTS}: {size} bytes ({size / 2**20:.2f} MiB)")


if __name__ == "__main__":
    main()
