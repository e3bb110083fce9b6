"""ModelRunner: the one-model step and everything around it on one device — the KV cache, the sampling rows,
the draft-length schedule, step inputs from host lists, and the CUDA graphs (compiled or not)."""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from ..config import EngineConfig, SamplingParams
from ..drafts.base import SpecWorkerBase
from ..drafts.metadata import SpecMetadata, sampling_variant
from ..guided.decoder import GuidedDecoder
from ..guided.grammar import GrammarCompiler
from ..model.attention import AttentionMetadata
from ..distributed.parallel import min_over_ranks
from ..model.decoder import is_moe, refuse_unsupported_moe
from ..model.kv_cache import KVCache
from ..model.target import TargetModel
from ..modes import SpeculativeDecodingMode
from ..one_model import OneModel, packed_columns
from ..sampling import flashinfer_ops
from ..sampling.forcing import read_forced_num_accepted
from ..sampling.logprobs import MAX_LOGPROBS
from .cuda_graphs import CUDAGraphRunner, compile_pays
from .draft_len import DraftLenSchedule

_DEFAULT_MAX_SEQ_LEN = 8192


class ModelRunner:
    """Owns the :class:`OneModel` and runs its steps. The engine above it sees host lists in and packed
    outputs [B, 2K+3 (+ logprob columns)] out (:meth:`step`, :meth:`run_next`); nothing here knows about
    requests."""

    def __init__(self, target: TargetModel, worker: SpecWorkerBase, mode: SpeculativeDecodingMode,
                 engine_config: EngineConfig, tokenizer=None, draft_len_schedule: Mapping[int, int] | None = None):
        self.engine_config, self.tokenizer = engine_config, tokenizer
        self.max_draft_len = worker.max_draft_len
        tree_step = getattr(worker, "tree_step", None)
        self.schedule = DraftLenSchedule(self.max_draft_len, draft_len_schedule, fixed=mode.is_mtp_vanilla(),
                                         tree_depth=tree_step.max_depth if tree_step is not None else None)
        self.max_batch_size = engine_config.max_batch_size
        self.max_seq_len = engine_config.max_seq_len or min(
            getattr(target.config, "max_position_embeddings", _DEFAULT_MAX_SEQ_LEN), _DEFAULT_MAX_SEQ_LEN)
        self.eos_token_ids = _eos_token_ids(target, tokenizer)
        device = target.lm_head.weight.device
        worker.use_flashinfer = worker.use_flashinfer and flashinfer_ops.worth_it(target.vocab_size)
        if worker.use_flashinfer:  # its JIT build (minutes on a fresh machine) runs beside what follows
            flashinfer_ops.start_sampling_build(device)
        metadata = SpecMetadata(self.max_batch_size, self.max_draft_len, target.vocab_size, device)
        if tree_step is not None:  # TensorRT-LLM's tree fields (max_total_draft_tokens: N, max_draft_len here)
            metadata.is_spec_dec_tree, metadata.is_spec_dec_dynamic_tree = True, tree_step.is_dynamic
        self.model = OneModel(target, worker, mode, metadata)
        self.kv_cache = self._make_kv_cache()
        worker.allocate_state(self.max_batch_size + 1, target.vocab_size, device,  # + the padding slot
                              self.max_positions_per_request)
        self.num_kv_pages = self.kv_cache.k[0].shape[0]
        if engine_config.use_fused_layers:
            target.fuse(self.max_positions_per_request)
            worker.fuse(self.max_positions_per_request)
            self.bind_kv_cache()
        use_graphs = device.type == "cuda" and not engine_config.enforce_eager
        if is_moe(target.hf):
            refuse_unsupported_moe(target.hf)
            if target.fused is None and use_graphs:
                raise ValueError("use_fused_layers=False runs the stock mixture-of-experts loop, which synchronises "
                                 "with the host in every layer: no CUDA graph can capture it; keep "
                                 "use_fused_layers=True, or set enforce_eager=True as well")
        compiles = use_graphs and compile_pays(engine_config.compile_step, target)
        self._compile_whole = compiles and self.compiles_step_whole
        if compiles and not self._compile_whole:
            target.compile()
            worker.compile()
        self.graph_runner = self.new_graph_runner() if use_graphs else None

    @property
    def target(self) -> TargetModel:
        return self.model.target

    @property
    def worker(self) -> SpecWorkerBase:
        return self.model.worker

    @property
    def spec_metadata(self) -> SpecMetadata:
        return self.model.spec_metadata

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def vocab_size(self) -> int:
        return self.model.target.vocab_size

    @property
    def compiles_step_whole(self) -> bool:
        """Whether ``compile_step`` compiles the graphed step whole (a fused target, on one GPU or tensor
        parallel) rather than the target's layers and the EAGLE-3 head's passes module by module (stock layers)."""
        return self.target.fused is not None

    def new_graph_runner(self) -> CUDAGraphRunner:
        """A graph runner without captured graphs (the compiled step's Dynamo cache is kept: it lives on the
        code)."""
        return CUDAGraphRunner(self.model, self.kv_cache, self.schedule, self.max_batch_size, self._compile_whole)

    @property
    def max_accepted_drafts(self) -> int:
        """The most drafts one step can accept: max_draft_len, or a draft tree's depth (its N drafts are what a
        step verifies, ``max_draft_len`` here)."""
        tree_step = getattr(self.worker, "tree_step", None)
        return tree_step.max_depth if tree_step is not None else self.max_draft_len

    @property
    def max_packed_columns(self) -> int:
        """Columns of the widest packed outputs a step returns (logprobs at the widest width)."""
        return packed_columns(self.max_draft_len, MAX_LOGPROBS)

    @property
    def max_positions_per_request(self) -> int:
        """Positions a request's step may touch (block-table width, RoPE tables): a step writes up to 2K - 1 past
        the committed length (target K, draft passes K - 1 more), and a step the engine runs ahead for a request
        that has just ended (``Engine._run``) starts up to K past its last committed length; block-table entries
        past a request's reserved pages point at the scratch page, so those writes land there."""
        return self.max_seq_len + 3 * self.max_draft_len + 2

    # -- the draft-length schedule and forcing (benchmark sweeps change them between runs) ----------------------

    def draft_len_for(self, batch_size: int) -> int:
        return self.schedule.draft_len_for(batch_size)

    @property
    def draft_len_schedule(self) -> dict[int, int]:
        return self.schedule.as_dict()

    def release_graphs(self) -> None:
        """Drop the captured CUDA graphs and their memory pool (the engine is stopped: a closed model); a later
        step would capture again."""
        if self.graph_runner is not None:
            torch.cuda.synchronize(self.device)
            for graph, _ in self.graph_runner.graphs.values():
                graph.reset()  # now, whoever still holds the graph runner: NCCL waits for graphs that use it
            self.graph_runner = self.new_graph_runner()
            torch.cuda.empty_cache()

    def set_draft_len_schedule(self, schedule: Mapping[int, int] | None) -> None:
        """Replace the draft-length schedule. Captured graphs are kept: they are keyed by their draft lengths."""
        self.schedule.set(schedule)

    def refresh_forced_acceptance(self) -> None:
        """Re-read TLLM_SPEC_DECODE_FORCE_NUM_ACCEPTED_TOKENS. The steps read the forced count from a device
        tensor, so captured graphs stay valid for a new count; they are dropped only when forcing turns on or
        off, which changes the step's code."""
        was_forcing = self.worker.forcing
        self.worker.forced_num_accepted = read_forced_num_accepted()
        if self.graph_runner is not None and self.worker.forcing != was_forcing:
            self.graph_runner = self.new_graph_runner()

    # -- guided decoding --------------------------------------------------------------------------------------

    @property
    def guided_decoder(self) -> GuidedDecoder | None:
        return self.worker.guided_decoder

    def dynamic_tree_parents(self, slots: list[int], draft_len: int) -> list[list[int]] | None:
        """The dynamic trees the requests in ``slots`` verify next (their parents, read from the device between
        steps, for the grammar masks), or None: no dynamic tree, or a step that verifies a chain."""
        tree_step = getattr(self.worker, "tree_step", None)
        if tree_step is None or not tree_step.is_dynamic or not self.worker.is_tree(draft_len) or not slots:
            return None
        return tree_step.parents[torch.tensor(slots, device=self.device)].tolist()

    def grammar_compiler(self) -> GrammarCompiler:
        """A grammar compiler for this target's tokenizer and vocabulary (ImportError without llguidance,
        ValueError without a tokenizer or an EOS id); any thread."""
        eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        return GrammarCompiler(self.tokenizer, self.vocab_size,
                               eos if eos is not None else next(iter(self.eos_token_ids), None))

    def enable_guided_decoding(self) -> str | None:
        """Give the worker a guided decoder (once; captured graphs are dropped so that they mask the logits).
        Returns why guided decoding is unavailable (no tokenizer, no llguidance), or None."""
        if self.worker.guided_decoder is not None:
            return None
        tree_step = getattr(self.worker, "tree_step", None)
        try:
            compiler = self.grammar_compiler()
        except (ImportError, ValueError) as err:
            return str(err)
        static = tree_step if tree_step is not None and not tree_step.is_dynamic else None
        self.worker.set_guided_decoder(GuidedDecoder(compiler, self.max_batch_size, self.max_draft_len, self.device,
                                                     static.tree if static is not None else None,
                                                     draft_passes=self.max_accepted_drafts))
        if self.graph_runner is not None:
            self.graph_runner = self.new_graph_runner()
        return None

    # -- steps ------------------------------------------------------------------------------------------------

    def reseed(self, seed: int) -> None:
        """Restart the batch random stream (rows of requests without their own seed)."""
        self.spec_metadata.reseed(seed)

    def bind_kv_cache(self) -> None:
        """Point the fused target's attention at this runner's KV cache (another engine over the same target may
        have pointed it at its own); before every step, and by the graph runner before every capture (a replayed
        graph keeps its capture's)."""
        self.model.bind_kv_cache(self.kv_cache)

    def request_finished(self, token_ids: list[int]) -> None:
        """A request ended with these tokens (prompt and output): the worker may keep them (suffix drafting's global
        pool)."""
        self.worker.request_finished(token_ids)

    def prepare_graphs(self, params: Sequence[SamplingParams]) -> None:
        """Capture every bucket's graph for the sampling variants of ``params`` before the first timed step."""
        self.bind_kv_cache()
        self.kv_cache.flush()  # a capture must not record the block table's pending rows
        if self.graph_runner is not None:
            self.graph_runner.capture_all(params)

    def needs_capture(self, params: SamplingParams) -> bool:
        """Whether a request with ``params`` makes :meth:`prepare_graphs` capture graphs (a sampling variant seen
        for the first time)."""
        return self.graph_runner is not None and bool(self.graph_runner.missing([params]))

    @property
    def context_lookahead(self) -> int:
        """Prompt tokens after a partial prompt chunk that the draft reads (SpecWorkerBase.context_lookahead)."""
        return self.worker.context_lookahead

    def step(self, ids: list[int], positions: list[int], slots: list[int], drafts: list[int],
             params: list[SamplingParams], context_lens: tuple[int, ...], draft_len: int | None = None,
             next_draft_len: int | None = None, context_starts: tuple[int, ...] = (),
             context_next_tokens: tuple[tuple[int, ...], ...] = ()) -> torch.Tensor:
        """Run one step from host-side inputs (flat layout, context requests first); returns the packed
        outputs [B, 2K+3 (+ logprob columns)] on the device. ``draft_len``: drafts each generation request verifies,
        ``next_draft_len``: drafts to propose (both default max_draft_len). Chunked prefill: ``context_lens`` are
        the prompt tokens of each context request in this step, from position ``context_starts`` (empty: 0), and
        ``context_next_tokens`` the prompt tokens after a chunk that does not end its prompt (at least
        :attr:`context_lookahead` of them; () for a chunk that does; empty: none). Generation requests replay a
        CUDA graph when one is enabled (:meth:`_graphs_generation`)."""
        self.bind_kv_cache()
        self.kv_cache.flush()  # block-table rows of the requests admitted and freed since the last step
        k = self.max_draft_len if draft_len is None else draft_len
        next_k = self.max_draft_len if next_draft_len is None else next_draft_len
        num_ctx = len(context_lens)
        if self._graphs_generation(params, num_ctx):
            tokens = sum(context_lens)
            gen = self.graph_runner.run(ids[tokens:], positions[tokens:], slots[tokens:], drafts, params[num_ctx:],
                                        k, next_k)
            if not num_ctx:
                return gen
            ctx = self._eager_step(ids[:tokens], positions[:tokens], slots[:tokens], [], params[:num_ctx],
                                   context_lens, k, next_k, context_starts, context_next_tokens)
            return torch.cat([ctx, gen])  # copied before any later replay overwrites the graph's output
        return self._eager_step(ids, positions, slots, drafts, params, context_lens, k, next_k, context_starts,
                                context_next_tokens)

    def _graphs_generation(self, params: list[SamplingParams], num_ctx: int) -> bool:
        """Whether the step's generation requests replay a CUDA graph: always when there is no prompt chunk, and
        beside one too (the prompt chunks then run as an eager step of their own, launched after the graph: an
        eager step over the whole batch would cost every running stream several graphed steps' time), unless
        guided decoding needs the batch's rows together, or the two parts' packed outputs differ in width
        (logprobs asked on one side only)."""
        gen = params[num_ctx:]
        if self.graph_runner is None or not gen or not self.graph_runner.bucket(len(gen)):
            return False
        if not num_ctx:
            return True
        return (self.worker.guided_decoder is None
                and sampling_variant(params[:num_ctx])[2] == sampling_variant(gen)[2])

    def _eager_step(self, ids: list[int], positions: list[int], slots: list[int], drafts: list[int],
                    params: list[SamplingParams], context_lens: tuple[int, ...], k: int, next_k: int,
                    context_starts: tuple[int, ...], context_next_tokens: tuple[tuple[int, ...], ...]
                    ) -> torch.Tensor:
        """:meth:`step` without a CUDA graph, on the fully resolved draft lengths."""
        num_gen = len(params) - len(context_lens)
        self.spec_metadata.prepare(params, context_lens, k, next_k)
        self.spec_metadata.prepare_chunks(context_starts, context_next_tokens)
        device = self.device
        attn = AttentionMetadata.build(self.kv_cache, to_device(slots, device), to_device(positions, device),
                                       max(positions) + 2 * self.max_draft_len + 2, context_lens,
                                       tokens_per_request=k + 1, context_starts=context_starts)
        attn = self.worker.verify_metadata(attn, sum(context_lens), num_gen, k)
        draft_tokens = to_device(drafts, device).view(num_gen, k)
        return self.model.packed_forward(to_device(ids, device), attn, draft_tokens)

    def can_run_next(self) -> bool:
        """Whether the last step may be followed by :meth:`run_next`: a graphed step that keeps its draft length,
        with no grammar (grammar masks are built on the host from the last step's tokens)."""
        return (self.graph_runner is not None and self.graph_runner.can_run_next()
                and self.worker.guided_decoder is None)

    def run_next(self) -> torch.Tensor:
        """Replay the last graphed step on inputs it advanced itself (CUDAGraphRunner.run_next)."""
        self.kv_cache.flush()
        return self.graph_runner.run_next()

    def _make_kv_cache(self) -> KVCache:
        shapes = self.target.kv_layer_shapes() + self.worker.kv_layer_shapes()
        per_request = self.max_positions_per_request
        page, dtype = self.engine_config.page_size, self.target.lm_head.weight.dtype
        fp8 = self.engine_config.kv_cache_dtype == "fp8"
        dtype = torch.float8_e4m3fn if fp8 else dtype
        num_pages = self.engine_config.num_pages or _auto_num_pages(
            shapes, page, self.max_batch_size * math.ceil(per_request / page) + 1, self.engine_config.kv_cache_fraction,
            self.device, dtype)
        if self.target.parallel is not None:  # ranks with different free memory still admit alike (lockstep)
            num_pages = min_over_ranks(num_pages, self.target.parallel, self.device)
        return KVCache(shapes, num_pages, page, self.max_batch_size, per_request, dtype, self.device,
                       self.target.kv_scales if fp8 else None)


def to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """A host list as an int64 tensor on ``device``, without waiting for the device: torch.tensor(...,
    device=...) synchronises the stream, so a prompt step launched behind a decoders' graph would wait for the
    graph before launching anything (a copy from pageable memory is staged before the call returns)."""
    return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)


def _auto_num_pages(shapes: list[tuple[int, int]], page_size: int, wanted: int, kv_cache_fraction: float,
                    device: torch.device, dtype: torch.dtype) -> int:
    """Pages for ``wanted`` on CPU; on GPU at most ``kv_cache_fraction`` of the free memory."""
    if device.type != "cuda":
        return wanted
    bytes_per_page = 2 * page_size * sum(h * d for h, d in shapes) * torch.finfo(dtype).bits // 8
    free, _ = torch.cuda.mem_get_info(device)
    return max(2, min(wanted, int(free * kv_cache_fraction) // bytes_per_page))


def _eos_token_ids(target: TargetModel, tokenizer) -> tuple[int, ...]:
    ids: set[int] = set()
    for source in (getattr(target.hf, "generation_config", None), target.config):
        eos = getattr(source, "eos_token_id", None)
        ids |= set(eos) if isinstance(eos, (list, tuple)) else ({eos} if eos is not None else set())
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))
