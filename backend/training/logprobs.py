"""The trained tokens' logprobs: a micro-batch's rows packed into one forward pass, and the
output layer applied only where a token is trained, a chunk at a time, so the batch's
full-vocabulary logits are never held in memory at once."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from .batch import Row, TrainSequence

__all__ = [
    "ChosenLogprobs",
    "PackedInputs",
    "SequenceViews",
    "chunk_logprobs",
    "packed_inputs",
    "sequence_views",
    "token_logprobs",
]


@dataclass
class PackedInputs:
    input_ids: torch.Tensor  # (R, W)
    position_ids: torch.Tensor  # (R, W)
    attention: torch.Tensor  # (R, 1, W, W) bool, True where a query may attend to a key
    where: list[list[int]]
    """For each sequence of the micro-batch (rows in order), the flat index (row * W + column)
    of each of its tokens."""


@dataclass
class SequenceViews:
    """(B, T-1) per-sequence views for the loss, on the model's device, and what the host knows
    of them (which tokens and sequences are trained) as index tensors, so that selecting them
    needs no boolean indexing and no wait for the device. Token t is predicted from position
    t-1, so targets and their masks are shifted by one."""

    where: torch.Tensor  # (B, T-1) packed index of the position that predicts each target
    targets: torch.Tensor  # (B, T-1)
    mask: torch.Tensor  # (B, T-1) float, 1 for trained targets
    sampling: torch.Tensor  # (B, T-1) vLLM's logprobs, NaN where unknown
    trained: torch.Tensor  # (N,) flat index into (B, T-1) of the trained targets, in order
    live: torch.Tensor  # (L,) the sequences with at least one trained target
    tokens: int
    """N, the trained targets."""


def sequence_views(
    sequences: list[TrainSequence], where: list[list[int]], device: torch.device | str = "cpu"
) -> SequenceViews:
    """The micro-batch's views, built on the host and moved to ``device`` once each."""
    width = max(len(s) for s in sequences)
    index = torch.zeros((len(sequences), width), dtype=torch.long)
    targets = torch.zeros((len(sequences), width), dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.float32)
    sampling = torch.full((len(sequences), width), math.nan, dtype=torch.float32)
    trained: list[int] = []
    live: list[int] = []
    for b, (sequence, places) in enumerate(zip(sequences, where, strict=True)):
        n = len(sequence)
        index[b, :n] = torch.tensor(places)
        targets[b, :n] = torch.tensor(sequence.tokens)
        mask[b, :n] = torch.tensor(sequence.mask, dtype=torch.float32)
        sampling[b, :n] = torch.tensor(sequence.sampling_logprobs, dtype=torch.float32)
        chosen = [b * (width - 1) + t - 1 for t in range(1, n) if sequence.mask[t]]
        trained += chosen
        if chosen:
            live.append(b)

    def placed(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(device, non_blocking=True)

    return SequenceViews(
        where=placed(index[:, :-1]),
        targets=placed(targets[:, 1:]),
        mask=placed(mask[:, 1:]),
        sampling=placed(sampling[:, 1:]),
        trained=placed(torch.tensor(trained, dtype=torch.long)),
        live=placed(torch.tensor(live, dtype=torch.long)),
        tokens=len(trained),
    )


def packed_inputs(rows: list[Row], pad: int, device: torch.device | str = "cpu") -> PackedInputs:
    """The rows' tokens and positions, moved to ``device``; the (R, 1, W, W) mask is made there."""
    width = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    # Padding attends to itself only, so no query row is fully masked (that gives NaN).
    segment = torch.arange(width).repeat(len(rows), 1)  # (R, W)
    prefix = torch.zeros((len(rows), 1, 1), dtype=torch.long)
    where: list[list[int]] = []
    for r, row in enumerate(rows):
        tokens, positions, segments, index = row.layout()
        n = len(tokens)
        input_ids[r, :n] = torch.tensor(tokens)
        position_ids[r, :n] = torch.tensor(positions)
        segment[r, :n] = torch.tensor(segments)
        prefix[r] = row.prefix
        where += [[r * width + i for i in sequence] for sequence in index]
    segment, prefix = segment.to(device, non_blocking=True), prefix.to(device, non_blocking=True)
    q = torch.arange(width, device=device)[:, None]  # (W, 1)
    k = torch.arange(width, device=device)[None, :]  # (1, W)
    attention = (k <= q) & ((k >= segment[:, :, None]) | (k < prefix))  # (R, W, W)
    return PackedInputs(
        input_ids.to(device, non_blocking=True),
        position_ids.to(device, non_blocking=True),
        attention[:, None],
        where,
    )


def token_logprobs(
    model: Any, inputs: PackedInputs, views: SequenceViews, chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs (with gradient) and entropies (detached) of the trained target tokens, (B, T-1).

    One forward pass over the packed rows; logits are computed only at trained positions and
    ``chunk`` positions at a time, each chunk recomputed in the backward pass, so the
    full-vocabulary logits of the batch are never held in memory at once. Nothing here waits
    for the device: the trained positions are indices the host already knows.
    """
    causal_lm = model.get_base_model()
    hidden = causal_lm.get_decoder()(
        input_ids=inputs.input_ids, position_ids=inputs.position_ids, attention_mask=inputs.attention
    ).last_hidden_state  # (R, W, H)
    chosen_hidden = hidden.flatten(0, 1)[views.where.flatten()[views.trained]]  # (N, H)
    chosen_targets = views.targets.flatten()[views.trained]  # (N,)
    head = causal_lm.get_output_embeddings()
    frozen_head = type(head) is torch.nn.Linear and head.bias is None and not head.weight.requires_grad
    pieces, entropies = [], []
    for start in range(0, views.tokens, chunk):
        piece = chosen_hidden[start : start + chunk], chosen_targets[start : start + chunk]
        if frozen_head:
            logprob, entropy = ChosenLogprobs.apply(*piece, head.weight)  # type: ignore[no-untyped-call]
        else:  # a trained head: let autograd see it, recomputing the chunk's logits in backward
            logprob, entropy = checkpoint(chunk_logprobs, *piece, head, use_reentrant=False)
        pieces.append(logprob)
        entropies.append(entropy)
    flat = torch.cat(pieces) if pieces else hidden.new_zeros(0, dtype=torch.float32)
    shape, device = views.mask.shape, views.mask.device
    logprobs = torch.zeros(shape.numel(), dtype=torch.float32, device=device).index_put(
        (views.trained,), flat
    )
    entropy = torch.zeros(shape.numel(), dtype=torch.float32, device=device)
    if entropies:
        entropy = entropy.index_put((views.trained,), torch.cat(entropies))
    return logprobs.view(shape), entropy.view(shape)


class ChosenLogprobs(torch.autograd.Function):
    """log softmax(h W^T)[target] and the entropy for a chunk of positions, through a frozen
    output layer W. Nothing of vocabulary size is kept for backward: the logits are recomputed
    there and turned into their gradient in place, (onehot(target) - softmax) x grad."""

    @staticmethod
    def forward(
        ctx: Any, hidden: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = (hidden @ weight.t()).float()  # (n, V)
        lse = logits.logsumexp(-1)  # (n,)
        chosen = logits.gather(-1, targets[:, None]).squeeze(-1) - lse
        logits.sub_(lse[:, None])  # now log-probabilities
        entropy = -(logits.exp() * logits).sum(-1)
        ctx.save_for_backward(hidden, targets, weight, lse)
        ctx.mark_non_differentiable(entropy)
        return chosen, entropy

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _entropy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, targets, weight, lse = ctx.saved_tensors
        logits = (hidden @ weight.t()).float()
        grad_logits = logits.sub_(lse[:, None]).exp_().mul_(-grad[:, None])  # -softmax x grad
        grad_logits[torch.arange(len(targets), device=targets.device), targets] += grad
        return grad_logits.to(hidden.dtype) @ weight, None, None


def chunk_logprobs(
    hidden: torch.Tensor, targets: torch.Tensor, head: torch.nn.Module
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = head(hidden).float()  # (n, V)
    logp = logits.log_softmax(-1)
    chosen = logp.gather(-1, targets[:, None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return chosen, entropy.detach()
