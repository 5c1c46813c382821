"""Experiment trackers beside metrics.jsonl (`blockdraft train --report-to tensorboard,trackio,wandb,mlflow`).

Every figure a metrics.jsonl line holds goes to each tracker under the same name and step (a list,
such as eval_slot_accuracy, as NAME/0, NAME/1, ...; a text value, gamma "dpace", is not a figure),
and the run's settings (train_config.json's record) once per tracker run. All four work offline and
write inside the run directory, whatever the environment says: TensorBoard's event files in
tensorboard/, trackio's local store in trackio/ (its TRACKIO_DIR), W&B's offline runs in wandb/
(never online), MLflow's file store in mlruns/ (a file: URI, never a server). Only rank 0 reports.
Each library is imported only when asked for: blockdraft imports and trains without any of them.

A tracker that cannot start, or fails later, is one warning and the run goes on without it;
--report-required makes it one error instead (and one before any work when its library is
missing).

Steps reach TensorBoard as they are logged. The others get each step once the checkpoint after it
is written (and at the end): after a kill they hold exactly the steps --resume keeps, so a resumed
run never reports a step twice. TensorBoard continues in the same directory and marks the resume
(purge_step), so its readers drop the killed run's steps after the checkpoint. On --resume, MLflow
continues the same run and trackio the same run name (trackers.json keeps which); W&B writes a new
offline run directory under the same run id, marked resumed (W&B does not resume offline runs).
A tracker named for the first time on --resume starts a new run there, with the settings.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import json
import math
import os
import sys
from pathlib import Path

KINDS = ("tensorboard", "trackio", "wandb", "mlflow")
MODULES = {"tensorboard": "tensorboard", "trackio": "trackio", "wandb": "wandb", "mlflow": "mlflow"}
EXTRAS = {"tensorboard": "tensorboard", "trackio": "trackio", "wandb": "wandb", "mlflow": "mlflow"}
STATE = "trackers.json"  # which tracker runs this run directory continues
DIRS = {"tensorboard": "tensorboard", "trackio": "trackio", "wandb": "wandb", "mlflow": "mlruns"}
PROJECT = "blockdraft"


def parse_report_to(text: str) -> list[str]:
    """The trackers --report-to names ("none": none), in the order given, each once."""
    names = [n.strip().lower() for n in str(text).split(",") if n.strip()]
    if names == ["none"]:
        return []
    if not names:  # blanks and commas only: a mistake, not a way to say none
        raise ValueError(f"--report-to: no tracker named in {str(text)!r}; choose from {', '.join(KINDS)} "
                         "(comma-separated) or none")
    bad = [n for n in names if n not in KINDS]
    if bad:
        raise ValueError(f"--report-to: unknown tracker {', '.join(map(repr, bad))}; choose from {', '.join(KINDS)} "
                         "(comma-separated) or none")
    return list(dict.fromkeys(names))


def check_installed(report_to: str, required: bool) -> None:
    """--report-required: every tracker's library is installed, said before any work."""
    if not required:
        return
    missing = [n for n in parse_report_to(report_to) if importlib.util.find_spec(MODULES[n]) is None]
    if missing:
        raise ValueError(f"--report-required: {', '.join(missing)} is not installed; pip install "
                         f"'blockdraft[{','.join(EXTRAS[n] for n in missing)}]' or drop it from --report-to")


def figures(record: dict) -> dict[str, float]:
    """A metrics.jsonl record's figures: numbers under their names, a list's items as NAME/i."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key == "step":
            continue
        items = enumerate(value) if isinstance(value, (list, tuple)) else [(None, value)]
        for i, v in items:
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                out[key if i is None else f"{key}/{i}"] = float(v)
    return out


def flat_settings(record: dict) -> dict[str, str]:
    """The run's settings as PART.NAME -> text (MLflow's params are text)."""
    return {f"{part}.{k}": json.dumps(v) if not isinstance(v, str) else v
            for part, values in record.items() for k, v in values.items()}


class TensorBoard:
    live = True

    def __init__(self, out: Path, settings: dict, state: dict, resumed_at: int | None, continued: bool):
        from torch.utils.tensorboard import SummaryWriter

        quiet_writer_threads()
        purge = resumed_at + 1 if resumed_at is not None else None  # hides the killed run's later steps
        self.writer = SummaryWriter(str(out / DIRS["tensorboard"]), purge_step=purge)
        if not continued:  # indented: one Markdown code block, and still JSON
            self.writer.add_text("settings", "    " + json.dumps(settings, indent=1).replace("\n", "\n    "), 0)
            self.writer.flush()

    def log(self, step: int, figs: dict) -> None:
        for k, v in figs.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def quiet_writer_threads() -> None:
    """TensorBoard's event writer thread keeps a failed write (a full disk) for the next write or flush,
    which raises it here (one warning: `Trackers`), and then raises it again itself, which Python prints
    as a 17-line traceback before that line. Its thread's failures are left to the write that reports
    them; every other thread's still reach the hook that was there."""
    import threading

    from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread

    before = threading.excepthook
    if getattr(before, "leaves_tensorboard_writers", False):
        return

    def hook(args) -> None:
        if isinstance(args.thread, _AsyncWriterThread) and isinstance(args.exc_value, Exception):
            return
        before(args)

    hook.leaves_tensorboard_writers = True
    threading.excepthook = hook


