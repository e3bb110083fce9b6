"""Relaxed acceptance for thinking models (TensorRT-LLM ``use_relaxed_acceptance_for_thinking``). LOSSY.

While a request is inside ``<think> ... </think>``, draft j is accepted if it equals the sampled target token
**or** it is among the target's ``relaxed_topk`` most likely tokens (softmax of the raw target logits) with
probability >= top-1 probability - ``relaxed_delta``. Outside thinking the rule is strict (draft == target
token), so with the markers never seen, or ``relaxed_topk = 1`` on greedy requests, output stays exactly the
target's. Inside thinking the output is no longer the target's own: accepted rows hold the *draft* tokens
(the bonus / correction row still holds the target's token). Off by default (``MTPConfig``).

Thinking state lives per KV slot on the device. A context request starts in the state its prompt leaves
(the later of its last begin / end marker; a prompt prefilled in chunks keeps the state in its slot between
chunks); each step the state switches at every marker among the accepted tokens. Unlike TensorRT-LLM's
kernel, which evaluates a whole window with the state at the start of the step, the state here switches at the marker's position inside the window: a draft after an accepted
``</think>`` is judged strictly, one after an accepted ``<think>`` relaxed.
"""
from __future__ import annotations

import torch
from torch import nn


class RelaxedAcceptance(nn.Module):
    """Per-slot thinking state plus the relaxed rule (see the module docstring)."""

    def __init__(self, relaxed_topk: int, relaxed_delta: float, begin_thinking_token: int,
                 end_thinking_token: int, max_batch_size: int, device: torch.device | str):
        super().__init__()
        self.topk, self.delta = relaxed_topk, relaxed_delta
        self.begin, self.end = begin_thinking_token, end_thinking_token
        self.register_buffer("thinking_per_slot", torch.zeros(max_batch_size + 1, dtype=torch.bool, device=device),
                             persistent=False)  # [slots + the CUDA-graph padding slot] bool

    def start_state(self, input_ids: torch.Tensor, ctx_last_ids: torch.Tensor, slots: torch.Tensor,
                    continued: torch.Tensor | None = None) -> torch.Tensor:
        """Thinking state of each request before this step's drafts. input_ids [T]; ctx_last_ids [C] flat index of
        each context request's last prompt token; slots [B] (context first); continued [C] bool or None (none):
        context requests whose tokens continue a prompt chunked over several steps, which start from the state
        kept for their slot. Returns [B] bool."""
        num_ctx = ctx_last_ids.shape[0]
        carried = None if continued is None else continued & self.thinking_per_slot[slots[:num_ctx]]
        ctx_state = prompt_thinking_state(input_ids, ctx_last_ids, self.begin, self.end, carried)
        return torch.cat([ctx_state, self.thinking_per_slot[slots[num_ctx:]]])

    def prefix_reused(self, slot: int, tokens: list[int]) -> None:
        """A prompt's first tokens came from the prefix cache: the slot's state after them (its last marker)."""
        markers = [t for t in tokens if t in (self.begin, self.end)]
        self.thinking_per_slot[slot] = bool(markers) and markers[-1] == self.begin

    def accept(self, gen_logits: torch.Tensor, gen_target_tokens: torch.Tensor, draft_tokens: torch.Tensor,
               thinking: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Generation requests. gen_logits [G*(K+1), V]; gen_target_tokens [G*(K+1)]; draft_tokens [G, K];
        thinking [G] bool. Returns (num_accepted [G] with the bonus, tokens [G, K+1])."""
        num_gen, k = draft_tokens.shape
        logits = gen_logits.view(num_gen, k + 1, gen_logits.shape[-1])
        return relaxed_acceptance(logits, gen_target_tokens.view(num_gen, k + 1),
                                  draft_tokens, thinking, self.topk, self.delta, self.begin, self.end)

    def commit(self, new_tokens: torch.Tensor, num_accepted: torch.Tensor, thinking: torch.Tensor,
               slots: torch.Tensor) -> None:
        """Store each request's state after its accepted tokens. new_tokens [B, K+1]; num_accepted, thinking,
        slots [B]."""
        state = thinking_state_after(new_tokens, num_accepted, thinking, self.begin, self.end)
        self.thinking_per_slot.index_copy_(0, slots, state)


def relaxed_acceptance(logits: torch.Tensor, target_tokens: torch.Tensor, draft_tokens: torch.Tensor,
                       thinking: torch.Tensor, topk: int, delta: float, begin: int, end: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [G, K+1, V]; target_tokens [G, K+1] (sampled); draft_tokens [G, K]; thinking [G] bool (state
    before draft 0). Returns (num_accepted [G] = 1 + accepted drafts, tokens [G, K+1]: drafts, then the target
    token at row num_accepted - 1)."""
    num_gen, k = draft_tokens.shape
    probs = logits[:, :k].float().softmax(-1)
    top_probs, top_ids = probs.topk(min(topk, probs.shape[-1]), dim=-1)  # [G, K, topk] descending
    close = top_probs >= top_probs[..., :1] - delta  # candidate j qualifies: p_j >= p_1 - delta
    relaxed_ok = ((top_ids == draft_tokens[..., None]) & close).any(-1)
    in_thinking = _state_before_each(draft_tokens, thinking, begin, end)  # [G, K]
    accepted = (draft_tokens == target_tokens[:, :k]) | (in_thinking & relaxed_ok)
    num_accepted = 1 + accepted.to(torch.int64).cumprod(dim=1).sum(dim=1)
    columns = torch.arange(k + 1, device=draft_tokens.device)
    padded = torch.cat([draft_tokens, target_tokens[:, k:]], dim=1)
    tokens = torch.where(columns < (num_accepted - 1)[:, None], padded, target_tokens)
    return num_accepted, tokens


def prompt_thinking_state(input_ids: torch.Tensor, ctx_last_ids: torch.Tensor, begin: int, end: int,
                          carried: torch.Tensor | None = None) -> torch.Tensor:
    """Per context request: did its prompt's last marker open thinking? input_ids [T] (context requests'
    prompts first, back to back, then generation tokens); ctx_last_ids [C] int64; carried [C] bool or None
    (all False): the state before each prompt's tokens here (a chunk's earlier chunks), kept where they hold no
    marker. Returns [C] bool."""
    if ctx_last_ids.numel() == 0:
        return torch.zeros(0, dtype=torch.bool, device=input_ids.device)
    # generation tokens follow every prompt, so a running maximum up to a prompt's end only sees prompts
    marker = (input_ids == begin).to(torch.int8) - (input_ids == end).to(torch.int8)  # +1 open, -1 close, 0
    positions = torch.arange(input_ids.shape[0], device=input_ids.device)
    last_marker = torch.where(marker != 0, positions, -1).cummax(0).values[ctx_last_ids]
    starts = torch.cat([ctx_last_ids.new_zeros(1), ctx_last_ids[:-1] + 1])
    opened = marker[last_marker.clamp(min=0)] == 1
    found = last_marker >= starts
    return found & opened if carried is None else torch.where(found, opened, carried)


def thinking_state_after(tokens: torch.Tensor, num_accepted: torch.Tensor, thinking: torch.Tensor, begin: int,
                         end: int) -> torch.Tensor:
    """State after the first num_accepted tokens of each row. tokens [B, K+1]; num_accepted [B]; thinking [B]
    bool (before them). Returns [B] bool."""
    columns = torch.arange(tokens.shape[1], device=tokens.device)
    valid = columns < num_accepted[:, None]
    return _last_marker_state(tokens, valid, thinking, begin, end)


def _state_before_each(draft_tokens: torch.Tensor, thinking: torch.Tensor, begin: int, end: int) -> torch.Tensor:
    """[G, K] bool: state when draft j is judged = after drafts 0..j-1 (all accepted if j is reached)."""
    k = draft_tokens.shape[1]
    states = [thinking]
    columns = torch.arange(k, device=draft_tokens.device)
    for j in range(1, k):
        states.append(_last_marker_state(draft_tokens, columns < j, thinking, begin, end))
    return torch.stack(states, dim=1)


def _last_marker_state(tokens: torch.Tensor, valid: torch.Tensor, thinking: torch.Tensor, begin: int, end: int
                       ) -> torch.Tensor:
    """The state set by the last marker among tokens[b, valid[b]], else thinking[b]. [B] bool."""
    is_marker = ((tokens == begin) | (tokens == end)) & valid
    columns = torch.arange(tokens.shape[1], device=tokens.device)
    last = torch.where(is_marker, columns, -1).max(dim=1).values
    opened = tokens.gather(1, last.clamp(min=0)[:, None])[:, 0] == begin
    return torch.where(last >= 0, opened, thinking)
