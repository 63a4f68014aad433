"""The communication step's split, from profiler events written by hand and one recorded on a GPU
(times in microseconds)."""

import json
from pathlib import Path

import pytest

from flops_callbacks.communication.breakdown import Collective, TimeSplit, breakdown, bus_factor, combine
from flops_callbacks.communication.events import TraceEvent, classify, collective_op, mark_name
from flops_callbacks.communication.intervals import total

MAIN, GLOO = 1, 7  # host threads
STREAM, NCCL = 30, 31  # a GPU's compute stream and NCCL's
F1, F2 = ("float",), ("float", "float")


def mark(phase, at, waited=None):
    return TraceEvent(mark_name(phase, waited), at, at, MAIN, annotation=True)


def ddp_step(waits=(None, None, None, None)):
    """A forward 0..100, a backward 100..300, a step 300..320 on the main thread. The backward's ops run
    100..250 and 260..280, each copying a ready gradient into its bucket (DDP's reducer: 190..199 and
    265..269) and launching an all-reduce (199..200, 269..270); gloo's all-reduces run 200..240 (under
    the backward's ops) and 270..295 (10 us under them, 15 alone); the main thread waits 280..290 inside
    an op that ends at 291 (the wait is not compute: HTA's users' case), then copies the bucket back to
    the gradients 295..298; nothing runs 250..260 and 298..300. ``waits``: the training thread's wait
    for a core at each of the four marks (seconds; None: not read)."""
    return [
        mark("forward", 0, waits[0]),
        TraceEvent("aten::addmm", 0, 100, MAIN),
        mark("backward", 100, waits[1]),
        TraceEvent("autograd::engine::evaluate_function: AddmmBackward0", 100, 250, MAIN),
        TraceEvent("torch::distributed::reducer::mul_out", 190, 199, MAIN),
        TraceEvent("c10d::allreduce_", 199, 200, MAIN, shapes=((),), dtypes=("TensorList",)),
        TraceEvent("gloo:all_reduce", 200, 240, GLOO, shapes=((1000,),), dtypes=("float",)),
        TraceEvent("autograd::engine::evaluate_function: AddmmBackward0", 260, 280, MAIN),
        TraceEvent("torch::distributed::reducer::mul_out", 265, 269, MAIN),
        TraceEvent("c10d::allreduce_", 269, 270, MAIN, shapes=((),), dtypes=("TensorList",)),
        TraceEvent("gloo:all_reduce", 270, 295, GLOO, shapes=((500,),), dtypes=("float",)),
        TraceEvent("aten::copy_", 271, 272, GLOO),  # gloo's own work: not compute
        TraceEvent("autograd::engine::evaluate_function: torch::autograd::AccumulateGrad", 280, 291, MAIN),
        TraceEvent("c10d::wait", 280, 290, MAIN),  # nested: the op waits on the collective
        TraceEvent("torch.distributed.ddp.reducer::copy_bucket_to_grad", 295, 298, MAIN),
        TraceEvent("my span", 0, 320, MAIN, annotation=True),  # a user's range covers everything: ignored
        mark("optimizer_step", 300, waits[2]),
        TraceEvent("Optimizer.step#SGD.step", 300, 320, MAIN),
        mark("", 320, waits[3]),
    ]


def test_classify_takes_gloo_work_the_reducers_copies_and_waits_as_communication_not_compute():
    events = classify(ddp_step())
    # the launches, the wait and the reducer's copies count as communication on the host: a step
    # without gradient sync does none of them
    assert events.comm == [(190, 240), (265, 298)]
    assert events.compute == [(0, 190), (200, 250), (260, 265), (270, 280), (290, 291), (300, 320)]
    assert [c.op for c in events.calls] == ["all_reduce", "all_reduce"]
    assert [c.nbytes for c in events.calls] == [4000, 2000]
    assert [round(c.seconds * 1e6) for c in events.calls] == [40, 25]


