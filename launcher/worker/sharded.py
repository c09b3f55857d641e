"""Sharded training (``--strategy fsdp``): the model, its gradients and optimizer state split
over the workers with torch's FSDP2, and checkpoints that every rank writes its share of.

FSDP2 (``torch.distributed.fsdp.fully_shard``) turns each parameter into a DTensor sharded on
dimension 0 over a one-dimensional device mesh of all the workers; a forward or backward pass
of a sharded block all-gathers its parameters, and the gradients are reduce-scattered, so a
worker holds about 1/N of the state between uses. It runs on gloo (CPU) and NCCL (GPU).

Checkpoints are torch.distributed.checkpoint (DCP) folders: each rank writes ``__R_0.distcp``
with its shards, rank 0 the ``.metadata`` that maps every tensor's pieces to files, offsets
and lengths. DCP loads such a folder on any number of ranks (it reads the pieces each rank's
shards need), so a run stopped on N workers resumes on M. The launcher's manifest lists every
file with the size the metadata gives it, so a folder whose shards are not all stored is
never resumed from.

DCP's collectives (the save and load plans) go over a gloo group of their own: an asynchronous
save runs them on a background thread, which must not share a group with training.

The export: rank 0 keeps an unsharded skeleton of the model (:func:`skeleton`, no weights) and
fills it with the final checkpoint's whole state (:func:`load_skeleton`) to trace a program.
"""

from __future__ import annotations

import copy
import os
from typing import Any, Iterable

from launcher.worker.loader import SessionError, user_line

METADATA = ".metadata"
MIN_SHARE = 0.02   # a child holding less of the model's parameters than this stays with its parent
DESCEND = 0.5      # a child holding more than this is a container of blocks: its children are looked at


def default_blocks(root) -> list:
    """The modules that get a ``fully_shard`` of their own, before the root: each child module
    holding at least :data:`MIN_SHARE` of the parameters; one holding more than :data:`DESCEND`
    (a ``ModuleList`` of transformer blocks, a trunk) is looked into instead, as are containers."""
    import torch

    total = sum(p.numel() for p in root.parameters())
    chosen: list = []

    def visit(module) -> None:
        for child in module.children():
            n = sum(p.numel() for p in child.parameters())
            if not n:
                continue
            container = isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential))
            if (container or n > DESCEND * total) and any(True for _ in child.children()):
                visit(child)
            elif n >= MIN_SHARE * total:
                chosen.append(child)

    visit(root)
    return chosen


def named_blocks(root, blocks: Iterable) -> list:
    """The user's ``blocks``: module classes (every submodule of that class) or modules of ``root``."""
    import torch

    chosen, seen = [], set()
    inside = {id(m) for m in root.modules()}
    for block in blocks:
        if isinstance(block, type) and issubclass(block, torch.nn.Module):
            found = [m for m in root.modules() if isinstance(m, block) and m is not root]
            if not found:
                raise SessionError(f"session.prepare(..., blocks=[{block.__name__}]) at {user_line()}: the model "
                                   f"has no {block.__name__} module; name the classes of its blocks")
        elif isinstance(block, torch.nn.Module):
            if id(block) not in inside or block is root:
                raise SessionError(f"session.prepare(..., blocks=[...]) at {user_line()}: a "
                                   f"{type(block).__name__} given in blocks is not a submodule of the model")
            found = [block]
        else:
            raise SessionError(f"session.prepare(..., blocks=[...]) at {user_line()}: {block!r} is neither a "
                               "module class nor a module; give e.g. blocks=[TransformerBlock]")
        for m in found:
            if id(m) not in seen:
                seen.add(id(m))
                chosen.append(m)
    return chosen


