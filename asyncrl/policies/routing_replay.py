"""Routing replay for mixture-of-experts models read through `transformers`: record which experts each router picked
for each token, and make the routers pick those experts again in a later forward (and in its recompute under
gradient checkpointing) while their weights still get gradients.

    replay = RoutingReplay(model)                     # finds the routers, hooks each once
    with replay.recording() as recorded:
        model(tokens)
    routes = recorded.routes()                        # [tokens, routers, top_k] int64, in the order tokens ran
    with replay.replaying(routes) as replayed:
        model(tokens).logits.sum().backward()         # the recorded experts; the routers' weights get gradients
    replayed.disagreement()                           # share of token-router pairs whose own top-k differed

A `transformers` (5.x) router is a module whose forward maps hidden states [N, H] to (logits [N, E], weights [N, k],
indices [N, k]); the experts then mix the k chosen experts' outputs with the weights. Replaying keeps the logits
(computed from the router's weights, so gradients reach them), replaces the indices with the recorded ones, and
recomputes the weights of those experts by the router's own rule:

    softmax          softmax(logits) gathered at the indices (Qwen3-MoE, Qwen2-MoE, OLMoE without renormalising)
    softmax_renorm   the same, divided by their sum (Mixtral; Qwen3-MoE with norm_topk_prob)
    topk_softmax     softmax over the logits gathered at the indices (gpt-oss; equal in value to softmax_renorm)
    sigmoid          sigmoid(logits) gathered, × routed_scaling_factor (DeepSeek-V3, GLM-4.5 without renormalising)
    sigmoid_renorm   the same, divided by their sum (+1e-20) first (DeepSeek-V3 with norm_topk_prob)

Which rule a router follows is not read from its class: a probe runs each router on random hidden states and keeps
the first rule that reproduces the router's own weights from its own logits and indices (`router_rule`). A router
no rule reproduces is refused, naming it. The selection (top-k, grouped top-k, a score-correction bias) does not
matter to the replay: only how the chosen experts are weighted does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from typing import Callable, Iterator

import torch
from torch import Tensor, nn

__all__ = ["RULES", "RoutingReplay", "Recorded", "Replayed", "find_routers", "router_layers", "router_rule",
           "route_disagreement"]


def _softmax(router: nn.Module, logits: Tensor, indices: Tensor) -> Tensor:
    return torch.softmax(logits.float(), dim=-1).gather(-1, indices)


def _softmax_renorm(router: nn.Module, logits: Tensor, indices: Tensor) -> Tensor:
    weights = _softmax(router, logits, indices)
    return weights / weights.sum(dim=-1, keepdim=True)


def _topk_softmax(router: nn.Module, logits: Tensor, indices: Tensor) -> Tensor:
    return torch.softmax(logits.gather(-1, indices), dim=-1)


def _sigmoid(router: nn.Module, logits: Tensor, indices: Tensor, *, renorm: bool = False) -> Tensor:
    weights = logits.sigmoid().gather(-1, indices)
    if renorm:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * getattr(router, "routed_scaling_factor", 1.0)


def _sigmoid_renorm(router: nn.Module, logits: Tensor, indices: Tensor) -> Tensor:
    return _sigmoid(router, logits, indices, renorm=True)


Rule = Callable[[nn.Module, Tensor, Tensor], Tensor]
RULES: dict[str, Rule] = {"softmax": _softmax, "softmax_renorm": _softmax_renorm, "topk_softmax": _topk_softmax,
                          "sigmoid": _sigmoid, "sigmoid_renorm": _sigmoid_renorm}
"""How a router weights the experts it chose: (router, logits [N, E], indices [N, k]) -> weights [N, k]."""


def find_routers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of every MoE router of `model`, in forward order: modules whose class name ends in
    "Router" and that choose `top_k` experts (transformers 5.x names them `*TopKRouter` / `*TopkRouter`)."""
    return [(name, m) for name, m in model.named_modules()
            if type(m).__name__.lower().endswith("router") and isinstance(getattr(m, "top_k", None), int)]


def router_layers(names: list[str]) -> list[int]:
    """The decoder layer of each router, from its qualified name (`model.layers.7.mlp.gate` -> 7): the index an
    engine's per-layer routes use (vLLM's routed experts are [positions, num_hidden_layers, top_k]). Raises
    ValueError naming a router whose name holds no layer index."""
    layers = []
    for name in names:
        found = re.findall(r"(?:^|\.)layers\.(\d+)\.", name)
        if not found:
            raise ValueError(f"router {name}: no decoder layer index in its name (…layers.N…), so an engine's "
                             "per-layer routes cannot be matched to it")
        layers.append(int(found[-1]))
    return layers


