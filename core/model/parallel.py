"""Tensor parallelism over several processes (torch.distributed: NCCL between GPUs, gloo on CPUs), Megatron-style.

Each rank keeps a shard of every target layer: its 1/N of the query and KV heads (q/k/v output rows, o_proj input
columns) and of the MLP width (gate/up rows, down_proj columns), so the full, retrieval and offloaded KV caches, sized
from the shard's args, hold only its heads. o_proj and down_proj then give partial sums: ParallelOps all-reduces them,
two all-reduces per layer. Embeddings, norms and the LM head stay whole on every rank (replicated: the simplest), and
so does the level-1 draft. Every rank runs the same TriForce loop with the same seeded generator; `agree` hands every
rank rank 0's random draws and the decisions taken from them, so all ranks feed their caches the same tokens. Each
rank's events are its own: a RetrievalSelection lists the chunks of its KV heads, Stats count its caches' bytes.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import socket
import sys
import time
from datetime import timedelta
from multiprocessing.connection import wait
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from core.config import TriForceError
from core.model.ops import TorchOps, ops_for

if TYPE_CHECKING:
    from core.model.transformer import ModelArgs, Transformer


@dataclasses.dataclass
class TensorParallel:
    """This process's place in the group: its rank, the group's size, its device and the process group."""

    rank: int
    world: int
    device: torch.device
    group: dist.ProcessGroup


ACTIVE: TensorParallel | None = None  # set while this process is a rank of a tensor-parallel group (`joined`)


@contextlib.contextmanager
def joined(device: str | None = None, timeout_s: float = 1800.0) -> Iterator[TensorParallel]:
    """Join the group that torchrun or `launch` describes in the environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT,
    LOCAL_RANK): NCCL with one GPU per process on CUDA (the default where there is one), gloo on the CPU; left on
    exit. A collective that waits longer than timeout_s fails instead of hanging."""
    global ACTIVE
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        if dev.index >= torch.cuda.device_count():
            raise TriForceError(f"tensor-parallel rank {rank} needs GPU {dev.index}, but this machine has "
                                f"{torch.cuda.device_count()}")
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    ACTIVE = TensorParallel(rank, world, dev, dist.group.WORLD)
    try:
        yield ACTIVE
        # No rank tears the group down while another may still be in a collective with it (a broadcast's source
        # returns once it has sent): all leave together.
        dist.barrier(group=ACTIVE.group)
    finally:
        ACTIVE = None
        dist.destroy_process_group()


def agree(*values: int) -> tuple[int, ...]:
    """Rank 0's values on every rank while this process is one of a tensor-parallel group, else the values as they
    are: random draws (and decisions taken from them) go through here, so every rank takes rank 0's path."""
    if ACTIVE is None:
        return values
    t = torch.tensor(values, dtype=torch.int64, device=ACTIVE.device)
    dist.broadcast(t, src=0, group=ACTIVE.group)
    return tuple(t.tolist())


