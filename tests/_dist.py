"""Helpers for tests that run real multi-process gloo groups.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` processes with
``torch.multiprocessing`` (forkserver start method, see ``START_METHOD``), initialises a gloo (or
``backend``) process group in each through a TCP store that the parent holds (bound before the ranks
start, so no other process can take its port in between: the suite runs two pytest processes at once,
and their ranks' ephemeral ports come from the same range), calls ``fn(rank, world_size, *args)``,
destroys the group and returns the per-rank return values (in rank order). ``fn`` and ``args`` must be
picklable: define ``fn`` at module level of a test module. An exception in any child is re-raised in
the parent (same type when it pickles) with the child's formatted traceback attached as its
``__cause__``; the remaining children are terminated. A run that outlives its deadline is stopped with
a ``ChildFailure`` that says, rank by rank, what each was doing (starting, joining the group, running
``fn``, done) and where each live rank's threads stood (a faulthandler dump taken before stopping it).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

__all__ = ["START_METHOD", "ChildFailure", "free_port", "join_group", "rendezvous_store", "run_distributed"]


def _cuda_visible() -> bool:
    """Whether this host has a CUDA device; ``torch.cuda.is_available`` does not create a context, so
    asking cannot itself spoil a later fork."""
    return torch.version.cuda is not None and torch.cuda.is_available()


def _start_method() -> str:
    asked = os.environ.get("UNDERLAY_TEST_START_METHOD", "").strip()
    cuda = _cuda_visible()
    if not asked:
        return "spawn" if cuda else "forkserver"
    if asked not in ("spawn", "forkserver"):
        raise ValueError(f"UNDERLAY_TEST_START_METHOD={asked!r}: use 'spawn' or 'forkserver'")
    if asked == "forkserver" and cuda:
        raise ValueError(
            "UNDERLAY_TEST_START_METHOD=forkserver on a host with a CUDA device: a forked rank cannot "
            "initialise CUDA once the server's imports touched it; unset the variable (spawn is the "
            "default here) or set it to spawn"
        )
    return asked


START_METHOD = _start_method()
"""How ranks start. On a host without a CUDA device, ``"forkserver"`` (default) forks each rank from
a server process that imported ``_PRELOAD`` once per pytest session, so a rank does not pay the
imports of torch, transformers and megatron-core again (seconds of CPU per rank, most of a small
multi-process test's cost). On a host with a CUDA device the default and the only choice is
``"spawn"`` (a fresh interpreter per rank): CUDA cannot be initialised in a forked child once the
parent touched it. ``UNDERLAY_TEST_START_METHOD=spawn`` forces spawn anywhere. Either way a rank gets
the parent's environment as it is at the call (``_worker`` installs it) and nothing that a test
process did to torch's global state: the server imports modules only, never the CPU fixture of the
mcore tests, and starts no threads."""

_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.qwen3.modeling_qwen3",
    "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "safetensors.torch",
    "underlay",
    "underlay.engines.fsdp2.engine",
    "megatron.core",
    "megatron.core.models.gpt",
    "megatron.core.optimizer",
    "megatron.core.distributed",
    "megatron.core.pipeline_parallel",
    "megatron.core.dist_checkpointing",
]
"""Modules the forkserver imports before forking ranks (a missing one is skipped by multiprocessing)."""

if START_METHOD == "forkserver":
    import multiprocessing

    multiprocessing.set_forkserver_preload(_PRELOAD)


class ChildFailure(RuntimeError):
    """Carries the formatted traceback of a failed child process (the ``__cause__`` of the re-raise)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rendezvous_store(world_size: int, timeout_s: float = 120.0) -> dist.TCPStore:
    """A TCP store listening on 127.0.0.1 at a port the kernel chose (``.port``), for ``world_size``
    ranks to join with ``join_group``. Hold it in the parent until the ranks exit. Unlike a port from
    ``free_port`` handed to rank 0, no other process can take it between choosing and listening."""
    return dist.TCPStore(
        "127.0.0.1",
        0,
        world_size,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout_s),
    )


def join_group(
    port: int, rank: int, world_size: int, timeout_s: float = 120.0, backend: str = "gloo"
) -> None:
    """Initialise the default process group through the ``rendezvous_store`` listening on ``port``."""
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