def shard(module, optimizer, *, device, precision: str, offload: bool, blocks: Iterable | None = None) -> list:
    """Shard ``module`` in place with FSDP2 (rank 0's weights on every rank first) and point
    ``optimizer`` (if any, not yet stepped) at the sharded parameters; returns the blocks."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    named = dict(module.named_parameters())
    if not named:
        raise SessionError(f"session.prepare(model) at {user_line()}: the {type(module).__name__} has no "
                           "parameters, so there is nothing to shard; build the model's layers before prepare()")
    if optimizer is not None and any(optimizer.state.values()):
        raise SessionError(f"session.prepare(model, optimizer) at {user_line()}: the optimizer has taken a step "
                           "already; with --strategy fsdp call prepare() before training")
    if dist.get_world_size() > 1:  # rank 0's initial weights, as DDP gives
        for tensor in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(tensor.data, 0)
    chosen = named_blocks(module, blocks) if blocks is not None else default_blocks(module)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    options: dict[str, Any] = {"mesh": mesh}
    if precision == "bf16":  # compute in bf16, gradients reduced and kept in fp32
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if offload:
        options["offload_policy"] = CPUOffloadPolicy()
    for block in chosen:
        fully_shard(block, **options)
    fully_shard(module, **options)
    if optimizer is not None:
        after = dict(module.named_parameters())
        swap = {id(named[name]): after[name] for name in named}
        for group in optimizer.param_groups:
            group["params"] = [swap.get(id(p), p) for p in group["params"]]
    return chosen


def state_bytes(model, optimizer=None) -> dict[str, int]:
    """This rank's bytes of parameters, gradients and optimizer state: its shards under fsdp,
    whole tensors otherwise (what memory the model costs each worker, activations aside)."""
    import torch

    def local(t) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    params = sum(local(p) for p in model.parameters())
    grads = sum(local(p.grad) for p in model.parameters() if p.grad is not None)
    opt = 0
    if optimizer is not None:
        for state in optimizer.state.values():
            opt += sum(local(v) for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return {"params": params, "grads": grads, "optimizer": opt, "total": params + grads + opt}


# -- checkpoints ------------------------------------------------------------------------------

class Checkpointer:
    """DCP saves and loads over a gloo group of their own; at most one asynchronous save at a time."""

    def __init__(self, device) -> None:
        import torch.distributed as dist
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.group = dist.new_group(backend="gloo")  # a collective: every rank makes it in prepare()
        self.pending = None   # the Future of an asynchronous save still writing
        # An asynchronous save first copies the state (this rank's shards) into CPU memory, then goes
        # on with training. The stager keeps that copy's buffers from one save to the next: allocating
        # them anew each time was most of the pause (on 2 CPU ranks, ~11 ms instead of 20-40 ms for
        # 12 MB a rank). Pinned on a GPU, so that the copy from the device is a fast DMA.
        gpu = getattr(device, "type", "cpu") == "cuda"
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=gpu, use_shared_memory=False,
                                                   use_async_staging=False, use_non_blocking_copy=False))

    def wait(self) -> None:
        """Until the asynchronous save under way (if any) has written its files."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()

    def save(self, states: dict[str, Any], directory: str, background: bool) -> None:
        """Write ``states`` (sharded state dicts) into ``directory``: now, or (``background``)
        staged in memory now and written by a thread (:meth:`wait` for it)."""
        import torch.distributed.checkpoint as dcp

        self.wait()
        writer = dcp.FileSystemWriter(directory, thread_count=1)
        if background:
            saved = dcp.async_save(states, storage_writer=writer, process_group=self.group,
                                   async_stager=self.stager)
            self.pending = getattr(saved, "upload_completion", saved)  # a Future either way
        else:
            dcp.save(states, storage_writer=writer, process_group=self.group)

    def load(self, states: dict[str, Any], directory: str) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.load(states, storage_reader=dcp.FileSystemReader(directory), process_group=self.group)


def model_state(model) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model)


def optimizer_state(model, optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer)


def load_model(checkpointer: Checkpointer, model, key: str, directory: str) -> None:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    state = model_state(model)
    checkpointer.load({key: state}, directory)
    set_model_state_dict(model, state)


def load_optimizer(checkpointer: Checkpointer, model, optimizer, key: str, directory: str) -> None:
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    state = optimizer_state(model, optimizer)
    checkpointer.load({key: state}, directory)
    set_optimizer_state_dict(model, optimizer, state)