class ParallelOps:
    """A shard's operators: `inner`'s (TorchOps or TritonOps), except that the row-parallel projections (o_proj,
    down_proj) sum their partial outputs over the group before the residual (and any bias) is added, once."""

    def __init__(self, inner: TorchOps, group: dist.ProcessGroup | None = None):
        self.inner, self.group = inner, group

    def __getattr__(self, name: str) -> Any:
        """Every other operator and attribute is inner's."""
        if name == "inner":  # not set yet (copying): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def drafting(self) -> "ParallelOps":
        """The inner operators' drafting variant, still summing over the group."""
        inner = self.inner.drafting()
        return self if inner is self.inner else ParallelOps(inner, self.group)

    def mlp(self, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate_up: torch.Tensor,
            down: torch.Tensor) -> torch.Tensor:
        """The feed-forward composed of inner's operators as TorchOps composes it (no fused down projection: its
        partial sums must meet before the residual)."""
        return TorchOps.mlp(self, residual, norm_weight, eps, gate_up, down)

    def linear_add(self, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
        """residual + the group's sum of x @ weight.T (+ bias)."""
        partial = self.inner.linear(x, weight)
        dist.all_reduce(partial, group=self.group)
        out = residual + partial
        return out if bias is None else out + bias


def _keep(linear: nn.Linear, dim: int, rank: int, n: int) -> None:
    """Keep block `rank` of n output rows (dim 0, with the bias) or n input columns (dim 1) of a projection."""
    linear.weight = nn.Parameter(linear.weight.detach().narrow(dim, rank * n, n).clone(), requires_grad=False)
    if dim == 0:
        linear.out_features = n
        if linear.bias is not None:
            linear.bias = nn.Parameter(linear.bias.detach().narrow(0, rank * n, n).clone(), requires_grad=False)
    else:
        linear.in_features = n


def check_split(args: ModelArgs, world: int) -> None:
    """Refuse (TriForceError) a group of `world` processes unless it divides the model's query heads, KV heads and
    MLP width: each rank holds an equal part of each."""
    sizes = {"query heads": args.n_heads, "KV heads": args.n_kv_heads, "MLP width": args.intermediate_size}
    if bad := [f"{name} ({n})" for name, n in sizes.items() if n % world]:
        raise TriForceError(f"tensor parallel over {world} processes needs {' and '.join(bad)} divisible by {world}")


def capacity(device: torch.device) -> tuple[int, str]:
    """How many ranks this machine can give one each of, and of what: its GPUs for a CUDA device, else the CPU cores
    this process may run on."""
    if device.type == "cuda":
        return torch.cuda.device_count(), "GPUs"
    return len(os.sched_getaffinity(0)), "CPU cores"


def shard(model: Transformer, rank: int, world: int) -> None:
    """Cut `model` in place down to rank's shard of `world`: its query heads and KV heads in q/k/v (rows) and o_proj
    (columns), its part of the MLP width in gate/up (rows) and down_proj (columns); model.args then describe the
    shard (its caches hold only its heads). Embeddings, norms and LM head stay whole; fused projections are fused
    again. The sums over ranks after o_proj and down_proj are ParallelOps' to do (inference only: causal_states
    computes through TORCH, without them)."""
    a = model.args
    check_split(a, world)
    args = dataclasses.replace(a, n_heads=a.n_heads // world, n_kv_heads=a.n_kv_heads // world,
                               intermediate_size=a.intermediate_size // world)
    q, kv = args.n_heads * a.head_dim, args.n_kv_heads * a.head_dim
    fused = False
    for block in model.layers:
        att, mlp = block.self_attn, block.mlp
        fused = fused or att.wqkv is not None
        for linear, dim, n in ((att.q_proj, 0, q), (att.k_proj, 0, kv), (att.v_proj, 0, kv), (att.o_proj, 1, q),
                               (mlp.gate_proj, 0, args.intermediate_size), (mlp.up_proj, 0, args.intermediate_size),
                               (mlp.down_proj, 1, args.intermediate_size)):
            _keep(linear, dim, rank, n)
        att.wqkv = att.bqkv = mlp.w13 = None
        att.args = args
    model.args = args
    if fused:
        model.fuse_projections()


def parallelize(model: Transformer, draft: Transformer | None, tp: TensorParallel) -> None:
    """Make `model` this rank's shard on tp.device, computing through ParallelOps; the draft stays whole (every rank
    runs it alike) with its own copy of any layer it shared with the target. Both end on tp.device, fused there for
    decoding on a GPU. Cut the shard before moving a model loaded in host memory: no GPU then holds all of it."""
    if draft is not None:
        target_layers = {id(block) for block in model.layers}
        for i, block in enumerate(draft.layers):
            if id(block) in target_layers:
                draft.layers[i] = copy.deepcopy(block)
    shard(model, tp.rank, tp.world)
    for m in (model, draft) if draft is not None else (model,):
        m.to(tp.device)
        if tp.device.type == "cuda":
            m.fuse_projections()
    model.ops = ParallelOps(ops_for(tp.device), tp.group)


def free_port() -> int:
    """A TCP port on this machine that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, fn: Callable[..., int | None], args: tuple) -> None:
    """One spawned rank: the environment torchrun would give it, then fn(*args); its return value is the exit code."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    code = fn(*args) or 0
    sys.stdout.flush()
    sys.stderr.flush()
    # Its work done and its group left, the rank skips the interpreter's teardown: there, threads the distributed
    # runtime left behind have aborted a finished rank ("terminate called without an active exception").
    os._exit(code)


def launch(world: int, fn: Callable[..., int | None], *args: Any, timeout_s: float | None = None,
           grace_s: float = 10.0) -> int:
    """Run fn(*args) in `world` spawned processes that make up one group (each calls `joined` to enter it); return
    the first nonzero exit code, else 0. When one fails, the others are ended grace_s later (they would wait for it
    in a collective); past timeout_s, all are ended and TimeoutError raised."""
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(rank, world, port, fn, args)) for rank in range(world)]
    for p in procs:
        p.start()
    start, failed, code = time.monotonic(), None, 0
    try:
        while any(p.is_alive() for p in procs):
            wait([p.sentinel for p in procs if p.is_alive()], timeout=1.0)
            now = time.monotonic()
            if failed is None and (code := _failure(procs)):
                failed = now
            if timeout_s is not None and now - start > timeout_s:
                raise TimeoutError(f"{world} tensor-parallel processes still running after {timeout_s:.0f} s")
            if failed is not None and now - failed > grace_s:
                break
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
    return code or _failure(procs)


def _failure(procs: list) -> int:
    """The first nonzero exit code among the processes that ended, else 0."""
    return next((p.exitcode for p in procs if p.exitcode), 0)
