"""The embedded rollout engine: continuous batching over a per-slot KV cache, with RL controls.

    engine = Engine(model, EngineConfig(max_slots=64, max_len=1024))
    rid = engine.add_request(prompt_ids, SamplingParams(n=8, max_new_tokens=512))
    while engine.has_unfinished():
        for out in engine.step():          # GenerationOutput of every request that finished this step
            ...

Each `step()` admits waiting requests while slots and the prefill budget allow (a prompt is prefilled
once and its K/V copied to its n sample slots; with `kv_layout="shared-prompt"` stored once, in a prompt slot its
samples read: `asyncrl.policies.shared_prompt_cache`), then runs one decode step for every running sequence.
Requests join and leave between steps (continuous batching). Every token comes with its behaviour
log-prob and the weight version that produced it. With `decode_ahead` (the default) a step launches the next
decode before reading the tokens of the one before (`asyncrl.policies.decode_steps`), so the host's per-token
work overlaps the GPU's; a step's tokens then appear one `step()` later, and a control (pause, abort, update,
sleep) drops the step in flight, whose rows simply decode the same token again. With `EngineConfig.speculation` a
step of few rows checks model-free drafts instead, losslessly (`asyncrl.policies.speculation`).

Sessions (multi-turn episodes): `add_request(..., sessions=[name per sample])` keeps each finished sample's
K/V under its name, in a slot at the top of the cache that no running sequence uses. A later request with
`sessions=[name]` whose prompt starts with that sample's whole sequence (prompt + response, then the
environment's tokens) takes the slot back and prefills only the new tokens: a turn costs its new tokens, not
the conversation. Held slots are a cache, not a reservation: the least recently used one is dropped when
waiting requests need its slot (that turn is then prefilled whole), and all are dropped on sleep and on a
weight update with kv="recompute". `end_sessions(names)` frees them.

RL controls (named after vLLM's; their states and the request table are `asyncrl.policies.engine_control`,
shared with the vLLM engine) act at a step boundary — they take the same lock as `step()`, so they are safe to
call from another thread (an RPC handler) while a driver loop calls `step()`:
  pause(mode)   "keep": freeze running requests; "abort": end them and return the partial outputs;
                "wait": stop admitting and pause once the running ones finish (keep calling step()).
  resume()      continue.
  abort(ids)    end requests now, returning what they generated so far.
  update_weights(named_tensors, version, kv="keep"|"recompute")
                copy weights in place (CUDA graphs stay valid); tokens sampled afterwards carry
                `version`. kv="recompute" re-prefills running sequences under the new weights.
  sleep() / wake_up()  free / re-allocate the KV cache (colocated training); running sequences keep
                their tokens and get their K/V recomputed on wake-up.

On CUDA the decode step (model, logits, sampler) is captured in CUDA graphs, one per (batch bucket, attention
length bucket); on CPU it runs eagerly.
"""

from __future__ import annotations

import collections
import functools
from typing import Iterable, Sequence

import torch
from torch import Tensor

from asyncrl.policies.decode_attention import decode_attention, sdpa_decode
from asyncrl.policies.decode_steps import DecodeSteps, Launched, attend_length
from asyncrl.policies.drafts import DraftIndex, Drafter
from asyncrl.policies.engine_adapters import EngineAdapters
from asyncrl.policies.engine_config import EngineConfig
from asyncrl.policies.engine_control import EngineControl, KVMode
from asyncrl.policies.engine_requests import EngineRequest, EngineSample
from asyncrl.policies.fused_projections import fuse_projections
from asyncrl.policies.held_sessions import Held, HeldSessions
from asyncrl.policies.shared_prompt_cache import SharedPromptKVCache, build_kv_cache
from asyncrl.policies.shared_prompt_forwards import SharedPromptForwards, budgeted
from asyncrl.policies.attention_layouts import CacheExtension
from asyncrl.policies.model import CausalLM, use_fused_kernels
from asyncrl.policies.sampling import SamplingParams, plain_sampler, sample_plain, sample_tokens
from asyncrl.policies.speculation import draft_room, verify_samples
from asyncrl.policies.verify_steps import VerifySteps
from asyncrl.tools.seeding import derive_seed

__all__ = ["EngineConfig", "Engine"]