def full_model_state(model) -> dict[str, Any]:
    """The whole model's state on rank 0, gathered into CPU memory a tensor at a time (a
    collective: every rank calls it; the others get an empty dict)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


# -- the whole model, for the export ----------------------------------------------------------
#
# The export traces an unsharded module with torch.export. The sharded one cannot be traced:
# fully_shard swaps the class for an FSDP subclass, turns each parameter into a DTensor (a
# shard with a mesh) and gathers weights in forward hooks that are collectives, so a trace on
# rank 0 alone would hang or bake communication into the program; un-sharding it in place is
# not an FSDP2 operation (unshard() gathers the weights for a pass; the hooks stay). Rebuilding
# the user's class is not possible either (the launcher never sees its constructor's arguments),
# and a whole copy kept from prepare() would cost rank 0 the whole model's memory all run, the
# very thing sharding saves. So prepare() keeps, on rank 0 and before
# fully_shard, a deep copy of the module whose parameters and persistent buffers are on the
# meta device: the same classes, submodules, forward and attributes as the user built them,
# with plain tensors (never DTensors, since it is copied before sharding), costing no memory
# for weights (for examples/gpt.py's 25 M parameters, 97 MiB of them: 0.3 MiB and 11 ms).
# At the end the final checkpoint's whole state (gathered from the shards on rank 0: a
# collective every rank joins in the save, under the FQNs of the module's own state_dict,
# which FSDP2 leaves as they were) is assigned into it, read memory-mapped from the
# checkpoint's model.pt: no second copy, and no collective at the export, which rank 0
# makes alone while the other ranks go on. Non-persistent buffers
# (a causal mask, a rotary table) are in no state_dict: the copy keeps them as they are at
# prepare() (on the CPU), which is what the module computed them as.

def skeleton(module):
    """An unsharded copy of ``module`` (before :func:`shard`) holding no weights: its parameters
    and persistent buffers on the meta device, its non-persistent buffers copied to the CPU."""
    import torch

    memo: dict[int, Any] = {}
    for p in module.parameters():
        memo[id(p)] = torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for m in module.modules():
        for name, b in m._buffers.items():
            if b is not None and id(b) not in memo:
                kept = name in m._non_persistent_buffers_set
                memo[id(b)] = b.detach().to("cpu", copy=True) if kept else torch.empty_like(b, device="meta")
    return copy.deepcopy(module, memo)  # every tensor the memo names is taken from it, not copied


def load_skeleton(clone, whole: dict[str, Any]):
    """(``clone`` from :func:`skeleton` holding the ``whole`` state, None), or (None, why not)."""
    try:
        clone.load_state_dict(whole, strict=True, assign=True)  # the tensors themselves: no second copy
    except (RuntimeError, KeyError) as exc:
        return None, f"the gathered weights do not fit the model ({' '.join(str(exc).split())[:300]})"
    empty = [n for n, t in [*clone.named_parameters(), *clone.named_buffers()] if t.is_meta]
    if empty:
        return None, f"{', '.join(empty[:3])} of the model has no value after loading its whole state"
    return clone, None


def shard_files(directory: str) -> dict[str, int]:
    """Every file of the DCP checkpoint in ``directory`` (rank 0's, holding the metadata) and the
    size its pieces give it: what the manifest vouches for, other ranks' files included."""
    import torch.distributed.checkpoint as dcp

    ends: dict[str, int] = {}
    for info in dcp.FileSystemReader(directory).read_metadata().storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    ends[METADATA] = os.path.getsize(os.path.join(directory, METADATA))
    return ends


def export_file(directory: str, key: str, out: str) -> str:
    """The model ``key`` of the DCP checkpoint in ``directory`` as one ``torch.save`` file of
    whole tensors at ``out`` (its keys those of the model's own ``state_dict``); no process group.
    The whole checkpoint is converted first (DCP's own tool), then read back memory-mapped."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = out + ".all.tmp"
    try:
        dcp_to_torch_save(directory, whole)
        state = torch.load(whole, mmap=True, weights_only=True)
        if key not in state:
            raise KeyError(f"the checkpoint holds {', '.join(sorted(state))}, not {key!r}")
        torch.save(state[key], out + ".tmp")
        os.replace(out + ".tmp", out)
    finally:
        if os.path.exists(whole):
            os.remove(whole)
    return out
