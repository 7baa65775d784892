"""How a group gathers its parameters: the all-gathers, copy-outs and their gradients' reduction, eager and traced.

The second of a group's layers (``_group_config`` has the first): what an eager unshard
and a traced forward both call, and what only a trace calls ([Note: traced unshard]).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from . import ops
from ._annotation import annotating_group, group_metadata
from ._group_settings import AllGatherPart, GatherSettings, PartSettings, TracedSettings, wire_dtype



from ._group_config import ConfiguredGroup


def _unpadded(padded: torch.Tensor, rows: int) -> torch.Tensor:
    """``padded``'s first ``rows`` rows; ``padded`` itself where it has no others (no slice node in a trace)."""
    return padded if padded.size(0) == rows else padded[:rows]


@torch.compiler.assume_constant_result
def traced_settings(group: ConfiguredGroup, settings_version: int) -> TracedSettings:
    """``group``'s settings, read in plain Python while Dynamo traces.

    [Note: settings a trace reads as constants]
    A trace reads a group's settings where it builds the all-gather and its
    annotation: FSDP2's knobs, dtypes, process group names, prefetch lists, and each
    sharded parameter's ``requires_grad``. Traced, each read costs Dynamo time and a
    guard, for every group of every trace, and ``requires_grad`` of a DTensor
    parameter costs a fake DTensor each (docs/benchmarks.md, "Capture time by
    depth"). So a trace reads them here once per group, as a constant, and guards on
    ``settings_version`` alone (passed as an argument, a traced read). FSDP2's knobs
    are one frozen ``GroupSettings`` per group, which every setter replaces through
    ``_replace_settings``; that numbers what this constant holds: the next call
    recompiles, or finds the graph of settings it had before (a loop that alternates
    two compiles each once). ``requires_grad_()`` has no setter: the
    root's eager forward compares the flags before each step
    (``note_requires_grad``), and a trace that does not start there (the root's
    forward traced inside a frame compiled around it) reads the flags of the groups
    it gathers (``guard_requires_grad``), which Dynamo guards. Eager mode reads
    everything live (``gather_settings``); the trace reads what changes between
    steps (accumulated gradients, kept parameters, grad mode) as before.
    """
    return TracedSettings(group.gather_settings(), group_metadata(group.annotation()))


