"""Work sized to each device's speed (``plan.sizing``): a rank's work, the predicted step, the splits chosen for
slow ranks; clusters of mixed devices (``plan.mixed``): their files, their proportions, the plan sized to the
cost model's speeds of each kind, with its memory per device and the gain over an even split."""

import pytest

from hybridpar.errors import ClusterError, PlanError
from hybridpar.models.cosmoflow import cosmoflow
from hybridpar.plan import Plan, cluster_of, graph_of, plan, search_plans
from hybridpar.plan.mixed import MixedCluster
from hybridpar.plan.sizing import MIN_GAIN, Layers, rank_work, sized, step_time

VOLUME = (8, 1, 64, 64, 64)


def test_uneven_shares_and_slabs_round_trip_and_are_checked():
    plan = Plan(dp=2, global_batch=8, shares=(5, 3), spatial=(2, 1), slabs=((1, 3), ()))
    assert Plan.from_json(plan.to_json()) == plan
    assert plan.batch_rows(1) == (5, 8) and plan.loss_weight(0) == 5 * 2 / 8
    assert plan.describe() == "dp=2 shares 5:3 spatial=2x1 slabs[0] 1:3"
    assert Plan(dp=2, global_batch=8, shares=(4, 4)).shares == (), "even shares have one form"
    with pytest.raises(PlanError, match=r"shares = \[5, 2\]: give dp=2 sample counts that sum to global_batch = 8"):
        Plan(dp=2, global_batch=8, shares=(5, 2)).check_uneven()
    with pytest.raises(PlanError, match="not run under pipeline stages"):
        Plan(pp=2, dp=2, global_batch=8, micro_batches=2, shares=(6, 2)).check_uneven()
    with pytest.raises(PlanError, match=r"plan slabs: slab weights \[1, 0\] of spatial dim 0"):
        Plan(spatial=(2,), slabs=((1, 0),)).check_uneven()
    with pytest.raises(PlanError, match="slabs = .*expected a list of lists of whole numbers"):
        Plan.from_dict({"schema_version": 1, "slabs": [[1, 0.5]]})


def test_rank_work_is_the_share_of_batch_and_volume():
    even = Plan(dp=2, spatial=(1, 2, 1), global_batch=8, input_shape=VOLUME)
    assert [rank_work(even, r) for r in range(4)] == [1.0] * 4
    uneven = Plan(dp=2, spatial=(1, 2, 1), global_batch=8, input_shape=VOLUME, shares=(2, 6), slabs=((), (3, 1), ()))
    assert [rank_work(uneven, r) for r in range(4)] == [0.5 * 1.5, 0.5 * 0.5, 1.5 * 1.5, 1.5 * 0.5]
    assert step_time(uneven, (1, 1, 1, 1)) == 2.25


def test_a_slow_replica_gets_fewer_samples_each_where_it_ends_soonest():
    plan = Plan(dp=4, global_batch=16)
    faster = sized(plan, (1, 1, 0.5, 1))
    assert faster.shares == (5, 5, 2, 4)  # 5 / 1 = 1.25 per unit, the best whole samples allow (2 / 0.5 = 1)
    assert step_time(faster, (1, 1, 0.5, 1)) == 1.25 < step_time(plan, (1, 1, 0.5, 1)) == 2.0
    assert sized(plan, (1, 1, 1, 1)) == plan, "nothing to gain: the plan stays"
    assert sized(plan, (1, 1, 1 - MIN_GAIN / 4, 1)) == plan, "a gain below MIN_GAIN is no reason to re-plan"


def test_a_slow_spatial_part_gets_a_thinner_slab_where_that_is_faster():
    plan = Plan(dp=2, spatial=(2, 1, 1), global_batch=8, input_shape=VOLUME)
    speeds = (1, 0.5, 1, 1)  # rank 1: replica 0, part 1
    chosen = sized(plan, speeds)
    assert chosen.slabs == ((2, 1), (), ()) and not chosen.shares
    no_slabs = sized(plan, speeds, accept=lambda p: not p.slabs)  # the grid's rules may refuse them
    assert no_slabs.shares == (3, 5) and not no_slabs.slabs
    assert step_time(chosen, speeds) < step_time(no_slabs, speeds) < step_time(plan, speeds)


def test_pipelines_take_no_uneven_shares():
    plan = Plan(dp=2, pp=2, global_batch=8, micro_batches=2)
    assert sized(plan, (1, 1, 0.5, 1)) == plan


def test_a_slow_pipeline_stage_gets_fewer_layers():
    """Stage boundaries where the slowest stage's FLOPs over its speed is least, among the cuts the model allows."""
    layers = Layers(flops=(1, 10, 10, 10, 10, 1), names=tuple("abcdef"), starts=(1, 2, 3, 4, 5))
    plan = Plan(pp=2, stages=("c",), global_batch=4, micro_batches=2)  # 11 and 31 FLOPs
    assert layers.stage_work(plan) == (11 / 21, 31 / 21)
    assert sized(plan, (1, 1), layers=layers).stages == ("d",), "even speeds: 11 and 31 become 21 and 21"
    slow_last = sized(plan, (1, 0.25), layers=layers)
    assert slow_last.stages == ("f",) and step_time(slow_last, (1, 0.25), layers) == 41 / 21
    narrow = Layers(flops=layers.flops, names=layers.names, starts=(2, 4))  # where the model may be cut
    assert sized(plan, (1, 0.25), layers=narrow).stages == ("e",)
    three = Plan(pp=3, stages=("b", "d"), global_batch=4, micro_batches=3)
    assert sized(three, (1, 1, 0.5), layers=layers).stages == ("d", "f"), "21, 20 and 1 / 0.5 FLOPs"