_REPORT_CHARS = 16000


def _clip(text: str) -> str:
    """``text`` cut to about ``_REPORT_CHARS`` characters (head and tail kept)."""
    if len(text) <= _REPORT_CHARS:
        return text
    half = _REPORT_CHARS // 2
    return f"{text[:half]}\n... [{len(text) - 2 * half} characters cut] ...\n{text[-half:]}"


def _stop_children() -> None:
    """Terminate (then kill) every live multiprocessing child of this process."""
    import multiprocessing

    children = multiprocessing.active_children()
    for child in children:
        child.terminate()
    for child in children:
        child.join(timeout=5)
        if child.is_alive():
            child.kill()


def _worker(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    port: int,
    queue: Any,
    args: tuple[Any, ...],
    timeout_s: float,
    backend: str = "gloo",
    env: dict[str, str] | None = None,
    dump_dir: str = "",
) -> None:
    if env is not None:  # the parent's environment at the call (a forkserver rank has the server's)
        os.environ.clear()
        os.environ.update(env)
    # a rank killed by a signal (SIGSEGV, SIGABRT) prints every thread's Python stack to stderr, which
    # pytest shows with the failing test; without it the parent only learns the signal's name
    faulthandler.enable(all_threads=True)
    # the parent sends SIGUSR1 to a rank that outlived the deadline: its stacks go to a file it reads
    stacks = open(os.path.join(dump_dir, f"rank{rank}.stacks"), "w")  # noqa: SIM115 (lives with the process)
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    queue.put(("phase", rank, b"joining the process group", "", time.time()))
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_RANK"] = str(rank)
    if backend != "gloo" and torch.cuda.is_available():
        torch.cuda.set_device(rank)
    join_group(port, rank, world_size, timeout_s, backend)
    queue.put(("phase", rank, f"running {getattr(fn, '__qualname__', fn)!s}".encode(), "", time.time()))
    try:
        result = fn(rank, world_size, *args)
        try:
            payload = pickle.dumps(result)
        except Exception:  # an unpicklable result is reported as its repr
            payload = pickle.dumps(repr(result))
        queue.put(("ok", rank, payload, "", 0.0))
    except BaseException as exc:
        when = time.time()
        # an error message may print whole tensors: the report stays small
        tb = _clip(traceback.format_exc())
        try:
            blob = pickle.dumps(exc)
            pickle.loads(blob)
            if len(blob) > _REPORT_CHARS:
                raise ValueError("report too large")
        except Exception:
            blob = pickle.dumps(RuntimeError(_clip(f"{type(exc).__name__}: {exc}")))
        queue.put(("err", rank, blob, tb, when))
        raise
    finally:
        dist.destroy_process_group()
    # The result is reported (SimpleQueue writes synchronously). Skip interpreter teardown: c10d/gloo
    # and profiler threads occasionally abort a finished child at exit (SIGABRT, "terminate called
    # without an active exception"), which would fail a test whose work all passed. Skipping it also
    # skips multiprocessing's exit hook, so stop this process's own children first (megatron's
    # checkpoint writer starts a spawn Manager server; os._exit would orphan it, asleep forever).
    _stop_children()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class _Progress:
    """What each rank last reported (phase and when), for the report of a run that timed out."""

    def __init__(self, world_size: int) -> None:
        self.start = time.time()
        self.phase = {r: ("starting its process", self.start) for r in range(world_size)}

    def note(self, rank: int, what: str, when: float) -> None:
        self.phase[rank] = (what, when)

    def describe(self, rank: int) -> str:
        what, when = self.phase[rank]
        return f"{what} (since {when - self.start:.1f} s after the start)"