class GatheringGroup(ConfiguredGroup):
    """A group's all-gathers and copy-outs: one all-gather per part, one tensor per parameter."""

    #: The unsharded parameters kept after backward ([Note: unsharded parameters kept after backward]),
    #: and whether a traced forward kept them: the lifecycle's state (``FSDPParamGroup.__init__``), which a
    #: trace reads too. Instance attributes from the start: Dynamo guards on the instance's dictionary.
    kept_after_backward: tuple[torch.Tensor, ...] | None
    _kept_by_trace: bool

    def _all_gather_options(self, settings: PartSettings) -> tuple:
        """``fsdp::all_gather_into``'s optional arguments for this gathering, trailing defaults left out.

        The settings' options with this step's accumulation in place (``GradientBuffers.take``), where there is
        any: without, a trace reads two attributes here, not the calls that would find nothing to take.
        """
        if self.buffers.accumulated_grad is None and self.buffers.partial_reduce_output is None:
            return settings.values[: settings.given]
        accumulation = self.buffers.take(torch.is_grad_enabled() and settings.takes_gradients)
        return ops.ReductionOptions.with_accumulation(settings.values, settings.given, *accumulation)

    def _all_gather(self, settings: GatherSettings) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """All-gathers the group (one collective per part) and copies out one tensor per parameter."""
        if self.has_extensions:
            return self._as_gathered(self._gather_with_extensions(), settings)
        all_gather_outputs = self._all_gather_outputs(settings)
        return self._copy_out(all_gather_outputs, settings.all_gather_parts), all_gather_outputs

    def _all_gather_outputs(self, settings: GatherSettings) -> list[torch.Tensor]:
        """One all-gather per part, not copied out."""
        all_gather_outputs = []
        for part, part_settings in zip(settings.all_gather_parts, settings.parts):
            if part_settings.reads_shards:  # no call per parameter: each costs a trace an inlined frame
                shards = [self.fsdp_params[index].shard for index in part.indices]
            else:
                shards = [
                    self.fsdp_params[index].all_gather_shard(settings.requires_grad[index]) for index in part.indices
                ]
            options = self._all_gather_options(part_settings)
            all_gather_outputs.append(
                ops.all_gather_into(shards, part.padded_numels, self.world_size, self.group_name, *options)
            )
        return all_gather_outputs

    def _gather_with_extensions(self) -> list[torch.Tensor]:
        """The unsharded parameters of a group with all-gather extensions, without autograd.

        One all-gather per dtype of the all-gather inputs: the extensions' inputs and the
        other parameters' shards cast to their wire dtype ([Note: all-gather extensions]
        in compile_shard._extension).
        """
        mesh = self.mesh if self.mesh.ndim == 1 else self.mesh[self.mesh.mesh_dim_names[-1]]
        inputs: list[list[torch.Tensor]] = []
        metadata: list[Any] = []
        by_dtype: dict[torch.dtype, list[tuple[int, int]]] = {}
        with torch.no_grad():
            for index, fsdp_param in enumerate(self.fsdp_params):
                if fsdp_param.has_extension:
                    tensors, meta = fsdp_param.extension_inputs(mesh, self.mp_policy)
                    dtypes = [tensor.dtype for tensor in tensors]
                else:
                    tensors, meta = [fsdp_param.shard.detach()], None
                    dtypes = [wire_dtype(fsdp_param, self.mp_policy)]
                inputs.append(tensors)
                metadata.append(meta)
                for position, dtype in enumerate(dtypes):
                    by_dtype.setdefault(dtype, []).append((index, position))
            gathered: list[list[torch.Tensor | None]] = [[None] * len(tensors) for tensors in inputs]
            for dtype, places in by_dtype.items():
                shards = [inputs[index][position] for index, position in places]
                padded_numels = [
                    tensor.numel() if self.fsdp_params[index].has_extension else self.fsdp_params[index].padded_numel
                    for (index, _), tensor in zip(places, shards)
                ]
                cast = {"param_dtype": dtype} if any(shard.dtype != dtype for shard in shards) else {}
                output = ops.all_gather_into(shards, padded_numels, self.world_size, self.group_name, **cast)
                per_rank = output.view(self.world_size, -1).split(padded_numels, dim=1)
                for (index, position), shard, chunk in zip(places, shards, per_rank):
                    # Each input's all-gather output a tensor of its own, as FSDP2 hands them to
                    # fsdp_post_all_gather: where a chunk is contiguous (a shard group of one rank),
                    # reshape would return a view into the one buffer of every input.
                    rows = chunk.reshape(-1, *shard.shape[1:])
                    gathered[index][position] = rows.clone() if chunk.is_contiguous() else rows
            unsharded = []
            for fsdp_param, outputs, meta in zip(self.fsdp_params, gathered, metadata):
                if fsdp_param.has_extension:
                    param_dtype = wire_dtype(fsdp_param, self.mp_policy)
                    unsharded.append(fsdp_param.unsharded_from_extension(outputs, meta, param_dtype))
                else:
                    rows = _unpadded(outputs[0], fsdp_param.unsharded_shape[0])
                    unsharded.append(fsdp_param.unsharded_from_rows(rows))
        return unsharded

    def _as_gathered(
        self, gathered: list[torch.Tensor], settings: GatherSettings
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Unsharded parameters gathered another way as a new all-gather's outputs.

        Kept from an earlier all-gather, gathered by a custom all-gather or through
        all-gather extensions ([Note: unsharded parameters gathered outside
        all_gather_into] in compile_shard.ops).
        """
        unsharded: list[torch.Tensor] = [None] * len(self.fsdp_params)  # type: ignore[list-item]
        outputs = []
        for part, part_settings in zip(settings.all_gather_parts, settings.parts):
            params = [self.fsdp_params[index] for index in part.indices]
            tensors = [gathered[index].detach() for index in part.indices]
            output = tensors[0]
            if torch.is_grad_enabled() and part_settings.takes_gradients:
                # as_gathered's autograd node works on rows ([Note: sharding on another dim]).
                rows = [fsdp_param.rows_of(tensor) for fsdp_param, tensor in zip(params, tensors)]
                shards = [
                    fsdp_param.all_gather_shard(settings.requires_grad[index])
                    for fsdp_param, index in zip(params, part.indices)
                ]
                options = self._all_gather_options(part_settings)
                # Eager mode takes views; a traced graph needs the op, whose outputs are new tensors, except
                # for a tensor subclass ([Note: an unsharded tensor subclass in a trace] in compile_shard.ops).
                plain = all(type(row) is torch.Tensor for row in rows)
                as_gathered = ops.as_gathered if torch.compiler.is_compiling() and plain else ops.as_gathered_views
                gathered_rows = as_gathered(
                    rows, shards, part.padded_numels, self.world_size, self.group_name, *options
                )
                output = gathered_rows[0]  # the node whose backward reduces
                # A view each: a node of its own per parameter, which backward runs only where the forward
                # used it, as the copy-out's views ([Note: unused parameters] in passes.unused_params).
                rows = [row.view_as(row) for row in gathered_rows]
                tensors = [fsdp_param.unsharded_from_rows(row) for fsdp_param, row in zip(params, rows)]
            outputs.append(output)
            for index, tensor in zip(part.indices, tensors):
                unsharded[index] = tensor
        return unsharded, outputs

    def _all_gather_post_forward_chunks(self, post_forward_chunks: list[torch.Tensor]) -> list[torch.Tensor]:
        """The unsharded parameters, gathered back over the smaller group ([Note: resharding to a smaller group])."""
        reshard_group = self.settings.reshard_group
        all_gather_outputs = [
            ops.all_gather_into([chunk], [chunk.numel()], reshard_group.size, reshard_group.group_name)
            for chunk in post_forward_chunks
        ]
        return self._copy_out(all_gather_outputs, self.dtypes.all_gather_parts)

    def _copy_out(
        self, all_gather_outputs: list[torch.Tensor], all_gather_parts: Sequence[AllGatherPart]
    ) -> list[torch.Tensor]:
        """One tensor per parameter, in the group's order, from each part's all-gather output."""
        unsharded: list[torch.Tensor] = [None] * len(self.fsdp_params)  # type: ignore[list-item]
        for part, all_gather_output in zip(all_gather_parts, all_gather_outputs):
            per_rank = all_gather_output.view(self.world_size, -1).split(part.padded_numels, dim=1)
            for index, chunk, shape in zip(part.indices, per_rank, part.unsharded_shapes):
                rows = _unpadded(chunk.reshape(-1, *shape[1:]), shape[0])
                unsharded[index] = self.fsdp_params[index].unsharded_from_rows(rows)
        return unsharded

    def traced_unsharded_params(self) -> list[torch.Tensor]:
        """The group's unsharded parameters inside a torch.compile trace.

        [Note: traced unshard]
        Eager mode keeps Python state that backward needs: the gathered tensors and
        their storage (``UnshardedParams``), hooks on outputs and on the all-gather's
        autograd node, storage frees and refills. A trace can hold none of that, and
        storage resizing has no functional form. So while compiling, the outermost
        sharded module's forward wrapper gathers every group below it and shows the
        tensors to the modules until it returns (Dynamo replays the net effect, which
        is nothing). Nested wrappers find their group shown and write nothing: Dynamo
        refuses Python state writes inside an activation-checkpoint region, and a
        sharded block is often called inside one. The pass suite then decides per
        group, from the annotation below, what eager's storage management decides:
        where to gather (``place``), and whether backward saves the unsharded
        parameters or gathers them again (``reshard``).
        """
        kept = self.kept_after_backward
        settings = traced_settings(self, self.settings_version)
        with annotating_group(settings.annotation):
            if kept is None:
                tensors, _ = self._all_gather(settings.gather)
            else:
                tensors, _ = self._as_gathered(list(kept), settings.gather)
        self._keep_traced(tensors, kept)
        return tensors

    def _keep_traced(self, tensors: list[torch.Tensor], kept: tuple[torch.Tensor, ...] | None) -> None:
        """What a traced forward keeps for the next one.

        [Note: unsharded parameters kept after backward]
        FSDP2's ``set_reshard_after_backward(False)``: backward keeps the unsharded
        parameters, and the next forward computes with them instead of all-gathering
        (``as_gathered`` gives them this forward's reduction). They are not refreshed:
        until the setting is True again, every forward computes with the same values.
        Eager mode keeps what backward computed with. A traced forward keeps what it
        computes with, as a graph output the group holds: the same values, since the
        parameters do not change between a forward and its backward, and the next
        compiled forward takes them as graph inputs. A group is specialised on whether
        it holds kept parameters (Dynamo guards the attribute), so a loop that keeps on
        all micro-batches but the last runs three graphs and recompiles no more. Eager
        mode keeps only what backward left gathered (FSDP2's), while a compiled graph
        keeps the gathered parameters from the first forward: its backward then
        computes with them instead of gathering again. So ``reshard()`` frees the
        storage an eager backward kept, as FSDP2 does, but only drops what a traced
        forward kept: that forward's backward may not have run yet.
        """
        keeps = not self.settings.reshard_after_backward and torch.is_grad_enabled()
        if keeps and kept is None:
            self.kept_after_backward = tuple(tensor.detach() for tensor in tensors)
            self._kept_by_trace = True
        elif not keeps and kept is not None:
            self.kept_after_backward = None

    def show_traced_unsharded_params(self) -> None:
        """Inside a trace: gathers and shows the group, which no one has gathered yet."""
        for fsdp_param, tensor in zip(self.fsdp_params, self.traced_unsharded_params()):
            fsdp_param.show_unsharded(tensor)
        # The compiled backward finds unused parameters itself (passes.unused_params): an eager watch, left
        # by a gather whose backward never ran, must not judge its gradients. One write for the whole list.
        self.use_flags[:] = [None] * len(self.use_flags)

    def owns(self, object_id: int) -> bool:
        """Whether ``object_id`` is this group or one of its lists of slots (``register_owned_state``)."""
        return object_id in (id(self), id(self.shown_params), id(self.use_flags))

    def gather_traced(self) -> None:
        """Inside a trace: all-gathers the group, which no one has gathered yet; its block copies out."""
        settings = traced_settings(self, self.settings_version)
        with annotating_group(settings.annotation):
            self.traced_all_gather_outputs = self._all_gather_outputs(settings.gather)
        self.use_flags[:] = [None] * len(self.use_flags)  # as in show_traced_unsharded_params

    def copy_out_in_region(self, all_gather_outputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The unsharded parameters a region copies out: one ``fsdp.copy_out`` per part, and views of its outputs."""
        unsharded: list[torch.Tensor] = [None] * len(self.fsdp_params)  # type: ignore[list-item]
        for part, all_gather_output in zip(self.dtypes.all_gather_parts, all_gather_outputs):
            padded = ops.copy_out(all_gather_output, self.world_size, part.padded_numels)
            for index, flat, shape in zip(part.indices, padded, part.unsharded_shapes):
                unsharded[index] = _unpadded(flat.view(-1, *shape[1:]), shape[0])
        return unsharded

    def copy_out_traced(self, all_gather_outputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Copies out and shows the unsharded parameters from ``gather_traced``'s all-gather outputs."""
        settings = traced_settings(self, self.settings_version)
        with annotating_group(settings.annotation):
            tensors = self._copy_out(all_gather_outputs, settings.gather.all_gather_parts)
        for fsdp_param, tensor in zip(self.fsdp_params, tensors):
            fsdp_param.show_unsharded(tensor)
        return tensors

    def hide_traced_unsharded_params(self) -> None:
        """Inside a trace: ends what ``show_traced_unsharded_params`` or ``gather_traced`` began.

        Each write only where there is something to undo: Dynamo replays every object a
        trace wrote after each call of its graph, and formats a stack for each at compile
        time, a cost per group of every trace (a group its region copied out shows nothing
        in this trace).
        """
        if self.shown_params[0] is not None:
            self.shown_params[:] = [None] * len(self.shown_params)
        if self.traced_all_gather_outputs is not None:
            self.traced_all_gather_outputs = None

    def _watch_use(self, tensors: list[torch.Tensor]) -> None:
        """Watches each unsharded parameter for whether backward reaches it ([Note: unused parameters] in
        passes.unused_params)."""
        if not self.settings.reduce_scatter_unused_params:
            for fsdp_param, tensor in zip(self.fsdp_params, tensors):
                if tensor.requires_grad:
                    fsdp_param.watch_use(tensor)

    def _drop_unused_gradients(self, all_gather_outputs: list[torch.Tensor]) -> None:
        """Each eager all-gather's backward gives no gradient to a parameter no forward used since the last reduction.

        ([Note: unused parameters] in passes.unused_params.) A hook on the all-gather's
        node, which sees the reduced gradient of each shard (the node's last inputs) before
        autograd adds what other backwards give the same shard: a compiled forward beside
        an eager call of one of its modules (a chunked loss's head) reduces the group's
        parameters in both. Weakly held, as in ``_register_post_backward``.
        """
        if self.settings.reduce_scatter_unused_params:
            return
        group_ref = weakref.ref(self)
        for part, output in zip(self.dtypes.all_gather_parts, all_gather_outputs):
            if output.grad_fn is None:
                continue

            def hook(grad_inputs, grad_outputs, indices=part.indices):
                group = group_ref()
                if group is None:
                    return None
                head, grads = grad_inputs[: -len(indices)], grad_inputs[-len(indices) :]
                kept = [group.fsdp_params[index].reduced_gradient_if_used(grad) for index, grad in zip(indices, grads)]
                return (*head, *kept)

            output.grad_fn.register_hook(hook)