def test_fsdp2_copies_in_are_communication_too():
    """The all-gather's copy-in in the forward, the reduce-scatter's (``fsdp::chunk_cat`` over the
    model's own ``aten::_chunk_cat``) in the backward."""
    events = classify([
        mark("forward", 0),
        TraceEvent("FSDP::all_gather", 0, 30, MAIN, annotation=True),  # FSDP's range: a span, not work
        TraceEvent("fsdp::all_gather_copy_in", 0, 20, MAIN),
        TraceEvent("c10d::_allgather_base_", 20, 21, MAIN, shapes=((64,),), dtypes=("float",)),
        TraceEvent("gloo:all_gather", 21, 60, GLOO),
        TraceEvent("aten::addmm", 60, 100, MAIN),
        mark("backward", 100),
        TraceEvent("aten::mm", 100, 140, MAIN),
        TraceEvent("fsdp::chunk_cat", 140, 150, MAIN),
        TraceEvent("aten::_chunk_cat", 141, 149, MAIN),
        TraceEvent("c10d::_reduce_scatter_base_", 150, 151, MAIN, shapes=((64,), (32,)), dtypes=F2),
        TraceEvent("gloo:all_reduce", 151, 170, GLOO),
        TraceEvent("aten::_chunk_cat", 170, 180, MAIN),  # a model's own: compute
        mark("", 180),
    ])  # fmt: skip
    assert events.comm == [(0, 60), (140, 170)]
    assert events.compute == [(60, 140), (170, 180)]


def test_breakdown_splits_the_step_and_each_phase():
    split = breakdown(classify(ddp_step()))
    assert split is not None
    us = 1e-6
    # communication 50 + 33 = 83, under compute 200..240, 270..280 and 290..291
    assert split.step.comm == pytest.approx(83 * us)
    assert split.step.overlapped == pytest.approx(51 * us)
    assert split.step.exposed == pytest.approx(32 * us)  # 190..200, 265..270, 280..290, 291..298
    assert split.step.span == pytest.approx(320 * us)
    # idle: 250..260 and 298..300
    assert split.step.idle == pytest.approx(12 * us)
    assert split.step.overlap == pytest.approx(51 / 83)
    assert split.phases["forward"] == TimeSplit(100 * us, 100 * us, 0.0, 0.0)
    assert split.phases["backward"].exposed == pytest.approx(32 * us)
    assert split.phases["optimizer_step"].comm == 0.0
    assert split.collectives == (Collective("all_reduce", 2, 6000, pytest.approx(65 * us)),)


def test_a_cpu_threads_wait_for_a_core_under_overlapped_communication_is_exposed_not_compute():
    """The marks' readings of the training thread's wait for a core (seconds, at forward 0, backward 100,
    optimizer step 300 and the end 320): none in the forward and the step, 30 us in the backward, whose
    communication is 51 us overlapped: the 30 us move from overlapped (and compute) to exposed."""
    us = 1e-6
    plain = breakdown(classify(ddp_step()))
    split = breakdown(classify(ddp_step((0.0, 0.0, 30 * us, 30 * us))))
    assert plain is not None and split is not None
    backward = split.phases["backward"]
    assert backward.overlapped == pytest.approx(21 * us) and backward.exposed == pytest.approx(62 * us)
    assert backward.compute == pytest.approx(plain.phases["backward"].compute - 30 * us)
    assert split.phases["forward"] == plain.phases["forward"]
    assert split.phases["optimizer_step"] == plain.phases["optimizer_step"]
    assert split.step.exposed == pytest.approx(62 * us) and split.step.comm == pytest.approx(83 * us)
    assert split.step.core_wait == backward.core_wait == pytest.approx(30 * us)
    assert split.step.idle == pytest.approx(plain.step.idle)  # the wait was the ops': never idle
    # a wait longer than the overlapped time moves all of it, no more
    capped = breakdown(classify(ddp_step((0.0, 0.0, 500 * us, 500 * us))))
    assert capped is not None and capped.step.overlapped == 0.0
    assert capped.step.exposed == pytest.approx(83 * us) and capped.step.core_wait == pytest.approx(51 * us)
    # each reading travels in its mark's name: events out of order split the same
    shuffled = breakdown(classify(reversed(ddp_step((0.0, 0.0, 30 * us, 30 * us)))))
    assert shuffled is not None and (shuffled.step, shuffled.phases) == (split.step, split.phases)
    # a mark without a reading (the backward's) moves nothing of the windows it bounds
    unread = breakdown(classify(ddp_step((0.0, None, 30 * us, 30 * us))))
    assert unread is not None and (unread.step, unread.phases) == (plain.step, plain.phases)


