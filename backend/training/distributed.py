"""Data-parallel training under ``torch.distributed`` (``torchrun`` / ``accelerate launch``).

Every rank holds the whole LoRA model and runs the same :meth:`Trainer.train_step` on the same
groups. Advantages and the loss denominators are computed from the whole batch on every rank;
each rank then forwards and backwards only its share of the sequences (whole trajectories,
balanced by tokens). Since each micro-batch's loss is already weighted by its share of the
*global* denominator, the batch gradient is the sum of the ranks' gradients: one coalesced
``all_reduce(SUM)`` of the LoRA gradients makes it exact, and every rank then clips and steps
identically. Only rank 0 writes checkpoints and deploys.

``DataParallelTrainer(..., fsdp=True)`` (``journeyman serve --fsdp``) is for a base model too big
for one process: FSDP2's ``fully_shard`` splits each decoder layer (base and LoRA weights, their
gradients and optimizer state) across the ranks and gathers a layer only while it runs. The step
is the same; the engine reduce-scatters the gradients with a SUM. The embeddings, final norm and
output layer stay whole on every rank (the logprob kernel uses the output weight directly), so
the adapter must stay inside the decoder layers. Every rank opens the whole base model on the CPU
(memory-mapped when it is loaded in the file's dtype, else converted in memory) and keeps its
shards. Rank 0 gathers the adapter and optimizer state into checkpoints that a single process
can resume from.

Two ways to drive it:

- SPMD: every rank builds a :class:`DataParallelTrainer` and calls ``train_step`` with the same
  groups (a training script launched with ``torchrun --nproc-per-node N script.py``).
- ``journeyman serve`` under ``torchrun``: rank 0 serves HTTP with a :class:`LeaderTrainer`,
  which broadcasts each load and train command; the other ranks run :func:`follow`.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from journeyman.config import LoRAConfig, TrainConfig
from journeyman.errors import ConfigError
from journeyman.store import ModelStore
from journeyman.trajectory import TrajectoryGroup

from .batch import Row, TrainSequence, pack
from .memory import release_memory
from .metrics import StepTotals
from .trainer import StepResult, Trainer

try:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, distribute_tensor
except ImportError:  # pragma: no cover - trainer.py raised already
    raise

__all__ = [
    "DataParallelTrainer",
    "LeaderTrainer",
    "chosen_device",
    "follow",
    "init_distributed",
    "rank_device",
    "shard",
    "world",
]

logger = logging.getLogger(__name__)


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) outside ``torch.distributed``."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def rank_device(
    local_rank: int, cuda_devices: int, train_device: str = "auto", *, local_world_size: int = 1
) -> str:
    """The device a rank trains on: ``"cpu"``, or ``"cuda:<local_rank>"``, a GPU of its own.

    ``train_device="cpu"`` puts every rank on the CPU (data parallelism needs no GPU there);
    ``"cuda"`` gives local rank k the k-th of the ``cuda_devices`` GPUs this process sees;
    ``"auto"`` is ``"cuda"`` where there is a GPU, else ``"cpu"``. More ranks on this machine
    (``local_world_size``, torchrun's ``--nproc-per-node``) than GPUs is a :class:`ConfigError`
    on every rank, not CUDA's "invalid device ordinal" on some. An Unsloth rank loads onto its
    GPU with ``device_map={"": local_rank}`` (Unsloth's ``"sequential"`` would fill GPU 0 from
    every rank).
    """
    if train_device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"train_device must be auto, cpu or cuda, got {train_device!r}")
    if train_device == "cpu" or (train_device == "auto" and cuda_devices == 0):
        return "cpu"
    if cuda_devices == 0:
        raise ConfigError(
            "train_device='cuda', but this process sees no CUDA GPU: check the driver and "
            "CUDA_VISIBLE_DEVICES, or train on the CPU (train_device='cpu')"
        )
    ranks = max(local_rank + 1, local_world_size)
    if ranks > cuda_devices:
        raise ConfigError(
            f"{ranks} training processes on this machine, but it has {cuda_devices} CUDA GPU(s), and "
            f"each process that trains on CUDA needs a GPU of its own: lower --nproc-per-node to "
            f"{cuda_devices} or fewer, or train on the CPU (train_device='cpu')"
        )
    return f"cuda:{local_rank}"


_chosen_device: str | None = None


def chosen_device() -> str | None:
    """The device :func:`init_distributed` picked for this rank (:func:`rank_device`); None before it ran."""
    return _chosen_device


def init_distributed(train_device: str = "auto") -> tuple[int, int]:
    """Join the process group ``torchrun`` describes in the environment; return (rank, world size).

    The rank's device is :func:`rank_device`'s for ``train_device`` (:func:`chosen_device` keeps
    it). A rank that trains on CUDA makes its GPU the current device and joins with gloo for CPU
    tensors and nccl for CUDA ones (each collective goes to the backend of its tensors' device);
    a CPU rank joins with gloo alone and never touches a GPU.
    """
    global _chosen_device
    _chosen_device = rank_device(
        int(os.environ.get("LOCAL_RANK", "0")),
        torch.cuda.device_count(),
        train_device,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
    )
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        if not dist.is_available():
            raise ConfigError("this torch build has no torch.distributed: install a standard torch wheel")
        backend = "gloo"
        if _chosen_device.startswith("cuda"):
            torch.cuda.set_device(_chosen_device)
            backend = "cpu:gloo,cuda:nccl"
        dist.init_process_group(backend)
    return world()


def shard(sequences: Sequence[TrainSequence], rank: int, size: int) -> list[TrainSequence]:
    """This rank's sequences: whole trajectories (their turns share prefixes), balanced by tokens.

    Deterministic, so every rank computes the same assignment from the same batch.
    """
    by_trajectory: dict[int, list[TrainSequence]] = defaultdict(list)
    for sequence in sequences:
        by_trajectory[sequence.trajectory].append(sequence)
    load = [0] * size
    owner: dict[int, int] = {}
    heaviest_first = sorted(by_trajectory.items(), key=lambda item: (-sum(map(len, item[1])), item[0]))
    for trajectory, members in heaviest_first:
        chosen = min(range(size), key=lambda r: (load[r], r))
        owner[trajectory] = chosen
        load[chosen] += sum(map(len, members))
    return [s for s in sequences if owner[s.trajectory] == rank]


class DataParallelTrainer(Trainer):
    """A :class:`Trainer` whose steps are split across the ranks of the process group."""

    supports_sft = False

    def __init__(self, *args: Any, fsdp: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        spec = "cuda" if self.train_device.startswith("cuda") else self.train_device
        self.rank, self.world_size = init_distributed(spec)
        self._device = torch.device(chosen_device() or "cpu")  # the rank's own GPU, or the CPU
        self.fsdp = fsdp and self.world_size > 1
        """Shard the decoder layers across the ranks (FSDP2) instead of holding the whole model on each."""
        if self.fsdp and self.uses_unsloth:
            raise ConfigError("fsdp=True works with engine='transformers'; Unsloth trains on one GPU")

    def load(self) -> int:
        """Rank 0 loads (or creates) the checkpoint; its adapter, optimizer state and step are
        broadcast, so the other ranks need no shared disk."""
        if self.rank == 0:
            super().load()
        if self.world_size > 1:
            dist.barrier()
        if self.rank != 0:
            super().load()  # the base model and a LoRA of the right shape; values come from rank 0
        if self.world_size > 1:
            self._broadcast_state()
        if self.fsdp:
            self._shard()
        return self.step

    def _shard(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, fully_shard

        decoder = self.model.get_base_model().get_decoder()
        in_layers = {id(p) for p in decoder.layers.parameters()}
        outside = [name for name, p in self._trainable() if id(p) not in in_layers]
        if outside:
            raise ConfigError(
                f"fsdp=True shards the decoder layers, but {outside[0]} is trained outside them: "
                "leave the embeddings and output layer out of LoRAConfig.target_modules, or drop fsdp"
            )
        held = self.optimizer.state if self.optimizer is not None else {}
        states = {name: held[p] for name, p in self._trainable() if p in held}
        mesh = init_device_mesh(self.device.type, (self.world_size,))  # FSDP over gloo, or NCCL on GPUs
        for layer in decoder.layers:
            fully_shard(layer, mesh=mesh)
        whole = {p for p in decoder.parameters() if not isinstance(p, DTensor)}
        fully_shard(decoder, mesh=mesh, ignored_params=whole)  # the root: embeddings and norm stay whole
        for parameter in whole:  # copied off the model file's memory map, which then closes
            parameter.data = parameter.data.clone()
        for module in decoder.modules():
            if isinstance(module, FSDPModule):
                # SUM, not the mean: each rank's loss is already weighted by the global batch
                # (and gloo has no pre-multiplied sum).
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
        release_memory(self.device)  # the whole layers' memory, now freed (fp32: 1191 -> 784 MiB per rank)
        self.optimizer = None  # its parameters were replaced by their shards
        if states:
            optimizer = self._optimizer(TrainConfig(learning_rate=self._learning_rate or 1e-5))
            for name, parameter in self._trainable():
                if name in states:
                    optimizer.state[parameter] = {
                        key: _shard_like(value, parameter) for key, value in states[name].items()
                    }

    def _broadcast_state(self) -> None:
        for _, parameter in self._trainable():
            dist.broadcast(parameter.data, src=0)
        state: list[Any] = [None]
        if self.rank == 0:
            index = {id(p): name for name, p in self._trainable()}
            held = {} if self.optimizer is None else self.optimizer.state
            tensors = {
                index[id(p)]: {k: torch.as_tensor(v).cpu() for k, v in s.items()} for p, s in held.items()
            }
            state = [(self.step, self._learning_rate, tensors)]
        dist.broadcast_object_list(state, src=0)
        self.step, learning_rate, tensors = state[0]
        if self.rank != 0:
            self.optimizer = None
            self._set_optimizer_state(tensors, learning_rate)

    def _save_checkpoint(self, step: int, metrics: dict[str, float] | None = None) -> Path:
        tensors = self._checkpoint_tensors()  # under FSDP a collective: every rank gathers
        if self.rank == 0:
            return self._write_checkpoint(step, metrics, *tensors)
        return self.store.checkpoint_path(step)

    def _checkpoint_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        adapter, optimizer = super()._checkpoint_tensors()
        return _gathered(adapter), _gathered(optimizer)

    def _checkpoint_timed(self, metrics: dict[str, float]) -> Path:
        path = super()._checkpoint_timed(metrics)
        if self.world_size > 1:
            dist.barrier()  # no rank runs ahead of the checkpoint that will be deployed
        return path

    def _local_share(self, sequences: list[TrainSequence]) -> list[TrainSequence]:
        return shard(sequences, self.rank, self.world_size)

    def _micro_batches(
        self, sequences: list[TrainSequence], config: TrainConfig
    ) -> list[tuple[list[Row], bool]]:
        micro_batches = super()._micro_batches(sequences, config)
        if not self.fsdp:
            return micro_batches
        # FSDP gathers and reduces inside every pass: a rank with fewer micro-batches runs the
        # batch's shortest sequence with a weight of 0 until it has run as many as the others.
        most = torch.tensor([len(micro_batches)])
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        shortest = min(sequences, key=len)
        idle = pack([shortest], config.micro_batch_tokens, self._row_cost)[0]
        return micro_batches + [(idle, False)] * (int(most) - len(micro_batches))

    def _synchronise(self, params: list[torch.nn.Parameter], totals: StepTotals) -> None:
        if self.world_size == 1:
            return
        if not self.fsdp:  # FSDP reduced the gradients in the backward pass already
            self._all_reduce_gradients(params)
        totals.gather()  # this rank's sums on the host first
        device = params[0].device if params else torch.device("cpu")
        sums = torch.tensor(totals.sums(), dtype=torch.float64, device=device)
        dist.all_reduce(sums)
        totals.set_sums(sums.tolist())
        largest = torch.tensor([totals.max_ratio], dtype=torch.float64, device=device)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        totals.max_ratio = float(largest)

    def _all_reduce_gradients(self, params: list[torch.nn.Parameter]) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)  # SUM: each rank's gradient is already weighted by the global batch
        offset = 0
        for parameter in params:
            n = parameter.numel()
            parameter.grad = flat[offset : offset + n].view_as(parameter).clone()
            offset += n

    async def train(self, groups: Sequence[TrajectoryGroup], config: TrainConfig | None = None) -> StepResult:
        if self.rank != 0:
            raise ConfigError("only rank 0 calls train(); the other ranks call train_step or follow()")
        return await super().train(groups, config)


def _gathered(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Whole tensors from FSDP's shards (a collective, in the same order on every rank)."""
    return {key: t.full_tensor() if isinstance(t, DTensor) else t for key, t in tensors.items()}


def _shard_like(value: torch.Tensor, parameter: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a whole optimizer state tensor (every rank holds the whole one)."""
    if isinstance(parameter, DTensor) and value.shape == parameter.shape:
        return distribute_tensor(value, parameter.device_mesh, parameter.placements, src_data_rank=None)
    return value


# journeyman serve under torchrun: rank 0 leads, the others follow ----------------------------

_LOAD, _TRAIN, _STOP = "load", "train", "stop"


def _send(command: tuple[Any, ...]) -> None:
    dist.broadcast_object_list([command], src=0)


def _stop_followers() -> None:
    """At rank 0's exit: tell the followers to stop (they may be gone already, e.g. killed), wait
    for them, and leave the process group together. A rank that exits while another still holds
    its gloo connections can abort in the interpreter's teardown (``terminate called without an
    active exception``); the barrier keeps the ranks from leaving apart."""
    try:
        _send((_STOP,))
        dist.barrier()
    except RuntimeError as error:
        logger.info("the other ranks had stopped already (%s)", str(error).splitlines()[0][:200])
    if dist.is_initialized():
        dist.destroy_process_group()


class LeaderTrainer(DataParallelTrainer):
    """Rank 0's trainer in ``journeyman serve``: tells the followers what to load and train."""

    _stop_registered = False

    def _key(self) -> tuple[str, str, str]:
        return self.store.project, self.store.model, str(self.store.root)

    def load(self) -> int:
        if self.world_size > 1:
            if not LeaderTrainer._stop_registered:
                atexit.register(_stop_followers)
                LeaderTrainer._stop_registered = True
            options = {
                "lora": self.lora,
                "precision": self.precision,
                "threads": self.threads,
                "seed": self.seed,
                "fsdp": self.fsdp,
                "device": self.train_device,
            }
            _send((_LOAD, self._key(), str(self.base_model), options))
        return super().load()

    def train_step(self, groups: Sequence[TrajectoryGroup], config: TrainConfig) -> StepResult:
        if self.world_size > 1:
            _send((_TRAIN, self._key(), list(groups), config))
        return super().train_step(groups, config)


def follow() -> None:
    """The loop of ranks 1..N-1 in ``journeyman serve``: run rank 0's commands until it stops."""
    rank, size = init_distributed()
    if rank == 0 or size == 1:
        raise ConfigError("follow() runs on ranks other than 0 of a torchrun launch")
    # Ctrl-C reaches every rank; rank 0 finishes its request, then tells the followers to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    trainers: dict[tuple[str, str, str], DataParallelTrainer] = {}
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        command = box[0]
        if command[0] == _STOP:
            logger.info("rank %d: rank 0 stopped", rank)
            dist.barrier()  # see _stop_followers
            dist.destroy_process_group()
            return
        key = command[1]
        if command[0] == _LOAD:
            _, _, base_model, options = command
            project, model, root = key
            lora: LoRAConfig = options.pop("lora")
            trainer = DataParallelTrainer(
                base_model, ModelStore(project, model, root=root), lora=lora, **options
            )
            trainer.load()
            trainers[key] = trainer
        elif command[0] == _TRAIN:
            _, _, groups, config = command
            trainers[key].train_step(groups, config)
