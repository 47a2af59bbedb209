"""The trainer group's commands as typed data (asyncrl/rpc/commands.py): a collated batch, a follower's share of a
step and every command's header travel as JSON plus tensors and come back equal, nothing unpickled; a header naming
an unknown dtype, a bad shape or unknown batch fields is refused, and so is a share whose rows are not the ones the
step's deal gives the follower. The wire is a stand-in for gloo's broadcast, send and recv (the launched
trainer-group runs and tests/learner/test_fsdp4.py use the real ones)."""

from __future__ import annotations

import collections

import pytest
import torch

from asyncrl.rpc import commands
from tests.learner_helpers import synthetic_groups, tiny_policy, trainer_config


class Wire:
    """`dist.broadcast` (and `send` / `recv`) as rank 0 sends (each tensor copied onto the wire) and a follower
    receives (copied off)."""

    def __init__(self):
        self.sent = collections.deque()
        self.receiving = False

    def broadcast(self, tensor, **_):
        if self.receiving:
            tensor.copy_(self.sent.popleft())
        else:
            self.sent.append(tensor.clone())


@pytest.fixture
def wire(monkeypatch):
    w = Wire()
    for name in ("broadcast", "send", "recv"):
        monkeypatch.setattr(commands.dist, name, w.broadcast)
    return w


def _roundtrip(wire: Wire, header: dict, tensors=()):
    wire.receiving = False
    commands.broadcast_command(object(), header, list(tensors))
    wire.receiving = True
    return commands.receive_command(object())


def test_a_collated_step_arrives_as_the_same_batch(wire):
    from asyncrl.config import GRPO
    from asyncrl.learner import build_learner
    state = build_learner(tiny_policy(), trainer_config(), GRPO())
    groups = synthetic_groups(3, 2, seed=1, prompt_lens=(2, 6), response_lens=(1, 7))
    batch = commands.collate_step(state, groups)
    header, tensors = commands._batch_message(batch)
    got_header, got_tensors = _roundtrip(wire, {"cmd": "step", "version": 7, **header}, tensors)
    again = commands._batch_of(got_header, got_tensors)
    assert got_header["cmd"] == "step" and got_header["version"] == 7 and not wire.sent
    assert again.prompt_ids == batch.prompt_ids and again.nonfinite_logprobs == batch.nonfinite_logprobs
    for name in got_header["fields"]:
        assert torch.equal(getattr(again, name), getattr(batch, name)), name
        assert getattr(again, name).dtype == getattr(batch, name).dtype


def test_a_follower_receives_only_its_share_and_the_deal_it_computes_agrees(wire):
    """Rank 0 deals a step of 5 groups over 3 ranks and sends rank 1 its share: rank 1 gets the rows of the groups
    dealt it (and no other), computes the same deal from the counts, and a share of other rows is refused."""
    import dataclasses

    from asyncrl.config import GRPO
    from asyncrl.learner import build_learner
    from asyncrl.learner.share import Deal, group_counts, take_share
    state = build_learner(tiny_policy(), trainer_config(mini_batch_size=2), GRPO())
    state.step = 4
    batch = commands.collate_step(state, synthetic_groups(5, 2, seed=2, prompt_lens=(2, 6), response_lens=(1, 9)))
    deal = Deal.of_step(state.config, state.step, *group_counts(batch), 3)
    sent = take_share(batch, deal, 1)
    wire.receiving = False
    commands.send_command(object(), 1, *commands._share_message(sent))
    wire.receiving = True
    share = commands._share_of(*commands.receive_sent(object()), state, 1, 3)
    assert share.rows == sent.rows == deal.held(1) and 0 < len(share.rows) < batch.num_rows
    assert share.deal == deal and not wire.sent
    assert set(share.batch.group_index.tolist()) == set(deal.groups(1))
    for name in ("tokens", "response_mask", "logp_behaviour", "rewards", "group_index"):
        assert torch.equal(getattr(share.batch, name), getattr(batch, name)[share.rows]), name
    header, tensors = commands._share_message(dataclasses.replace(sent, rows=deal.held(2)))
    with pytest.raises(RuntimeError, match="rank 1 was sent rows"):
        commands._share_of(header, tensors, state, 1, 3)


def test_headers_without_tensors_round_trip(wire):
    for header in ({"cmd": "stop"}, {"cmd": "weights", "dtype": "bfloat16"},
                   {"cmd": "checkpoint", "run_dir": "/tmp/r", "version": 3, "keep": 2}):
        got, tensors = _roundtrip(wire, header)
        assert {k: v for k, v in got.items() if k != "tensors"} == header and tensors == []


@pytest.mark.parametrize("spec", [["torch.complex64", [2]], ["torch.int64", [-1]], ["object", [1]], "x"])
def test_a_header_of_unknown_tensors_is_refused(wire, spec):
    import json
    data = json.dumps({"cmd": "step", "tensors": [spec]}).encode()
    wire.receiving = True
    wire.sent.extend([torch.tensor([len(data)]), torch.frombuffer(bytearray(data), dtype=torch.uint8)])
    with pytest.raises(RuntimeError, match="a command header that is not one"):
        commands.receive_command(object())


def test_a_batch_of_unknown_fields_is_refused():
    with pytest.raises(RuntimeError, match="a step whose batch fields are"):
        commands._batch_of({"fields": ["tokens", "__class__"], "prompt_ids": [], "nonfinite_logprobs": 0},
                           [torch.zeros(1), torch.zeros(1)])