def test_each_micro_batchs_window_moves_its_own_wait_up_to_its_own_overlapped_time():
    """Two micro-batches' backwards (gradient accumulation), 0..100 and 100..200, each 80 us of compute
    with a gloo all-reduce, 40 us under the first's compute and 10 under the second's (and 10 after
    it); the thread waited 30 us for a core in each. The first moves 30, the second only its 10."""
    us = 1e-6
    events = classify([
        mark("backward", 0, 0.0),
        TraceEvent("aten::mm", 0, 80, MAIN),
        TraceEvent("gloo:all_reduce", 20, 60, GLOO),
        mark("backward", 100, 30 * us),
        TraceEvent("aten::mm", 100, 180, MAIN),
        TraceEvent("gloo:all_reduce", 170, 190, GLOO),
        mark("", 200, 60 * us),
    ])  # fmt: skip
    split = breakdown(events)
    assert split is not None
    backward = split.phases["backward"]
    assert backward.core_wait == pytest.approx(40 * us) and split.step.core_wait == pytest.approx(40 * us)
    # of 60 us of communication, 50 overlapped before: 10 left (the first's 40 less 30, the second's 0)
    assert backward.overlapped == pytest.approx(10 * us) and backward.exposed == pytest.approx(50 * us)
    assert backward.compute == pytest.approx(120 * us)  # 160 less the 40 that waited


def test_the_machines_other_load_seen_in_the_phases_without_communication_does_not_move():
    """The forward (100 us of compute) waited 6 us and the step (20 us) none, with no communication: 6 us
    per 120 us of compute, 0.05, is the machine's other load. The backward's 156 us of compute (0..190
    less the forward's 100, 200..250, 260..265, 270..280, 290..291) would wait 7.8 us of it: of its 30
    us, 22.2 move. A step whose phases all wait at that rate moves nothing."""
    us = 1e-6
    split = breakdown(classify(ddp_step((0.0, 6 * us, 36 * us, 36 * us))))
    assert split is not None
    assert split.phases["backward"].core_wait == pytest.approx(30 * us - 0.05 * 156 * us)
    assert split.step.core_wait == pytest.approx(22.2 * us)
    assert split.phases["forward"].core_wait == 0.0
    loaded = breakdown(classify(ddp_step((0.0, 5 * us, 12.8 * us, 13.8 * us))))  # 0.05 throughout
    assert loaded is not None and loaded.step.core_wait == pytest.approx(0.0, abs=1e-12)


def test_gloo_reduce_scatter_is_named_by_its_launch_not_its_all_reduce_work():
    events = classify(
        [
            mark("backward", 0),
            TraceEvent("c10d::_reduce_scatter_base_", 10, 11, MAIN, shapes=((500,), (1000,)), dtypes=F2),
            TraceEvent("gloo:all_reduce", 11, 31, GLOO, shapes=((1000,),), dtypes=F1),
            TraceEvent("c10d::_allgather_base_", 40, 41, MAIN, shapes=((1000,), (500,)), dtypes=F2),
            TraceEvent("gloo:all_gather", 41, 51, GLOO, shapes=((500,),), dtypes=F1),
            mark("", 60),
        ]
    )
    assert [(c.op, c.nbytes) for c in events.calls] == [("reduce_scatter", 4000), ("all_gather", 4000)]