def _timeout_report(
    procs: Any, progress: _Progress, dump_dir: str, world_size: int, deadline_s: float
) -> str:
    """Ask every live rank for its stacks (SIGUSR1 -> faulthandler), then describe every rank."""
    live = {r: p for r, p in enumerate(procs.processes) if p.is_alive()}
    for p in live.values():
        with contextlib.suppress(ProcessLookupError, OSError):
            os.kill(p.pid, signal.SIGUSR1)
    time.sleep(1.0)
    lines = [f"run_distributed: {world_size} ranks outlived the {deadline_s:g} s deadline"]
    for r in range(world_size):
        state = "alive" if r in live else f"exited (code {procs.processes[r].exitcode})"
        lines.append(f"rank {r}: {state}, last {progress.describe(r)}")
        if r in live:
            try:
                with open(os.path.join(dump_dir, f"rank{r}.stacks")) as f:
                    dump = f.read().strip()
            except OSError:
                dump = ""
            lines.append(_clip(dump) if dump else "  (no stack dump: the rank did not answer SIGUSR1)")
    return "\n".join(lines)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    backend: str = "gloo",
    deadline_s: float | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes; return their results.

    Raises the first child's exception (with its traceback as ``__cause__``) when any child fails, and
    ``ValueError`` when ``world_size < 1``. ``timeout_s`` bounds collectives (group timeout).
    ``deadline_s`` bounds the whole run (default ``2 * timeout_s + 60``): past it every rank's progress
    and live stacks are collected, the ranks are stopped and ``ChildFailure`` says which rank was doing
    what. ``backend`` is the process-group backend (``"gloo"``; ``"nccl"`` on a GPU host, one GPU per
    rank: rank ``r`` uses cuda device ``r``).
    """
    if world_size < 1:
        raise ValueError(f"run_distributed: world_size={world_size} must be >= 1")
    deadline_s = 2 * timeout_s + 60 if deadline_s is None else deadline_s
    ctx = mp.get_context(START_METHOD)
    queue = ctx.SimpleQueue()
    # the rendezvous server lives here, already listening, until every rank has exited
    store = rendezvous_store(world_size, timeout_s)
    port = store.port
    reports: list[tuple[str, int, bytes, str, float]] = []
    progress = _Progress(world_size)
    dump_dir = tempfile.mkdtemp(prefix="underlay-ranks-")

    def drain() -> None:
        # a child blocks in put() once the pipe is full: read while waiting
        while not queue.empty():
            item = queue.get()
            if item[0] == "phase":
                progress.note(item[1], item[2].decode(), item[4])
            else:
                reports.append(item)
                progress.note(item[1], "done" if item[0] == "ok" else "raised", item[4] or time.time())

    timed_out: str | None = None
    try:
        procs = mp.start_processes(  # type: ignore[attr-defined,no-untyped-call]
            _worker,
            args=(fn, world_size, port, queue, args, timeout_s, backend, dict(os.environ), dump_dir),
            nprocs=world_size,
            join=False,
            start_method=START_METHOD,
        )
        end = time.monotonic() + deadline_s
        while not procs.join(timeout=0.2):
            drain()
            if time.monotonic() > end:
                drain()
                timed_out = _timeout_report(procs, progress, dump_dir, world_size, deadline_s)
                for p in procs.processes:
                    if p.is_alive():
                        p.kill()
                for p in procs.processes:
                    p.join(timeout=10)
                break
    except ProcessException as exc:
        failure: ProcessException | None = exc
    else:
        failure = None
    drain()
    del store  # every rank has exited: stop listening
    shutil.rmtree(dump_dir, ignore_errors=True)
    if timed_out is not None:
        raise ChildFailure(timed_out)
    results: dict[int, Any] = {}
    errors: list[tuple[float, int, BaseException, str]] = []
    for status, rank, blob, tb, when in reports:
        if status == "ok":
            results[rank] = pickle.loads(blob)
        else:
            errors.append((when, rank, pickle.loads(blob), tb))
    if errors:
        # the rank that raised first is the cause; the others usually only report the broken
        # connection that its exit caused
        errors.sort(key=lambda e: (e[0], e[1]))
        _, rank, child_exc, tb = errors[0]
        others = "\n".join(f"rank {r}: {progress.describe(r)}" for r in range(world_size) if r != rank)
        raise child_exc from ChildFailure(f"rank {rank} of {world_size} failed:\n{tb}\n{others}")
    if failure is not None and len(results) < world_size:
        raise ChildFailure(f"a child process died without reporting an exception: {failure}") from failure
    if failure is not None:  # every rank finished and reported; the abort came during teardown
        warnings.warn(
            f"run_distributed: a child aborted after reporting its result ({failure})", stacklevel=2
        )
    return [results[r] for r in range(world_size)]