def _hidden_size(router: nn.Module) -> int:
    size = getattr(router, "hidden_dim", None)
    if isinstance(size, int):
        return size
    weight = getattr(router, "weight", None)
    if isinstance(weight, Tensor) and weight.dim() == 2:
        return int(weight.shape[1])
    raise ValueError(f"{type(router).__name__}: no hidden_dim or [experts, hidden] weight to probe it with")


@torch.no_grad()
def router_rule(router: nn.Module, *, tokens: int = 32, seed: int = 0) -> str | None:
    """The name of the first of `RULES` that reproduces `router`'s own weights from its own logits and indices on
    `tokens` random hidden states bit for bit, else the first that does to float32 round-off, else None. (Two
    rules can agree in value: a softmax over the top-k logits is the renormalised softmax; the bit-exact one
    replays a model's own routes to the same logits.)"""
    weight = next(router.parameters())
    gen = torch.Generator(device="cpu").manual_seed(seed)
    hidden = torch.randn(tokens, _hidden_size(router), generator=gen).to(weight.device, weight.dtype)
    out = router(hidden)
    if not (isinstance(out, tuple) and len(out) == 3):
        return None
    logits, weights, indices = out
    again = {name: rule(router, logits, indices).to(weights.dtype) for name, rule in RULES.items()}
    same = [n for n, w in again.items() if w.shape == weights.shape and torch.equal(w, weights)]
    close = [n for n, w in again.items()
             if w.shape == weights.shape and torch.allclose(w, weights, rtol=1e-5, atol=1e-6)]
    return (same or close or [None])[0]


@contextlib.contextmanager
def _gathered(model: nn.Module, name: str) -> Iterator[None]:
    """Within: the FSDP2 modules that hold the module `name` of `model` (none when it is not sharded) have their
    parameters gathered, so it can run outside their forward (a collective: every rank of the group enters)."""
    from torch.distributed.fsdp import FSDPModule
    owners = [m for prefix, m in model.named_modules()
              if isinstance(m, FSDPModule) and (not prefix or name.startswith(prefix + "."))]
    for owner in owners:
        owner.unshard()
    try:
        yield
    finally:
        for owner in reversed(owners):
            owner.reshard()


def route_disagreement(own: Tensor, replayed: Tensor) -> Tensor:
    """Per token (a bool [N]): whether the expert set a router chose itself (`own`, [N, k]) differs from the
    replayed one ([N, k]); the order within the k does not count."""
    return (own.sort(dim=-1).values != replayed.sort(dim=-1).values).any(dim=-1)


@dataclasses.dataclass
class Recorded:
    """What one recording saw: each router's indices, per call, in the order the routers ran."""

    names: list[str]
    calls: dict[str, list[Tensor]] = dataclasses.field(default_factory=dict)

    def routes(self) -> Tensor:
        """[tokens, routers, top_k] int64: each router's first call of the recording (a recompute under gradient
        checkpointing calls it again with the same tokens)."""
        missing = [n for n in self.names if not self.calls.get(n)]
        if missing:
            raise RuntimeError(f"routing replay: the recorded forward never ran router {missing[0]}")
        return torch.stack([self.calls[n][0] for n in self.names], dim=1)


@dataclasses.dataclass
class Replayed:
    """What one replay saw, summed over its router calls on the routers' device (read back only when asked):
    (token, router) pairs whose own top-k differed from the replayed one, and pairs counted."""

    differed: Tensor | int = 0
    tokens: Tensor | int = 0

    def add(self, other: "Replayed") -> None:
        """Count another replay's pairs here too."""
        self.differed = self.differed + other.differed
        self.tokens = self.tokens + other.tokens

    def share(self) -> Tensor:
        """`disagreement` as a 0-d float tensor on the routers' device (no read-back)."""
        return torch.as_tensor(self.differed, dtype=torch.float32) / torch.as_tensor(self.tokens).clamp(min=1)

    def disagreement(self) -> float:
        """The share of (token, router) pairs whose own choice differed from the replayed one (0 when none ran)."""
        tokens = int(self.tokens)
        return int(self.differed) / tokens if tokens else 0.0