def test_a_gpu_step_takes_nccl_kernels_as_communication_and_other_kernels_as_compute():
    events = classify(
        [
            mark("backward", 0),
            TraceEvent("c10d::allreduce_", 5, 6, MAIN),
            TraceEvent("record_param_comms", 5, 6, MAIN, shapes=((2048,),), dtypes=("c10::BFloat16",)),
            TraceEvent("sm90_xmma_gemm_bf16", 10, 50, 7, device=True),
            TraceEvent(
                "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgs)", 40, 70, 20, device=True
            ),
            # ProcessGroupNCCL's range, drawn on the NCCL stream too: neither a second call nor work
            TraceEvent("nccl:all_reduce", 30, 70, 20, device=True, annotation=True),
            mark("", 45),
        ]
    )
    assert events.device
    assert events.comm == [(40, 70)] and events.compute == [(10, 50)]
    assert [(c.op, c.nbytes) for c in events.calls] == [("all_reduce", 4096)]
    split = breakdown(events)
    assert split is not None
    assert split.step.span == pytest.approx(70e-6)  # to the last kernel's end
    assert split.step.exposed == pytest.approx(20e-6)


def test_a_gpu_staging_copy_is_known_by_the_host_op_that_launched_it():
    """DDP's copy into its bucket runs as a kernel on the compute stream; the op that launched it (its
    correlation id) runs inside the reducer's range, so the kernel is the communication's. A kernel of
    the same name launched outside any staging range stays compute, and so do a kernel launched by an
    op of another thread that ran during the range, and one whose launcher is unknown."""
    autograd, other = 3, 4  # CUDA's backward runs on autograd's device thread
    events = classify(
        [
            mark("backward", 0),
            TraceEvent("aten::mm", 1, 2, autograd, op_id=11),
            TraceEvent("torch::distributed::reducer::mul_out", 3, 6, autograd, op_id=12),
            TraceEvent("aten::mul_out", 4, 5, autograd, op_id=13),
            TraceEvent("cudaLaunchKernel", 4, 5, autograd),  # a runtime call: no op id
            TraceEvent("aten::add", 4, 5, other, op_id=17),  # another thread, during the range
            TraceEvent("torch.distributed.ddp.reducer::copy_bucket_to_grad", 7, 8, MAIN, op_id=14),
            TraceEvent("aten::copy_", 7, 8, MAIN, op_id=15),
            TraceEvent("aten::mul", 9, 10, MAIN, op_id=16),  # the model's own, outside any staging range
            TraceEvent("sm90_gemm", 10, 40, STREAM, device=True, launched_by=11),
            TraceEvent("elementwise_kernel<MulFunctor>", 40, 45, STREAM, device=True, launched_by=13),
            TraceEvent("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 45, 60, NCCL, device=True, launched_by=0),
            TraceEvent("Memcpy DtoD (Device -> Device)", 60, 62, STREAM, device=True, launched_by=15),
            TraceEvent("elementwise_kernel<MulFunctor>", 62, 70, STREAM, device=True, launched_by=16),
            TraceEvent("elementwise_kernel<add>", 70, 72, STREAM, device=True, launched_by=17),
            TraceEvent("elementwise_kernel<fill>", 72, 74, STREAM, device=True, launched_by=0),
            mark("", 74),
        ]
    )
    assert events.comm == [(40, 62)]
    assert events.compute == [(10, 40), (62, 74)]


def test_gloo_carrying_a_gpus_tensors_is_communication_on_the_gpus_timeline():
    """DDP on a GPU over gloo: the model's kernels are the compute; gloo's host work, its copy of the
    bucket to the host (launched inside the collective's launch) and back (from gloo's thread) the
    communication; gloo's work outside the step's marks (a vote before it) is neither."""
    events = classify(
        [
            TraceEvent("gloo:all_reduce", -20, -10, GLOO),  # before the step: the ranks' vote
            mark("backward", 0),
            TraceEvent("sm90_xmma_gemm_f32", 10, 50, STREAM, device=True, launched_by=1),
            TraceEvent("aten::mm", 5, 6, MAIN, op_id=1),
            TraceEvent("c10d::allreduce_", 20, 22, MAIN, shapes=((),), dtypes=("TensorList",), op_id=2),
            TraceEvent("record_param_comms", 20, 21, MAIN, shapes=((1000,),), dtypes=("float",), op_id=3),
            TraceEvent("aten::copy_", 21, 22, MAIN, op_id=4),
            TraceEvent("Memcpy DtoH (Device -> Pinned)", 50, 52, 40, device=True, launched_by=4),
            TraceEvent("gloo:all_reduce", 52, 80, GLOO),
            TraceEvent("aten::copy_", 79, 80, GLOO, op_id=5),
            TraceEvent("Memcpy HtoD (Pinned -> Device)", 80, 82, 40, device=True, launched_by=5),
            mark("", 82),
        ]
    )
    assert events.device and events.comm == [(50, 82)] and events.compute == [(10, 50)]
    assert [(c.op, c.nbytes) for c in events.calls] == [("all_reduce", 4000)]


def test_a_range_drawn_on_a_stream_is_no_kernel_even_where_torch_does_not_flag_it():
    """A device event named as a host ``record_function`` range is that range drawn on a stream."""
    events = classify(
        [
            mark("forward", 0),
            TraceEvent("DistributedDataParallel.forward", 0, 100, MAIN, annotation=True),
            TraceEvent("DistributedDataParallel.forward", 10, 100, STREAM, device=True),
            TraceEvent("sm90_gemm", 10, 20, STREAM, device=True, launched_by=1),
            mark("", 100),
        ]
    )
    assert events.compute == [(10, 20)]


def test_a_real_gpu_trace_classes_ddps_copies_as_communication_and_no_range_as_compute():
    """A DDP step (forward and backward) recorded on an H100 (tests/communication/traces): the kernels torch
    itself pairs with the reducer's staging ops (four bucket copies in, four copies back) are the
    communication, every other kernel and copy is compute, and DDP's forward range drawn on the stream
    (953 us, idle time between kernels in it) counts as neither."""
    trace = json.loads((Path(__file__).parent / "traces" / "ddp_one_rank_h100.json").read_text())
    events = [
        TraceEvent(n, a, b, t, d, tuple(map(tuple, sh)), tuple(dt), an, op, by)
        for n, a, b, t, d, sh, dt, an, op, by in trace["events"]
    ]
    staged = [us for _, kernels in trace["torch_staged"] for _, us in kernels]
    assert len(staged) == 8
    work = [e for e in events if e.device and not e.annotation]
    forward_range = next(e for e in events if e.device and e.annotation)
    assert forward_range.end - forward_range.start > 900

    classed = classify(events)
    assert classed.device and classed.calls == []  # one rank: NCCL runs no kernel for an in-place sum
    assert total(classed.comm) == pytest.approx(sum(staged), abs=0.01)
    assert total(classed.compute) == pytest.approx(sum(e.end - e.start for e in work) - sum(staged), abs=0.01)


@pytest.mark.parametrize(
    ("name", "op"),
    [
        ("gloo:all_reduce", "all_reduce"),
        ("c10d::allgather_into_tensor_coalesced_", "all_gather"),
        ("c10d::reduce_scatter_tensor_coalesced_", "reduce_scatter"),
        ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", "reduce_scatter"),
        ("ncclKernel_AllGather_RING_LL_Sum_int8_t", "all_gather"),
        ("ncclDevKernel_Broadcast_RING_LL", "broadcast"),
        ("ncclDevKernel_SendRecv", "send_recv"),
        ("aten::mm", None),
    ],
)
def test_collective_op_names(name, op):
    assert collective_op(name) == op


def test_a_scalar_tensors_all_reduce_carries_one_element():
    events = classify(
        [
            mark("backward", 0),
            TraceEvent("c10d::allreduce_", 1, 2, MAIN, shapes=((),), dtypes=("TensorList",)),
            TraceEvent("gloo:all_reduce", 2, 3, GLOO, shapes=((),), dtypes=("double",)),
            mark("", 5),
        ]
    )
    assert [(c.op, c.nbytes) for c in events.calls] == [("all_reduce", 8)]


def test_bus_bandwidth_uses_nccl_tests_factors():
    assert bus_factor("all_reduce", 8) == 2 * 7 / 8
    assert bus_factor("all_gather", 4) == 3 / 4
    assert bus_factor("reduce_scatter", 2) == 1 / 2
    assert bus_factor("broadcast", 8) == 1
    # 1 GB all-reduced in 0.1 s on 2 ranks: algbw 10 GB/s, busbw 10 GB/s (factor 1)
    assert Collective("all_reduce", 1, 10**9, 0.1).bus_bandwidth(2) == pytest.approx(1e10)
    assert Collective("barrier", 1, None, 0.1).bus_bandwidth(2) is None


def test_ranks_combine_as_their_mean_with_the_collectives_range():
    a = breakdown(classify(ddp_step()))
    events = ddp_step()
    i = next(i for i, e in enumerate(events) if e.name == "gloo:all_reduce" and e.start == 270)
    events[i] = TraceEvent("gloo:all_reduce", 270, 305, GLOO, shapes=((500,),), dtypes=F1)  # 10 us longer
    b = breakdown(classify(events))
    assert a is not None and b is not None
    step, phases, rows = combine([a, b], 2)
    assert step.exposed == pytest.approx((a.step.exposed + b.step.exposed) / 2)
    assert set(phases) == {"forward", "backward", "optimizer_step"}
    (row,) = rows
    assert (row.op, row.calls, row.nbytes) == ("all_reduce", 2, 6000)
    assert row.seconds == (pytest.approx(65e-6), pytest.approx(75e-6))
    assert row.bus_bandwidth == (pytest.approx(6000 / 75e-6), pytest.approx(6000 / 65e-6))


def test_no_phase_mark_is_no_breakdown():
    assert breakdown(classify([TraceEvent("gloo:all_reduce", 0, 1, GLOO)])) is None


def test_an_ops_works_at_once_on_gloos_two_threads_count_their_union_not_their_sum():
    """DDP's two buckets all-reduced at once, on gloo's two worker threads (200..240 and 210..250 us): the
    op took 50 us of the step, not 80, and its bus bandwidth is over those 50 (6000 bytes, 2 ranks)."""
    events = [
        mark("forward", 0),
        TraceEvent("aten::addmm", 0, 100, MAIN),
        mark("backward", 100),
        TraceEvent("autograd::engine::evaluate_function: AddmmBackward0", 100, 200, MAIN),
        TraceEvent("c10d::allreduce_", 199, 200, MAIN, shapes=((1000,),), dtypes=F1),
        TraceEvent("c10d::allreduce_", 200, 201, MAIN, shapes=((500,),), dtypes=F1),
        TraceEvent("gloo:all_reduce", 200, 240, GLOO, shapes=((1000,),), dtypes=F1),
        TraceEvent("gloo:all_reduce", 210, 250, GLOO + 1, shapes=((500,),), dtypes=F1),
        mark("", 260),
    ]
    split = breakdown(classify(events))
    assert split is not None
    (reduce,) = split.collectives
    assert (reduce.op, reduce.calls, reduce.nbytes) == ("all_reduce", 2, 6000)
    assert reduce.seconds == pytest.approx(50e-6)
    assert reduce.bus_bandwidth(2) == pytest.approx(6000 / 50e-6 * 2 * (2 - 1) / 2)
