"""Pipeline schedules as data: text form, structure of each schedule, argument errors (pure logic, no ranks)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise import pipeline as pp
from shardwise.pipeline import Action, Op, Schedule, ScheduleError


def test_action_text_round_trip():
    for text, want in [("0F3", Action(Op.FORWARD, 0, 3)), ("1B2", Action(Op.BACKWARD, 1, 2)),
                       ("1I2", Action(Op.INPUT, 1, 2)), ("12W10", Action(Op.WEIGHT, 12, 10)),
                       ("0SEND_F3", Action(Op.SEND_F, 0, 3)), ("1RECV_B0", Action(Op.RECV_B, 1, 0))]:
        assert Action.parse(text) == want
        assert str(want) == text
    with pytest.raises(ScheduleError, match="'0X3' is not an action"):
        Action.parse("0X3")


def test_schedule_text_round_trip():
    sched = pp.build_schedule("zb_h1", 4, 8)
    again = Schedule.from_text(sched.to_text(), n_microbatches=8)
    assert again.actions == sched.actions


def _compute(sched: Schedule, rank: int) -> list[str]:
    return [str(a) for a in sched.actions[rank] if a.is_compute]


def test_gpipe_runs_all_forwards_then_all_backwards():
    sched = pp.build_schedule("gpipe", 2, 3)
    assert _compute(sched, 1) == ["1F0", "1F1", "1F2", "1B0", "1B1", "1B2"]


def test_1f1b_warms_up_p_minus_rank_minus_one_forwards():
    sched = pp.build_schedule("1f1b", 4, 6)
    assert _compute(sched, 0) == ["0F0", "0F1", "0F2", "0F3", "0B0", "0F4", "0B1", "0F5", "0B2", "0B3", "0B4", "0B5"]
    assert _compute(sched, 3) == ["3F0", "3B0", "3F1", "3B1", "3F2", "3B2", "3F3", "3B3", "3F4", "3B4", "3F5", "3B5"]


def test_zb_h1_splits_backward_and_rank_r_defers_r_weight_passes():
    sched = pp.build_schedule("zb_h1", 2, 4)
    assert _compute(sched, 0) == ["0F0", "0F1", "0I0", "0W0", "0F2", "0I1", "0W1", "0F3", "0I2", "0W2", "0I3", "0W3"]
    assert _compute(sched, 1) == ["1F0", "1I0", "1F1", "1I1", "1W0", "1F2", "1I2", "1W1", "1F3", "1I3", "1W2", "1W3"]
    assert not any(a.op is Op.BACKWARD for acts in sched.actions for a in acts)


def test_interleaved_places_stage_s_on_rank_s_mod_p_in_megatron_order():
    sched = pp.build_schedule("interleaved_1f1b", 2, 4, virtual_stages=2)
    assert sched.n_stages == 4 and sched.stages_of(1) == [1, 3]
    # Megatron: forwards go chunk by chunk in groups of p microbatches; rank 0 warms up (p-1)*2 + (v-1)*p = 4.
    assert _compute(sched, 0)[:5] == ["0F0", "0F1", "2F0", "2F1", "0F2"]
    assert {a.stage for a in sched.actions[1]} == {1, 3}


def test_sends_follow_their_producer_and_receives_come_right_before_their_consumer():
    # Megatron's pairing: the sends of one compute action and the receives of the next form one batch.
    sched = pp.build_schedule("1f1b", 2, 2)
    text = [str(a) for a in sched.actions[1]]
    assert text == ["1RECV_F0", "1F0", "1B0", "1SEND_B0", "1RECV_F1", "1F1", "1B1", "1SEND_B1"]
    text0 = [str(a) for a in sched.actions[0]]
    assert text0 == ["0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0", "0RECV_B1", "0B1"]


def test_interleaved_steady_state_exchanges_each_f_b_pair_together():
    sched = pp.build_schedule("interleaved_1f1b", 2, 4, virtual_stages=2)
    text = " ".join(str(a) for a in sched.actions[0])
    # rank 0's first steady pair (0F2, 2B0): both receives before the F, nothing between the F and the B, both sends
    # after the B, together with the next pair's receives: one batch.
    assert "2SEND_F1 2RECV_B0 0F2 2B0 0SEND_F2 2SEND_B0 2RECV_B1 0F3 2B1" in text


@pytest.mark.parametrize(
    "name, p, m, v, match",
    [
        ("1f1b", 4, 3, 1, r"schedule='1f1b' needs n_microbatches >= the number of pipeline ranks \(4\), got n_micro"),
        ("zb_h1", 2, 1, 1, r"needs n_microbatches >= the number of pipeline ranks \(2\)"),
        ("interleaved_1f1b", 4, 6, 2, r"multiple of the number of pipeline ranks \(4\), got n_microbatches=6"),
        ("interleaved_1f1b", 2, 4, 1, r"needs virtual_stages >= 2 \(got 1\)"),
        ("gpipe", 2, 4, 2, r"runs one stage per rank but virtual_stages=2"),
        ("pipedream", 2, 4, 1, r"schedule='pipedream' is not a schedule; allowed \['gpipe', '1f1b'"),
        ("gpipe", 0, 4, 1, r"n_stages=0 must be a positive int"),
    ],
)
def test_bad_arguments_are_value_errors_naming_them(name, p, m, v, match):
    with pytest.raises(ValueError, match=match):
        pp.build_schedule(name, p, m, virtual_stages=v)


def test_gpipe_accepts_fewer_microbatches_than_ranks():
    assert pp.simulate("gpipe", 4, 2).peak_inflight == 2


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(pp.SCHEDULES), p=st.integers(1, 6), k=st.integers(1, 3), v=st.integers(2, 3))
def test_every_schedule_is_complete_and_runs_each_pass_once(name, p, k, v):
    v = v if name == "interleaved_1f1b" else 1
    m = p * k
    sched = pp.build_schedule(name, p, m, virtual_stages=v)
    pp.check_schedule(sched)  # raises on any missing/duplicated pass or unmatched message
    computed = [a for acts in sched.actions for a in acts if a.is_compute]
    forwards = {(a.stage, a.microbatch) for a in computed if a.op is Op.FORWARD}
    assert forwards == {(s, mb) for s in range(p * v) for mb in range(m)}
    assert len(computed) == len(set(computed))