class Engine(EngineControl[EngineRequest]):
    """Continuous-batching generation with behaviour log-probs, versions and pause / update / resume (the
    controls and the request table: `EngineControl`)."""

    backend = "asyncrl"

    def __init__(self, model: CausalLM, config: EngineConfig = EngineConfig(), *, version: int = 0,
                 eos_token_ids: Iterable[int] | None = None, drafter: Drafter | None = None):
        """drafter: where speculative steps get drafts (default, with `config.speculation.tokens` > 0: a
        `DraftIndex` over each prompt's samples)."""
        config.validate()
        window = model.config.sliding_window
        if window is not None and config.max_len > window:
            raise ValueError(f"EngineConfig.max_len={config.max_len} exceeds the model's sliding_window={window}; "
                             "sliding-window attention is not implemented, so keep max_len <= sliding_window")
        self.model = model.eval().requires_grad_(False)
        fuse_projections(model)  # generation's q/k/v and gate/up products, one GEMM each
        self.config = config
        cfg = model.config
        attention = decode_attention(config.decode_attention, model.device, model.dtype, cfg.head_dim)
        self.decode_kernel = "triton" if attention is not sdpa_decode else "sdpa"
        self.cache = build_kv_cache(model, config, attention)
        self._shared = isinstance(self.cache, SharedPromptKVCache)  # a prompt's K/V once for its samples
        self._waiting: collections.deque[EngineRequest] = collections.deque()
        self._running: list[EngineSample] = []  # index = KV slot
        self._rng = torch.Generator().manual_seed(config.seed)
        on_cuda = model.device.type == "cuda"
        self.fused: dict[str, bool] = {}
        if on_cuda and config.fused_kernels:
            self.fused = use_fused_kernels(True, model.device, model.dtype, model=model)
        # torch.compile'd, the sampler measured slower on an H100 than eager; the Triton kernels read the logits twice
        self._sample_plain = plain_sampler(config.fused_kernels, model.device)
        self.sampler = "torch" if self._sample_plain is sample_plain else "triton"
        self._steps = DecodeSteps(model, self.cache, config.max_slots, self._sample_plain,
                                  graphs=on_cuda and config.cuda_graphs)
        self._inflight: Launched | None = None  # a decode step launched, its tokens not yet read
        self._attend = functools.partial(attend_length, bucket=config.attend_bucket, max_len=config.max_len)
        self._params = dict(model.named_parameters(remove_duplicate=False))  # tied lm_head included
        super().__init__(version=version, vocab_size=cfg.vocab_size, max_len=config.max_len,
                         max_slots=config.max_slots,
                         eos_token_ids=cfg.eos_token_ids if eos_token_ids is None else eos_token_ids,
                         weight_shapes={n: p.shape for n, p in self._params.items()}, lora_rank=config.lora_rank)
        self._adapters = None if config.lora_rank == 0 else EngineAdapters(
            rank=config.lora_rank, alpha=config.lora_alpha, take_base=self._params.__getitem__)
        self.stats = collections.Counter()
        self._shared_forwards = None if not self._shared else SharedPromptForwards(
            self.cache, self._forward_prefill, self._forward_extend, self.stats, config.max_prefill_tokens)
        self._held = HeldSessions(self.cache, config.max_slots, self.stats)
        spec = config.speculation
        self._drafter = None if not spec.enabled else drafter or DraftIndex(min_match=spec.min_match,
                                                                              max_match=spec.max_match)
        self._verify = None if not spec.enabled else VerifySteps(model, self.cache, config.max_slots, spec.tokens + 1,
                                                                 self._sample_plain, buckets=self._steps.buckets)

    # ---------------------------------------------------------------- requests
    def _new_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams, max_new: int,
                     stop_ids: frozenset[int], sessions: Sequence[str] | None) -> EngineRequest:
        """sessions: one name per sample: keep each sample's K/V when it finishes, and continue a held one whose
        sequence this prompt extends (see the module docstring)."""
        if self._shared:  # the prompt's first max_prompt_len tokens in a prompt slot, the rest in each sample's slot
            max_new = min(max_new, self.config.max_len - max(len(prompt_ids), self.cache.max_prompt_len))
        request = EngineRequest(request_id, prompt_ids, params, max_new, stop_ids,
                           sessions=None if sessions is None else tuple(sessions),
                           draft_key=hash(tuple(prompt_ids)) if self._drafter is not None else 0)
        request.samples = [EngineSample(i, request=request, uniforms=self._uniforms(params, i, max_new))
                           for i in range(params.n)]
        return request

    def _enqueue(self, request: EngineRequest) -> None:
        self._waiting.append(request)

    def _uniforms(self, params: SamplingParams, index: int, count: int) -> list[float]:
        gen = self._rng if params.seed is None else torch.Generator().manual_seed(derive_seed(params.seed, index))
        return torch.rand(count, generator=gen).tolist()

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    # ---------------------------------------------------------------- the step
    @torch.inference_mode()
    def _advance(self) -> list[EngineRequest]:
        """Admit and prefill waiting requests (none while draining), decode one token for every running
        sequence; return the requests that finished. On a GPU the step runs with the engine's GPU current, whichever
        thread calls it: Triton kernels launch on the current device, so an engine on cuda:2 stepped from a thread
        whose current device is cuda:0 (an evaluation in the launching process) would hand them foreign pointers."""
        if self.model.device.type != "cuda":
            return self._step_rows()
        with torch.cuda.device(self.model.device):
            return self._step_rows()

    def _step_rows(self) -> list[EngineRequest]:
        finished: list[EngineRequest] = []
        if not self._draining:
            admitted = self._admit()
            if admitted:
                self._prefill(admitted, finished)
        if self._running:
            self._decode(finished)
        if not self._running:
            self._drop_inflight()  # only rows that finished were in it
        self.stats["steps"] += 1
        return finished

    def _admit(self) -> list[EngineRequest]:
        admitted, longest = [], 0
        while self._waiting:
            request = self._waiting[0]
            held = self._continued(request)
            prefill = len(request.prompt_ids) - (len(held.tokens) - 1 if held is not None else 0)
            longest_next = max(longest, prefill)
            if admitted and longest_next * (len(admitted) + 1) > self.config.max_prefill_tokens:
                break
            if held is not None:
                self._held.to_bottom(held, len(self._running))
            while self._shared and held is None and not self.cache.free_prompts and self._held.evict(held):
                pass  # a held session's prompt slot goes to a running prompt
            if not self._held.make_room(request.params.n, len(self._running), keep=held) or (
                    self._shared and held is None and not self.cache.free_prompts):
                break
            self._waiting.popleft()
            if self._shared and held is None:  # its own prompt slot, after another's share where one begins the same
                share = self.cache.match(request.prompt_ids, self.version)
                request.prompt_slot = self.cache.open(request.prompt_ids[share[1] if share else 0:], parent=share,
                                                      version=self.version)
            if held is not None:
                request.cached = self._held.take(request.sessions[0], len(self._running))
            for sample in request.samples:
                sample.slot = len(self._running)
                self._running.append(sample)
            admitted.append(request)
            longest = longest_next
        return admitted

    def _prefill(self, requests: list[EngineRequest], finished: list[EngineRequest]) -> None:
        """One forward over the padded prompts; sample each request's n first tokens; fan out the K/V. A
        continued session prefills only its new tokens, in a forward of its own over its slot."""
        whole = [r for r in requests if not r.cached]
        rows: list[Tensor] = []
        if whole and self._shared:
            rows.append(self._shared_forwards.prefill(whole))
        elif whole:
            prompts = [r.prompt_ids for r in whole]
            hidden = self._forward_prefill(prompts, [r.samples[0].slot for r in whole])
            last = torch.tensor([len(p) - 1 for p in prompts], device=hidden.device)
            rows.append(hidden[torch.arange(len(prompts), device=hidden.device), last])
            self.stats["prefill_tokens"] += sum(len(p) for p in prompts)
            for request in whole:
                if request.params.n > 1:
                    self.cache.copy_slot(request.samples[0].slot, [s.slot for s in request.samples[1:]],
                                         len(request.prompt_ids))
        continued = [r for r in requests if r.cached]
        if continued:  # one forward for every continued session: its new tokens over its slot's cached ones
            rows.append(self._forward_extend([r.prompt_ids[r.cached:] for r in continued],
                                             [r.samples[0].slot for r in continued], [r.cached for r in continued]))
            self.stats["session_reused_tokens"] += sum(r.cached for r in continued)
        order = whole + continued
        logits = self.model.logits(torch.cat(rows))
        index = torch.tensor([i for i, r in enumerate(order) for _ in r.samples], device=logits.device)
        new = [s for r in order for s in r.samples]
        self._sample_and_append(logits[index], new, finished)
        live = [s for s in new if s.slot >= 0]
        if live and self._inflight is not None:  # the next step is launched from the device: give it these rows
            self._steps.set_rows([s.slot for s in live], [s.completion.token_ids[-1] for s in live],
                                 [s.cached_len for s in live])

    def _forward_extend(self, new: list[list[int]], slots: list[int], starts: list[int]) -> Tensor:
        """Row i's tokens new[i] continue the sequence cached in slot slots[i] from position starts[i] (a held
        session's new turn, a row's responses over its shared prompt): their forward, each row's last hidden state."""
        device = self.model.device
        width = max(map(len, new))
        ids = torch.tensor([n + [0] * (width - len(n)) for n in new], dtype=torch.long, device=device)
        span = max(s + len(n) for s, n in zip(starts, new))
        hidden = self.model(ids, cache=self.cache, cache_slots=torch.tensor(slots, device=device),
                            extension=CacheExtension(torch.tensor(starts, device=device), span))
        last = torch.tensor([len(n) - 1 for n in new], device=device)
        self.stats["prefill_tokens"] += sum(map(len, new))
        return hidden[torch.arange(len(new), device=device), last]

    # ---------------------------------------------------------------- held sessions
    def _continued(self, request: EngineRequest) -> Held | None:
        """The held session this request continues: one sample, and its prompt extends the held sequence."""
        if request.sessions is None or request.params.n != 1 or not self.cache.allocated:
            return None
        return self._held.continued(request.sessions[0], request.prompt_ids)

    def _hold(self, sample: EngineSample, kv: tuple[Tensor, Tensor] | None = None) -> bool:
        """Keep a finished session sample's K/V (see `HeldSessions.hold`)."""
        return self._held.hold(sample.request.sessions[sample.index],
                               sample.request.prompt_ids + sample.completion.token_ids, len(self._running),
                               slot=sample.slot, kv=kv)

    def end_sessions(self, names: Iterable[str]) -> None:
        """Free the K/V held for these sessions (unknown names are ignored)."""
        with self._lock:
            self._held.end(names)

    @property
    def num_held(self) -> int:
        return len(self._held)

    def _forward_prefill(self, prompts: list[list[int]], slots: list[int]) -> Tensor:
        device = self.model.device
        width = max(len(p) for p in prompts)
        ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts], dtype=torch.long)
        slot_t = torch.tensor(slots, device=device)
        return self.model(ids.to(device), cache=self.cache, cache_slots=slot_t)

    def _decode(self, finished: list[EngineRequest]) -> None:
        """A decode step of every running row. Ahead (`decode_ahead`): launch it from the device-resident inputs
        before reading the step in flight, then read that one while this one runs. Otherwise (nothing in flight,
        or rows that filter and are sampled again on the host) upload every row's newest token and run it."""
        if (self._drafter is not None and len(self._running) <= self.config.speculation.max_rows
                and self._speculate(finished)):
            return
        inflight, self._inflight = self._inflight, None
        filtered = any(s.request.params.filtered for s in self._running)
        if inflight is not None and not filtered:
            if not all(id(s) in inflight.pending and len(s.completion.token_ids) + 1 >= s.request.max_new
                       for s in self._running):  # else every row ends with the step in flight: none to launch
                self._inflight = self._launch(inflight.pending)
            self._consume(inflight, finished)
            return
        if inflight is not None:
            self._consume(inflight, finished)
            if not self._running:
                return
        samples = self._running
        self._steps.set_rows(None, [s.completion.token_ids[-1] for s in samples], [s.cached_len for s in samples])
        launched = self._launch(frozenset())
        if filtered:  # the step sampled without top-k/top-p; sample again from its logits
            self._sample_and_append(launched.logits, samples, finished)
        elif self.config.decode_ahead:
            self._inflight = launched
        else:
            self._consume(launched, finished)

    def _speculate(self, finished: list[EngineRequest]) -> bool:
        """A speculative step (`asyncrl.policies.speculation`) of every running row: read the step in flight, draft,
        verify, append each row's kept tokens. False: no row has a draft (a plain decode step follows)."""
        if self._inflight is not None:
            inflight, self._inflight = self._inflight, None
            self._consume(inflight, finished)
        samples, room = list(self._running), self.config.speculation.tokens
        drafts = [self._drafter.propose(s.request.draft_key, s.request.prompt_ids,
                                        [x.completion.token_ids for x in s.request.samples], s.index,
                                        draft_room(s.cached_len, len(s.completion.token_ids), s.request.max_new,
                                                   self.config.max_len, room)) for s in samples]
        if not any(drafts):
            return not samples
        width = self._verify.width  # rows near their slot's end (the fixed width past it) or filtering: eagerly
        if any(s.request.params.filtered or s.cached_len + width > self.config.max_len for s in samples):
            verified = verify_samples(self.model, self.cache, samples, drafts, plain=self._sample_plain)
        else:  # fixed shapes: a captured graph on CUDA (`asyncrl.policies.verify_steps`)
            span = self._attend(max(s.cached_len for s in samples) + width)
            verified = self._verify.verify(samples, drafts, span, held_from=self._held.bottom)
        self.stats.update(spec_steps=1, spec_rows=len(samples), spec_drafted_tokens=sum(map(len, drafts)),
                          spec_accepted_tokens=sum(k - 1 for k in verified.kept))
        runs = verified.runs([s.request.stop_ids for s in samples])
        for s, (tokens, logprobs) in zip(samples, runs):  # all but the last kept token: none stops or ends the budget
            s.completion.token_ids.extend(tokens[:-1])
            s.completion.logprobs.extend(logprobs[:-1])
            s.completion.versions.extend([self.version] * (len(tokens) - 1))
            self.stats["generated_tokens"] += len(tokens) - 1
        self._append(samples, [t[-1] for t, _ in runs], [lp[-1] for _, lp in runs], finished)
        return True

    def _launch(self, pending: frozenset[int]) -> Launched:
        """Start a step of every running row; `pending`: ids of samples whose previous step is still in flight
        (this one decodes the token after it: the next uniform number, one position further)."""
        samples = list(self._running)
        ahead = [id(s) in pending for s in samples]
        temperature = torch.tensor([s.request.params.temperature for s in samples], dtype=torch.float32)
        # a row finishing in the step in flight decodes one token more, discarded: clamp its uniform's index
        uniforms = torch.tensor([s.uniforms[min(len(s.completion.token_ids) + a, len(s.uniforms) - 1)]
                                 for s, a in zip(samples, ahead)], dtype=torch.float32)
        attend = self._attend(max(s.cached_len + a for s, a in zip(samples, ahead)) + 1)
        self.stats["decode_steps"] += 1
        # a graph's padding rows must not write into held sessions' slots: run those batches eagerly
        graph = self._steps.buckets is not None and self._steps.bucket(len(samples)) <= self._held.bottom
        return self._steps.launch(samples, temperature, uniforms, attend, graph=graph)

    def _consume(self, launched: Launched, finished: list[EngineRequest]) -> None:
        """Append a launched step's tokens to its rows' samples (rows that finished meanwhile are skipped)."""
        tokens, logprobs = launched.results()
        rows = [i for i, s in enumerate(launched.samples) if not s.completion.finished]
        self._append([launched.samples[i] for i in rows], [tokens[i] for i in rows], [logprobs[i] for i in rows],
                     finished)

    def _drop_inflight(self) -> None:
        """Forget the step in flight (before the rows or the weights change outside a step): its tokens are
        never appended, so each of its rows decodes the same token again, from the host's inputs."""
        self._inflight = None

    def _sample_and_append(self, logits: Tensor, samples: list[EngineSample], finished: list[EngineRequest]) -> None:
        """Sample row i of `logits` for samples[i] (top-k / top-p included) and append it."""
        device = logits.device
        params = [s.request.params for s in samples]
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32).to(device)
        uniforms = torch.tensor([s.uniforms[len(s.completion.token_ids)] for s in samples], dtype=torch.float32)
        top_k = top_p = None
        if any(p.filtered for p in params):
            top_k = torch.tensor([p.top_k for p in params]).to(device)
            top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32).to(device)
        tokens, logprobs = sample_tokens(logits, temperature, uniforms.to(device), top_k=top_k, top_p=top_p,
                                         plain=self._sample_plain)
        self._append(samples, tokens.tolist(), logprobs.tolist(), finished)

    def _append(self, samples: list[EngineSample], tokens: list[int], logprobs: list[float],
                finished: list[EngineRequest]) -> None:
        """Give each sample its token; finish, hold and release the samples that stop or reach their length."""
        done: list[EngineSample] = []
        version = self.version
        for sample, token, logprob in zip(samples, tokens, logprobs):  # per token: kept lean
            c, request = sample.completion, sample.request
            c.token_ids.append(token)
            c.logprobs.append(logprob)
            c.versions.append(version)
            if token in request.stop_ids:
                c.finish_reason = "stop"
                done.append(sample)
            elif len(c.token_ids) >= request.max_new:
                c.finish_reason = "length"
                done.append(sample)
        self.stats["generated_tokens"] += len(samples)
        # a finished session's K/V goes to a free slot at the top; with none free (a full engine, where every
        # sample finishes at once) it waits in a copy until the finished samples' own slots are released
        waiting = [(s, self.cache.read_slot(s.slot, s.cached_len)) for s in done
                   if s.request.sessions is not None and not self._hold(s)]
        self._release(done)
        for sample, kv in waiting:
            self._hold(sample, kv)
        finished.extend({s.request.request_id: s.request for s in done
                         if all(x.completion.finished for x in s.request.samples)}.values())

    def _release(self, samples: list[EngineSample]) -> None:
        """Free the slots of finished samples, moving the last running sequence into each hole."""
        freed = sorted((s.slot for s in samples if s.slot >= 0), reverse=True)
        for slot in freed:
            self.cache.release_row(slot)
        for slot in freed:
            last = self._running.pop()
            if last.slot != slot:
                # a step in flight writes the K/V of the newest token too: move that position with the others
                written = last.cached_len + (self._inflight is not None and id(last) in self._inflight.pending)
                self.cache.move_row(last.slot, slot, written)
                self._steps.move_row(last.slot, slot)
                last.slot = slot
                self._running[slot] = last
        for s in samples:
            s.slot = -1

    # ---------------------------------------------------------------- RL controls
    def _withdraw(self, request: EngineRequest) -> None:
        """Drop it from the queue, or free the slots of its unfinished samples."""
        self._drop_inflight()
        if request in self._waiting:
            self._waiting.remove(request)
        self._release([s for s in request.samples if not s.completion.finished and s.slot >= 0])

    @torch.inference_mode()
    def _load_weights(self, items: list[tuple[str, Tensor]], version: int | None, kv: KVMode) -> None:
        """Copy each bucket in place as it comes. kv="recompute" re-prefills running sequences under the new
        weights; "keep" reuses their K/V (computed with older weights, as PipelineRL and vLLM's keep mode do).
        With lora_rank > 0: W_base + s·B·A copied into the same parameters (`asyncrl.policies.engine_adapters`)."""
        self._drop_inflight()  # it ran on the weights being replaced
        for name, tensor in (items if self._adapters is None else self._adapters.resolve(items, version)):
            self._params[name].copy_(tensor)
        if version is not None:
            self.version = version
        if kv == "recompute":
            self._held.clear()  # held sessions are recomputed by their next turn's prefill
            if self._running and self.cache.allocated:
                self._recompute_kv()

    def _recompute_kv(self) -> None:
        """Re-prefill prompt + generated tokens (all but the newest) of every running sequence (shared prompts: each
        prompt slot once, then each row's own part: `SharedPromptForwards.recompute`)."""
        if self._shared_forwards is not None:
            self._shared_forwards.recompute(self._running)
            self.cache.stamp(self.version)
        else:
            for batch in budgeted(self._running, lambda s: s.cached_len, self.config.max_prefill_tokens):
                self._forward_prefill([s.request.prompt_ids + s.completion.token_ids[:-1] for s in batch],
                                      [s.slot for s in batch])
        self.stats["recomputed_tokens"] += sum(s.cached_len for s in self._running)

    def _free_memory(self) -> None:
        """Free the KV cache (and captured graphs). Running sequences keep their tokens."""
        self._drop_inflight()
        self._held.clear()
        self.cache.free()
        self._steps.clear()
        if self._verify is not None:
            self._verify.clear()
        if self.model.device.type == "cuda":
            torch.cuda.empty_cache()

    @torch.inference_mode()
    def _restore_memory(self) -> None:
        """Re-allocate the KV cache and recompute the K/V of running sequences."""
        self.cache.allocate()
        if self._running:
            self._recompute_kv()