class MLflow:
    live = False

    def __init__(self, out: Path, settings: dict, state: dict, resumed_at: int | None, continued: bool):
        os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"  # MLflow's usage reports would leave the machine
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = (out / DIRS["mlflow"]).resolve().as_uri()  # never MLFLOW_TRACKING_URI: nothing leaves the run
        with _env(MLFLOW_ALLOW_FILE_STORE="true"):  # MLflow 3 keeps its file store behind this switch
            self.client = MlflowClient(tracking_uri=uri)
            exp = self.client.get_experiment_by_name(PROJECT)
            eid = exp.experiment_id if exp else self.client.create_experiment(PROJECT)
        if state.get("run_id"):
            self.run_id = state["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = state["run_id"] = self.client.create_run(eid, run_name=out.resolve().name).info.run_id
        if not continued:
            params = [Param(k, v) for k, v in flat_settings(settings).items()]
            for i in range(0, len(params), 100):  # MLflow takes 100 params a call
                self.client.log_batch(self.run_id, params=params[i:i + 100])

    def log(self, step: int, figs: dict) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in figs.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class Wandb:
    live = False

    def __init__(self, out: Path, settings: dict, state: dict, resumed_at: int | None, continued: bool):
        import uuid

        os.environ["WANDB_ERROR_REPORTING"] = "false"  # W&B's crash reports would leave the machine
        import wandb

        state.setdefault("id", uuid.uuid4().hex[:8])
        s = wandb.Settings(mode="offline", silent=True, console="off", x_disable_stats=True, disable_git=True,
                           save_code=False, x_save_requirements=False)
        self.run = wandb.init(project=PROJECT, name=out.resolve().name, id=state["id"], dir=str(out),
                              config=None if continued else settings, settings=s,
                              resume="allow" if continued else None,
                              reinit="create_new")

    def log(self, step: int, figs: dict) -> None:
        self.run.log(figs, step=step)

    def close(self) -> None:
        self.run.finish()


class Trackio:
    """trackio keeps one config per run, sent with the first step after each start: the settings go
    with every start (a resumed run's would be replaced by none), still one record of them."""

    live = False

    def __init__(self, out: Path, settings: dict, state: dict, resumed_at: int | None, continued: bool):
        store = (out / DIRS["trackio"]).resolve()
        remote = [v for v in ("TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL") if os.environ.get(v)]
        if remote:
            raise RuntimeError(f"{' and '.join(remote)} set: blockdraft reports to trackio's local store only; unset it")
        if "trackio" in sys.modules:
            from trackio.utils import TRACKIO_DIR
            if Path(TRACKIO_DIR).resolve() != store:
                raise RuntimeError(f"trackio was imported before, with its store at {TRACKIO_DIR}; it keeps that one")
        with _env(TRACKIO_DIR=str(store)):  # read once, at trackio's import
            import trackio
        import huggingface_hub.constants

        # trackio asks the Hub who the user is (whoami) at every start: offline, it is told no one
        os.environ["HF_HUB_OFFLINE"] = "1"
        huggingface_hub.constants.HF_HUB_OFFLINE = True
        state.setdefault("name", out.resolve().name)
        with contextlib.redirect_stdout(sys.stderr):  # its notices; stdout is the run's summary
            self.run = trackio.init(project=PROJECT, name=state["name"], config=settings, embed=False,
                                    resume="must" if continued else "never", auto_log_cpu=False, auto_log_gpu=False)

    def log(self, step: int, figs: dict) -> None:
        self.run.log(figs, step=step)

    def sync(self) -> None:
        """What was logged, in trackio's store now. trackio queues logs and a thread writes them every
        0.5 s, so a kill -9 just after a checkpoint lost the steps before it (14 over 5 kills of a
        --save-every 1 run). trackio 0.43 has no public flush: this runs its thread's own write, under
        the lock that thread takes."""
        write, lock = getattr(self.run, "_flush_queues_inline", None), getattr(self.run, "_client_lock", None)
        if write is None or lock is None:
            raise RuntimeError("this trackio version cannot be told to write its logged steps now (tested: 0.43)")
        with lock:
            write()

    def close(self) -> None:
        with contextlib.redirect_stdout(sys.stderr):
            self.run.finish()


OPENERS = {"tensorboard": TensorBoard, "trackio": Trackio, "wandb": Wandb, "mlflow": MLflow}


class _env:
    """Environment variables set for a block, then restored."""

    def __init__(self, **values: str):
        self.values, self.saved = values, {}

    def __enter__(self):
        self.saved = {k: os.environ.get(k) for k in self.values}
        os.environ.update(self.values)

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Trackers:
    """The trackers of one run (rank 0): `report` each logged record, `flush` after each checkpoint,
    `close` at the end (a process that dies closes them without flushing: atexit)."""

    def __init__(self, names: list[str], out: Path, settings: dict, *, resumed_at: int | None = None,
                 required: bool = False):
        self.out, self.required = Path(out), required
        self.open: dict = {}
        self.pending: list[tuple[int, dict]] = []
        state = read_state(self.out) if resumed_at is not None else {}
        for name in names:
            mine = state.setdefault(name, {})
            continued = resumed_at is not None and bool(mine)
            try:  # a tracker continuing its run has the settings already
                self.open[name] = OPENERS[name](self.out, settings, mine, resumed_at, continued)
                mine["started"] = True
            except Exception as e:  # noqa: BLE001 -- a tracker's own failure, whatever its kind
                state.pop(name)
                self._failed(name, "could not start", e)
        if self.open:
            from .ownership import replace_text

            replace_text(self.out / STATE, json.dumps(state, indent=1))
            atexit.register(self.close, flush=False)

    def _failed(self, name: str, what: str, e: BaseException) -> None:
        why = " ".join(f"{type(e).__name__}: {e}".split())[:300]
        if isinstance(e, ImportError):
            why += f" (pip install 'blockdraft[{EXTRAS[name]}]')"
        if self.required:
            raise ValueError(f"--report-to {name} {what} ({why}); --report-required stops the run") from None
        print(f"blockdraft train: warning: --report-to {name} {what} ({why}); training goes on without it",
              file=sys.stderr)

    def _each(self, fn, what: str, only_live: bool | None = None) -> None:
        for name, tracker in list(self.open.items()):
            if only_live is None or tracker.live == only_live:
                try:
                    fn(tracker)
                except Exception as e:  # noqa: BLE001
                    self.open.pop(name)
                    self._failed(name, what, e)

    def report(self, record: dict) -> None:
        step, figs = int(record["step"]), figures(record)
        self._each(lambda t: t.log(step, figs), "could not write", only_live=True)
        self.pending.append((step, figs))

    def flush(self) -> None:
        """The steps logged so far go to the trackers that wait for a checkpoint, and are in their
        stores when this returns (a tracker that writes on a thread is made to write: `sync`)."""
        pending, self.pending = self.pending, []

        def write(t) -> None:
            for s, f in pending:
                t.log(s, f)
            if hasattr(t, "sync"):
                t.sync()

        self._each(write, "could not write", only_live=False)

    def close(self, flush: bool = True) -> None:
        if flush:
            self.flush()
        self.pending = []
        self._each(lambda t: t.close(), "could not close")
        self.open = {}


def read_state(out: Path) -> dict:
    """trackers.json: the tracker runs this directory continues ({} when absent). One that is there but
    cannot be read is an error: read as none, --resume would start second tracker runs beside the first."""
    path = Path(out) / STATE
    try:
        got = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        why = getattr(e, "strerror", None) or " ".join(str(e).split())
        raise ValueError(f"{path} cannot be read ({why}): it names the tracker runs --resume continues; restore "
                         "it, or delete it to start new tracker runs beside the earlier ones") from None
    if not isinstance(got, dict):
        raise ValueError(f"{path} holds no JSON object: it names the tracker runs --resume continues; restore "
                         "it, or delete it to start new tracker runs beside the earlier ones")
    return {k: v for k, v in got.items() if k in KINDS and isinstance(v, dict)}


def open_trackers(cfg, out: Path, settings: dict, resumed_at: int | None) -> Trackers | None:
    names = parse_report_to(cfg.report_to)
    if not names:
        return None
    return Trackers(names, out, settings, resumed_at=resumed_at, required=cfg.report_required)
