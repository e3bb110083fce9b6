"""SpecWorkerBase: target sampling, strict acceptance and forced acceptance over the flat layout."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..sampling import sampler
from ..sampling.forcing import forced_num_accepted, read_forced_num_accepted
from ..sampling.rejection import full_vocab_probs, rejection_sample
from .metadata import SpecMetadata

_SALT_TARGET, _SALT_DRAFT = 0x7A, 0xD7  # per-request streams share counters between target and draft draws

if TYPE_CHECKING:
    from ..guided.decoder import GuidedDecoder
    from .sa.enhancer import SADraftEnhancer
    from ..model.attention import AttentionMetadata
    from ..model.kv_cache import KVCache


class SpecWorkerBase(nn.Module, ABC):
    """The part of the one-model step after the target's logits: sample, accept, draft.

    Flat layout: ``num_ctx`` context requests (one target row each), then generation requests with
    ``k + 1`` rows each (row j verifies draft j+1; row k is the bonus); k = ``spec_metadata.draft_len`` (K =
    max_draft_len unless a draft-length schedule shortens the step). Output contract (TensorRT-LLM):
    ``new_tokens [B, k+1]`` accepted target tokens (first ``new_tokens_lens[b]`` valid),
    ``new_tokens_lens [B]``, ``next_draft_tokens [B, k']``, ``next_new_tokens [B, k'+1]`` (the next step's
    generation input: last accepted token + next drafts; k' = ``spec_metadata.next_draft_len``).
    """

    def __init__(self, max_draft_len: int, use_flashinfer: bool = True, use_rejection_sampling: bool = False):
        super().__init__()
        self.max_draft_len = max_draft_len
        self.use_flashinfer = use_flashinfer
        self.use_rejection_sampling = use_rejection_sampling
        # The forced count as the step reads it: a 0-dim f64 tensor (moved to the device with the state), so a
        # compiled step serves every value; ``forcing`` is the bool the step branches on.
        self.forced_value = torch.zeros((), dtype=torch.float64)
        self.forced_num_accepted = read_forced_num_accepted()
        self.draft_probs: torch.Tensor | None = None  # [slots, K, V] f32: what each slot's drafts were drawn from
        # (a tree's: [slots, P, V], one per node with children)
        self.guided_decoder: GuidedDecoder | None = None
        self.sa_enhancer: SADraftEnhancer | None = None  # use_sa_spec: drafts from the text where it repeats

    @property
    def forced_num_accepted(self) -> float | None:
        """TLLM_SPEC_DECODE_FORCE_NUM_ACCEPTED_TOKENS as read (None: off)."""
        return self._forced

    @forced_num_accepted.setter
    def forced_num_accepted(self, value: float | None) -> None:
        self._forced, self.forcing = value, value is not None
        self.forced_value.fill_(value or 0.0)

    def allocate_state(self, num_slots: int, vocab_size: int, device: torch.device, max_positions: int = 0) -> None:
        """Per-request device state kept across steps (indexed by KV slot): the draft distributions that
        rejection sampling verifies against at the next step; the forced count; an SA enhancer's texts (of at most
        ``max_positions`` tokens each)."""
        if self.use_rejection_sampling:
            self.draft_probs = torch.zeros(num_slots, self.draft_prob_rows, vocab_size, device=device)
        self.forced_value = self.forced_value.to(device)
        if self.sa_enhancer is not None:
            self.sa_enhancer.allocate(num_slots, max_positions, device)

    def _enhance_drafts(self, input_ids: torch.Tensor, new_tokens: torch.Tensor, num_accepted: torch.Tensor,
                        next_draft_tokens: torch.Tensor, attn: AttentionMetadata, spec_metadata: SpecMetadata,
                        slots: torch.Tensor, tree_chain: torch.Tensor | None = None) -> torch.Tensor:
        """With ``use_sa_spec``: the step's tokens added to each request's text, and the head's next drafts [B, k']
        replaced where the text repeats (slots [B]); a tree's (``tree_chain`` [B, D]: its first children) along
        that chain, for greedy requests. Else the drafts unchanged."""
        if self.sa_enhancer is None:
            return next_draft_tokens
        self.sa_enhancer.observe(input_ids, new_tokens, num_accepted, attn, spec_metadata, slots)
        if tree_chain is not None:
            greedy = spec_metadata.top_ks[spec_metadata.first_rows()] == 1  # greedy rows sample with top-k 1
            return self.sa_enhancer.override_tree(next_draft_tokens, tree_chain, slots, greedy)
        sampled = self.use_rejection_sampling and not spec_metadata.all_greedy
        return self.sa_enhancer.override(next_draft_tokens, slots, self.draft_probs if sampled else None)

    @property
    def draft_prob_rows(self) -> int:
        """Draft distributions kept per request for rejection sampling: one per draft of a chain."""
        return self.max_draft_len

    @abstractmethod
    def forward(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        """One speculative step after the target forward."""

    def kv_layer_shapes(self) -> list[tuple[int, int]]:
        """(num_kv_heads, head_dim) of the draft network's cache layers, placed after the target's."""
        return []

    def verify_metadata(self, attn: AttentionMetadata, num_context_tokens: int, num_generation: int,
                        draft_len: int) -> AttentionMetadata:
        """The step's attention metadata as its generation runs of ``draft_len`` drafts need it: a chain's as
        built (a draft tree's worker rotates and masks tree runs)."""
        return attn

    @property
    def context_lookahead(self) -> int:
        """Prompt tokens after a partial prompt chunk that its draft pass reads: the draft pairs position p with
        token p + 1, so 1 (vanilla MTP's module k reads token p + k: N). A partial chunk ends at least this many
        tokens before its prompt's end (chunked prefill)."""
        return 1

    @property
    def kv_lookahead(self) -> int:
        """Tokens after position p that the draft's K/V at p depends on (prefix caching keys a page with them):
        the draft pairs position p with token p + 1, so 1; vanilla MTP N; none (0) without a shifted draft."""
        return self.context_lookahead if self.kv_layer_shapes() else 0

    def prefix_reused(self, slot: int, tokens: list[int]) -> None:
        """A request in ``slot`` starts with ``tokens`` cached (prefix caching): its first prompt chunk starts
        past them. Per-slot state that reads the prompt from its first token takes them here (an SA enhancer's
        text); default none."""
        if self.sa_enhancer is not None:
            self.sa_enhancer.prefix_reused(slot, tokens)

    def draft_network(self) -> nn.Module | None:
        """The draft's own network (an EAGLE-3 head, MTP modules, a draft LM; None without one), whose linear
        layers ``draft_quantization`` quantizes before :meth:`fuse`."""
        return getattr(self, "draft_model", None)

    def shard_refusal(self, parallel) -> str | None:
        """Why the draft network cannot be split over the tensor-parallel group; None where it can (an EAGLE-3
        head of a shardable shape and dtype)."""
        return (f"tp_draft='sharded' splits an EAGLE-3 head; {type(self).__name__}'s draft is replicated: use "
                "tp_draft='replicated'")

    def shard_draft(self, parallel) -> None:
        """Split the draft network over the tensor-parallel group (``EngineConfig.tp_draft``), before
        :meth:`fuse`; only an EAGLE-3 head can be, the other drafts refuse (:meth:`shard_refusal`)."""
        raise ValueError(self.shard_refusal(parallel))

    def fuse(self, max_positions: int) -> None:
        """Switch the draft network to its fused inference layers (positions < max_positions); default none."""

    def compile(self) -> None:
        """torch.compile the draft network's passes for generation-only steps; default none."""

    def request_finished(self, token_ids: list[int]) -> None:
        """A request ended with ``token_ids`` (prompt and output; host list, between steps); default: nothing
        (suffix drafting's global pool keeps them)."""

    def bind_kv_cache(self, kv_cache: KVCache) -> None:
        """Point the draft's fused layers at ``kv_cache``'s tensors (as the runner does the target's); default
        none: the EAGLE-3 head and MTP modules address their KV layer by index."""

    def set_guided_decoder(self, guided_decoder: GuidedDecoder) -> bool:
        """Mask target rows and draft passes with ``guided_decoder``'s grammar bitmasks (TensorRT-LLM name)."""
        self.guided_decoder = guided_decoder
        return True

    def _execute_guided_decoder_if_present(self, logits: torch.Tensor) -> None:
        """Mask the target logits [R, V] in place with this step's grammar bitmasks, before any sampling or
        acceptance reads them (tensor ops on stable buffers: capturable)."""
        if self.guided_decoder is not None:
            self.guided_decoder.execute(logits)

    def _add_guided_draft_batch_if_present(self, num_accepted: torch.Tensor, last_nodes: torch.Tensor | None = None
                                           ) -> None:
        """Hand the accepted counts [B] (a tree step's: and its last accepted nodes [B]) to the guided decoder
        before drafting: it picks each request's draft-pass masks by them (a device gather)."""
        if self.guided_decoder is not None:
            self.guided_decoder.add_draft_batch(num_accepted, last_nodes)

    def sample_target(self, logits: torch.Tensor, spec_metadata: SpecMetadata) -> torch.Tensor:
        """Target tokens for every row. logits [R, V] -> [R] int64. An all-greedy step is a plain argmax."""
        if spec_metadata.all_greedy:
            return logits.argmax(-1)
        temps, top_ks, top_ps = spec_metadata.rows()
        seed, offset = spec_metadata.target_streams()
        return sampler.sample(logits, temps, top_ks, top_ps, seed, offset, self._flashinfer(spec_metadata),
                               salt=_SALT_TARGET)

    def _flashinfer(self, spec_metadata: SpecMetadata) -> bool:
        """FlashInfer samples from the batch stream only; per-request streams take the torch path."""
        return self.use_flashinfer and not spec_metadata.has_request_seeds

    def accept_tokens(self, target_tokens: torch.Tensor, draft_tokens: torch.Tensor, num_contexts: int,
                      spec_metadata: SpecMetadata, target_logits: torch.Tensor | None = None,
                      gen_slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Strict acceptance (or rejection sampling for sampled requests), then the forced override.

        target_tokens [R] int64; draft_tokens [G, k] int64 (the drafts being verified); with rejection
        sampling also target_logits [R, V] and gen_slots [G] (KV slot of each generation request).
        Returns (new_tokens [B, k+1] int64, num_accepted [B] int64 with the bonus counted).
        """
        k = draft_tokens.shape[1]
        num_accepted_gen, gen_tokens = strict_acceptance(target_tokens[num_contexts:], draft_tokens)
        if self.use_rejection_sampling and draft_tokens.numel() > 0 and not spec_metadata.all_greedy:
            gen_tokens, num_accepted_gen = self._rejection_sampling(
                target_logits[num_contexts:], draft_tokens, gen_slots, gen_tokens, num_accepted_gen, spec_metadata)
        if self.forcing:
            num_accepted_gen = forced_num_accepted(self.forced_value, k, draft_tokens.shape[0],
                                                   spec_metadata.seed, spec_metadata.offset)
        return with_context_rows(target_tokens, num_contexts, gen_tokens, num_accepted_gen)

    def _rejection_sampling(self, gen_logits: torch.Tensor, draft_tokens: torch.Tensor, gen_slots: torch.Tensor,
                            strict_tokens: torch.Tensor, strict_accepted: torch.Tensor, spec_metadata: SpecMetadata
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        """Probabilistic acceptance for sampled requests; greedy requests keep the strict result.

        Rows past the emitted ones hold the target's own samples (strict_tokens), so that forced acceptance,
        which may count more rows than rejection sampling emitted, still emits target tokens there.
        """
        num_gen, k = draft_tokens.shape
        temps, top_ks, top_ps = (x[spec_metadata.num_context_requests:] for x in spec_metadata.rows())
        probs = sampler.target_probs(gen_logits, temps, top_ks, top_ps).view(num_gen, k + 1, -1)
        seed, offset = spec_metadata.generation_streams()
        tokens, accepted = rejection_sample(probs, self.draft_probs[gen_slots, :k], draft_tokens, seed, offset,
                                            self._flashinfer(spec_metadata))
        emitted = torch.arange(k + 1, device=tokens.device) < accepted[:, None]
        tokens = torch.where(emitted, tokens, strict_tokens)
        greedy = top_ks.view(num_gen, k + 1)[:, 0] == 1
        return (torch.where(greedy[:, None], strict_tokens, tokens),
                torch.where(greedy, strict_accepted, accepted))

    def draft_tokens_from_logits(self, draft_logits: torch.Tensor, d2t: torch.Tensor | None, step: int,
                                 slots: torch.Tensor, spec_metadata: SpecMetadata) -> torch.Tensor:
        """Draft step ``step``: argmax (strict acceptance), or a sample at each request's temperature /
        top-k / top-p whose distribution is kept for rejection sampling (argmax in an all-greedy step, whose
        drafts are verified strictly). draft_logits [B, V_draft] -> [B]. A guided decoder first masks the
        logits in place with the step's draft-pass bitmask."""
        if self.guided_decoder is not None:
            self.guided_decoder.execute_draft_batch(draft_logits, d2t, step)
        if not self.use_rejection_sampling or spec_metadata.all_greedy:
            return sampler.greedy_draft_tokens(draft_logits, d2t)
        temps, top_ks, top_ps = (x[spec_metadata.first_rows()] for x in spec_metadata.rows())
        seed, offset = spec_metadata.draft_streams(step)
        ids = sampler.sample(draft_logits, temps, top_ks, top_ps, seed, offset, self._flashinfer(spec_metadata),
                              salt=_SALT_DRAFT)
        probs = sampler.target_probs(draft_logits, temps, top_ks, top_ps)
        self.draft_probs[slots, step] = full_vocab_probs(probs, d2t, self.draft_probs.shape[-1])
        return ids if d2t is None else ids + d2t[ids]

    @staticmethod
    def row_tokens(new_tokens: torch.Tensor, spec_metadata: SpecMetadata) -> torch.Tensor:
        """The token after each sampling row, in the flat row layout: the emitted one, or for a partial prompt
        chunk the next prompt token (its sampled token is discarded). new_tokens [B, K+1] -> [R]."""
        num_contexts = spec_metadata.num_context_requests
        rows = torch.cat([new_tokens[:num_contexts, 0], new_tokens[num_contexts:].flatten()])
        return spec_metadata.with_next_prompt_tokens(rows, 0)

    @staticmethod
    def _prepare_next_new_tokens(new_tokens: torch.Tensor, num_accepted: torch.Tensor,
                                 next_draft_tokens: torch.Tensor) -> torch.Tensor:
        """[last accepted token, k' next drafts] per request. new_tokens [B, k+1], num_accepted [B],
        next_draft_tokens [B, k'] -> [B, k'+1] int64."""
        last = new_tokens.gather(1, (num_accepted - 1).unsqueeze(1))
        return torch.cat([last, next_draft_tokens], dim=1)

    @staticmethod
    def _prepare_context_input_ids(input_ids: torch.Tensor, gather_ids: torch.Tensor,
                                   target_tokens: torch.Tensor) -> torch.Tensor:
        """Token ids for the draft's first pass: each position paired with the token that follows it.

        Inside a prompt that is the next prompt token; at every sampled row (a prompt's last token, each of
        a generation request's k+1 tokens) it is ``target_tokens``' entry: the token sampled there, or after a
        partial prompt chunk the prompt token that follows it (:meth:`row_tokens`).
        input_ids [T], gather_ids [R], target_tokens [R] -> [T] int64.
        """
        shifted = torch.roll(input_ids, -1)
        return shifted.index_copy(0, gather_ids, target_tokens)


def with_context_rows(target_tokens: torch.Tensor, num_contexts: int, gen_tokens: torch.Tensor,
                      gen_accepted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's (new_tokens [B, W], num_accepted [B]): each context request's one sampled token (its first
    row, the rest zero) and count 1, then the generation requests' gen_tokens [G, W] and gen_accepted [G]."""
    ctx_tokens = target_tokens.new_zeros(num_contexts, gen_tokens.shape[1])
    ctx_tokens[:, 0] = target_tokens[:num_contexts]
    return torch.cat([ctx_tokens, gen_tokens]), torch.cat([gen_accepted.new_ones(num_contexts), gen_accepted])


def strict_acceptance(gen_target_tokens: torch.Tensor, draft_tokens: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept drafts while draft == target: n = 1 + cumprod(draft == target[:, :k]).sum(-1).

    gen_target_tokens [G*(k+1)] int64; draft_tokens [G, k]. Returns (num_accepted [G], tokens [G, k+1]).
    """
    num_gen, k = draft_tokens.shape
    tokens = gen_target_tokens.view(num_gen, k + 1)
    matches = (draft_tokens == tokens[:, :k]).to(torch.int64)
    return 1 + matches.cumprod(dim=1).sum(dim=1), tokens