class RoutingReplay:
    """The MoE routers of `model`, all with one forward hook registered here, for good: what the hook does is
    chosen by the contexts below (record, replay, tap; several at once), so nothing is registered or removed per
    forward, and the hook's per-router work runs outside any compiled graph (a compiled layer sees the same hook at
    every router and compiles once for all layers). Raises ValueError when the model has no
    router. Each router's rule (`router_rule`) is probed on the first replay, or by `check_rules`, which raises
    naming the first router no rule reproduces."""

    def __init__(self, model: nn.Module):
        self.routers = find_routers(model)
        self._model = model
        if not self.routers:
            raise ValueError(f"{type(model).__name__}: no mixture-of-experts router to replay (routing replay is for "
                             "MoE models)")
        self.rules: dict[str, str] = {}
        self._recorded: Recorded | None = None
        self._replay: tuple[Tensor, Tensor | None, Replayed] | None = None
        self._tapped: dict[str, tuple[Tensor, Tensor]] | None = None
        self._position = {router: (i, name) for i, (name, router) in enumerate(self.routers)}
        hook = self._hook
        for _, router in self.routers:  # one hook for every router: a compiled layer's guards never tell them apart
            router.register_forward_hook(hook)

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.routers]

    def check_rules(self) -> None:
        """Probe every router's rule (once); ValueError naming the first router no rule reproduces."""
        for name, router in self.routers:
            if name in self.rules:
                continue
            with _gathered(self._model, name):
                rule = router_rule(router)
            if rule is None:
                raise ValueError(f"routing replay: router {name} ({type(router).__name__}) weights its experts by no "
                                 f"known rule ({', '.join(RULES)}); it cannot be replayed")
            self.rules[name] = rule

    def _hook(self, module: nn.Module, args, out: tuple) -> tuple:
        if self._replay is None and self._recorded is None and self._tapped is None:
            return out
        return self._observed(module, out)

    @torch.compiler.disable
    def _observed(self, module: nn.Module, out: tuple) -> tuple:
        """What the contexts ask of one router call, run eagerly (autograd as usual): a compiled layer breaks its
        graph here instead of specialising on each router's position and name (a recompile per layer, past
        Dynamo's limit of 8 on a 16-layer OLMoE, measured on an H100)."""
        i, name = self._position[module]
        if self._replay is not None:
            out = self._replayed(i, name, module, out)
        if self._recorded is not None:
            self._recorded.calls.setdefault(name, []).append(out[2].detach())
        if self._tapped is not None:
            self._tapped.setdefault(name, (out[0], out[2]))
        return out

    def _replayed(self, i: int, name: str, module: nn.Module, out: tuple) -> tuple:
        routes, counted, known, replayed = self._replay
        logits, weights, own = out
        chosen = routes[:, i].to(own.device, own.dtype)
        if chosen.shape != own.shape:
            raise RuntimeError(f"routing replay: router {name} ran {tuple(own.shape)} (tokens, top_k) but the routes "
                               f"hold {tuple(chosen.shape)}: routes and tokens are out of step")
        weight = torch.ones_like(own[:, 0], dtype=torch.bool) if counted is None else counted.to(own.device)
        if known is not None:  # the other tokens keep the router's own choice
            known = known.to(own.device)
            chosen = torch.where(known[:, None], chosen, own)
            weight = weight & known
        # a recompute counts its tokens again: the share is unchanged
        replayed.differed = replayed.differed + (route_disagreement(own, chosen) & weight).sum()
        replayed.tokens = replayed.tokens + weight.sum()
        return logits, RULES[self.rules[name]](module, logits, chosen).to(weights.dtype), chosen

    @contextlib.contextmanager
    def recording(self) -> Iterator[Recorded]:
        """Within: every router's chosen indices are kept (detached), per call."""
        self._recorded = Recorded(self.names)
        try:
            yield self._recorded
        finally:
            self._recorded = None

    @contextlib.contextmanager
    def replaying(self, routes: Tensor, counted: Tensor | None = None, known: Tensor | None = None
                  ) -> Iterator[Replayed]:
        """Within: router r picks `routes[:, r]` ([tokens, routers, top_k], the tokens in the order the forward
        runs them), weighted by its rule from its own logits, in every call (a recompute gets the same). A forward
        over another number of tokens raises. `counted` (bool [tokens]; None: all) marks the tokens whose
        disagreement counts (not a padded row's padding, whose routes are placeholders). `known` (bool [tokens];
        None: all) marks the tokens replayed; the others keep the router's own choice (and are not counted)."""
        if routes.dim() != 3 or routes.shape[1] != len(self.routers):
            raise ValueError(f"routing replay: routes of shape {tuple(routes.shape)}; expected [tokens, "
                             f"{len(self.routers)} routers, top_k]")
        self.check_rules()
        self._replay = (routes, counted, known, Replayed())
        try:
            yield self._replay[3]
        finally:
            self._replay = None

    @contextlib.contextmanager
    def tapping(self) -> Iterator[dict[str, tuple[Tensor, Tensor]]]:
        """Within: each router's (logits [N, E], indices [N, k]) of its first call (the forward; a checkpointed
        recompute calls it again), the logits with their graph (an auxiliary loss on them reaches the router), the
        indices those the forward used (replayed ones under `replaying`)."""
        self._tapped = {}
        try:
            yield self._tapped
        finally:
            self._tapped = None