@pytest.fixture(scope="module")
def mixed_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixed") / "mixed.toml"
    path.write_text('name = "half and half"\n[[group]]\ncluster = "a100-80"\nnodes = 2\n'
                    '[[group]]\ncluster = "h100"\nnodes = 2\n')
    return path


def test_a_mixed_cluster_file_and_its_proportions(mixed_file):
    mixed = cluster_of(str(mixed_file))
    assert isinstance(mixed, MixedCluster) and mixed.num_devices == 32
    assert [mixed.group_of_rank(r) for r in (0, 15, 16, 31)] == [0, 0, 1, 1]
    assert mixed.describe() == "2 x 8 a100-80 + 2 x 8 h100"
    assert mixed.with_devices(64).describe() == "4 x 8 a100-80 + 4 x 8 h100"
    reference = mixed.reference("float32")
    assert reference.name == "half and half (as a100-80)" and reference.num_devices == 32
    with pytest.raises(ClusterError, match="a100-80 has no peak FLOP/s for float8"):
        mixed.reference("float8")
    with pytest.raises(ClusterError, match="keeps its proportions on multiples of 16 devices"):
        mixed.with_devices(24)


@pytest.mark.parametrize("text, message", [
    ('name = "m"\n[[group]]\ncluster = "a100-80"\nnodes = 0\n', r"group\[0\].nodes = 0: expected a whole number"),
    ('name = "m"\n[[group]]\ncluster = "tpu"\nnodes = 1\n', "tpu: no such file, and not a preset name"),
    ('name = "m"\n[[group]]\ncluster = "h100"\nnodes = 1\nspeed = 2\n', r"unknown key group\[0\].speed"),
    ('name = "m"\nnodes = 2\n[[group]]\ncluster = "h100"\nnodes = 1\n', "unknown key nodes; a mixed cluster's top"),
    ('name = "m"\n[[group]]\ncluster = "m.toml"\nnodes = 1\n', "m.toml: is a mixed cluster itself"),
    ('name = "m"\ngroup = [1]\n', r"group\[0\] = 1: expected a \[\[group\]\] table"),
])
def test_mixed_cluster_files_that_are_refused(tmp_path, text, message):
    (tmp_path / "m.toml").write_text(text)
    with pytest.raises(ClusterError, match=message):
        cluster_of(str(tmp_path / "m.toml"))


def test_cosmoflow_on_half_a100_half_h100_is_sized_to_the_devices(mixed_file):
    """The planner sizes the work to each kind's speed (the cost model's): the H100s take more, every device stays
    within its memory, and the step beats the same plan split evenly."""
    model = cosmoflow(size=128, in_channels=4, base_channels=16, num_blocks=5, fc_sizes=(64,), num_outputs=4)
    graph = graph_of(model, (8, 4, 128, 128, 128), "float32")
    result = search_plans(graph, None, cluster_of(str(mixed_file)), global_batch=64, top=3)
    best = result.sized[0]
    assert best.plan == result.plans[0] == plan(graph, None, cluster_of(str(mixed_file)), global_batch=64, top=3)
    (a100, n_a, speed_a, even_a, work_a), (h100, n_h, speed_h, even_h, work_h) = best.rows
    assert (a100, n_a, h100, n_h) == ("a100-80", 16, "h100", 16) and speed_a == 1 < 2 < speed_h < 3
    assert even_a == even_h == 1 and work_a < 1 < work_h
    assert best.plan.prediction.step_time < 0.8 * best.even.prediction.step_time
    assert best.plan.prediction.memory["total"] <= 80 * 2**30
    assert [p.prediction.step_time for p in result.plans] == sorted(p.prediction.step_time for p in result.plans)


def test_a_plan_file_with_shares_is_priced_on_the_mixed_devices(mixed_file):
    """``validate`` (a plan file on ``cluster = "mixed.toml"``) prices the shares as written: faster than even where
    the H100 replicas take more, slower where they take less, refused where a device runs out of memory."""
    from hybridpar.errors import PlanError
    from hybridpar.plan import validate

    model = cosmoflow(size=128, in_channels=4, base_channels=16, num_blocks=5, fc_sizes=(64,), num_outputs=4)
    graph = graph_of(model, (8, 4, 128, 128, 128), "float32")
    mixed = cluster_of(str(mixed_file))
    even = Plan(dp=2, spatial=(4, 4, 1), global_batch=8, input_shape=(8, 4, 128, 128, 128))
    step = {shares: validate(Plan(**{**even.__dict__, "shares": shares}), graph, mixed).prediction.step_time
            for shares in ((), (2, 6), (6, 2))}
    assert step[(2, 6)] < step[()] < step[(6, 2)]
    huge = Plan(dp=2, spatial=(4, 4, 1), global_batch=2048, shares=(1, 2047), input_shape=(2048, 4, 128, 128, 128))
    with pytest.raises(PlanError, match=r"rank 16 \(h100\) needs .* GiB with its work of 2.00 even shares"):
        validate(huge, graph, mixed)
