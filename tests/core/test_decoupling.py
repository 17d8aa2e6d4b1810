"""Robust mode's decoupling of outlying tasks (fmtl_flower.core.decoupling)."""

from __future__ import annotations

import numpy as np
import pytest

from fmtl_flower.core.decoupling import (
    CONSENSUS_MIN_TASKS,
    COUPLING_FENCE_FACTOR,
    IMAGE_PERSISTENCE,
    PULL_FENCE_FACTOR,
    STEP_SHARE_FLOOR,
    OutlierWatch,
    block_diagonal_regulariser,
    consensus_fence,
    coupled_models,
    coupling_fence,
    coupling_weights,
    decoupled_factor,
    decoupled_inverse,
    federation_scale,
    outlying,
    project_blocks,
)
from fmtl_flower.core.factored import FactoredMatrix
from fmtl_flower.core.formulations import make_formulation
from fmtl_flower.core.mocha import MOCHAServerState

M_TASKS = 6


def formulation(name: str):  # noqa: ANN201
    options = {"mean": {"lam2": 0.1}, "clustered": {"eta": 0.1, "k": 2},
               "graphical": {"s2": 10.0, "lam2": 1e-3}}.get(name, {})
    return make_formulation(name, M_TASKS, lam=0.05, **options)


@pytest.mark.parametrize("name", ["identity", "mean", "probabilistic", "clustered", "graphical"])
def test_decoupled_inverse_is_block_diagonal_and_positive_definite(name):
    f = formulation(name)
    if not f.fixed:
        f.omega_step(np.random.default_rng(0).normal(size=(4, M_TASKS)))
    M = f.inverse_matrix()
    mask = np.zeros(M_TASKS, dtype=bool)
    mask[[1, 4]] = True
    out = decoupled_inverse(M, mask)
    assert np.array_equal(out, out.T) and np.linalg.eigvalsh(out)[0] > 0
    keep = ~mask
    assert np.array_equal(out[np.ix_(keep, keep)], M[np.ix_(keep, keep)])
    assert np.count_nonzero(out[mask]) == mask.sum()  # only their diagonal entries
    assert np.allclose(np.diag(out)[mask], np.median(np.diag(M)[keep]))
    assert decoupled_inverse(M, np.zeros(M_TASKS, dtype=bool)) is M


def test_the_others_models_are_those_without_the_decoupled_tasks_dual_images():
    """W_H = B_H M_HH: what the coupled tasks would have with the decoupled b_s = 0."""
    rng = np.random.default_rng(1)
    state = MOCHAServerState(B=rng.normal(size=(3, M_TASKS)), formulation=formulation("mean"))
    mask = np.zeros(M_TASKS, dtype=bool)
    mask[2] = True
    lost = state.B.copy()
    lost[:, 2] = 0.0
    expected = (lost @ state.M)[:, ~mask]
    state.decouple(mask)
    assert np.allclose(state.W[:, ~mask], expected)
    state.add_updates(np.array([2]), 1e6 * np.ones((3, 1)))  # the decoupled task's pull
    assert np.allclose(state.W[:, ~mask], expected)


def test_omega_step_learns_nothing_from_a_decoupled_model():
    rng = np.random.default_rng(2)
    B = rng.normal(size=(4, M_TASKS))
    mask = np.zeros(M_TASKS, dtype=bool)
    mask[0] = True
    results = []
    for scale in (1.0, 1e6):
        state = MOCHAServerState(B=B.copy(), formulation=formulation("probabilistic"))
        state.B[:, 0] *= scale
        state.decouple(mask)
        state.omega_step()
        results.append(state.M[np.ix_(~mask, ~mask)])
    assert np.allclose(results[0], results[1])
    assert np.array_equal(coupled_models(B, None), B)
    assert not coupled_models(B, mask)[:, 0].any()


def test_outlying_flags_the_upper_side_only():
    values = np.array([0.1, 0.12, 0.09, 0.11, 5.0, 1e-6, 0.0])
    assert outlying(values).tolist() == [False, False, False, False, True, False, False]
    assert outlying(np.array([1.0, 100.0])).tolist() == [False, False]  # no majority
    assert outlying(np.array([1.0, 1.0, 1.0, np.nan])).tolist() == [False] * 3 + [True]


def watch_round(watch: OutlierWatch, step: np.ndarray, image: np.ndarray,
                scale: np.ndarray | None = None) -> list[bool]:
    scale = np.ones(len(step)) if scale is None else scale
    return watch.update(step, scale, image, scale, np.ones(len(step), dtype=bool)).tolist()


def test_a_step_outlier_needs_the_floor_and_is_decoupled_at_once():
    step = np.array([0.01, 0.012, 0.011, 0.009, 0.4])  # 40x the median, under the floor
    watch = OutlierWatch(5)
    assert not any(watch_round(watch, step, np.zeros(5)))
    step[-1] = STEP_SHARE_FLOOR
    assert watch_round(watch, step, np.zeros(5)) == [False] * 4 + [True]
    assert watch_round(watch, np.zeros(5), np.zeros(5)) == [False] * 5  # newly: none
    assert watch.decoupled.tolist() == [False] * 4 + [True]  # sticky


def test_an_image_outlier_must_persist_and_cannot_hide_behind_a_claimed_scale():
    R = np.array([1.0, 1.1, 0.9, 1.0, 10.0])  # the last claims a 10x scale
    scale = federation_scale(R)
    image = np.array([0.1, 0.1, 0.12, 0.09, 0.9])  # 9x the others, 0.09 of its own R
    watch = OutlierWatch(5)
    for _ in range(IMAGE_PERSISTENCE - 1):
        assert not any(watch_round(watch, np.zeros(5), image, scale))
    assert watch_round(watch, np.zeros(5), image, scale) == [False] * 4 + [True]
    # a late joiner's large first image, retreating every round it works, or back among
    # the others in between: never
    for path in ((0.9, 0.8, 0.7, 0.6, 0.55), (0.9, 0.9, 0.15, 0.9, 0.9)):
        watch = OutlierWatch(5)
        for late in path:
            image[-1] = late
            assert not any(watch_round(watch, np.zeros(5), image, scale))


def test_block_diagonal_regulariser_and_projection():
    K = formulation("mean").regulariser_matrix()
    mask = np.zeros(M_TASKS, dtype=bool)
    mask[3] = True
    Kp = block_diagonal_regulariser(K, mask)
    M = decoupled_inverse(np.linalg.inv(K), mask)
    assert np.allclose(Kp @ M, np.eye(M_TASKS))
    assert block_diagonal_regulariser(K, np.zeros(M_TASKS, dtype=bool)) is K
    W = np.ones((2, M_TASKS))
    W[:, 3] = 1e8
    out = project_blocks(W, Kp, mask)
    assert np.array_equal(out[:, ~mask], W[:, ~mask])  # the others untouched
    assert np.isclose(np.linalg.norm(out[:, 3]), np.sqrt(1.0 / Kp[3, 3]))


def opposed(sizes: np.ndarray, against: list[int]) -> np.ndarray:
    """Images (2, m) along e_1 of the given sizes, the tasks ``against`` pointing the other way
    (their sizes typical: no size fence flags them)."""
    images = np.zeros((2, len(sizes)))
    images[0] = sizes
    images[0, against] *= -1.0
    return images


def test_the_consensus_fence_holds_with_two_colluders_of_ten():
    """2 of 10 tasks at a typical size but against the others' direction lie beyond the
    consensus fence; honest tasks of spread sizes along it do not; the colluders cannot move
    the center out of the honest tasks' range nor the fence beyond what the honest tasks'
    deviations make plausible, wherever they go."""
    sizes = np.array([0.5, 0.7, 0.6, 0.55, 0.9, 0.4, 0.65, 0.6, 0.75, 0.5])
    scale = np.ones(10)
    none = np.zeros(10, dtype=bool)
    center, fence, deviation = consensus_fence(opposed(sizes, [3, 7]), scale, none)
    assert np.flatnonzero(deviation > fence).tolist() == [3, 7]
    honest = np.delete(np.arange(10), [3, 7])
    fences = set()
    for far in (1.0, 1e3, 1e9):  # anywhere: the fence and center stay honest-made
        images = opposed(sizes, [3, 7])
        images[:, [3, 7]] *= far
        center, fence, _ = consensus_fence(images, scale, none)
        assert sizes[honest].min() <= center[0] <= sizes[honest].max() and center[1] == 0
        fences.add(fence)
    assert len(fences) == 1 and fences.pop() < 2 * np.median(sizes[honest])
    _, fence, _ = consensus_fence(opposed(sizes[:CONSENSUS_MIN_TASKS - 1], [0]),
                                  scale[:CONSENSUS_MIN_TASKS - 1], none[:4])
    assert fence == np.inf  # too few tasks to judge by


def test_a_task_away_from_the_consensus_must_persist_to_be_decoupled():
    sizes = np.array([0.5, 0.7, 0.6, 0.55, 0.9, 0.4, 0.65, 0.6, 0.75, 0.5])
    scale, ones = np.ones(10), np.ones(10, dtype=bool)
    images = opposed(sizes, [3, 7])
    watch = OutlierWatch(10)

    def step() -> list[bool]:
        return watch.update(np.zeros(10), scale, np.linalg.norm(images, axis=0), scale, ones,
                            images=images).tolist()
    for _ in range(IMAGE_PERSISTENCE - 1):
        assert not any(step())
    assert np.flatnonzero(step()).tolist() == [3, 7]
    # without the images (the size fence alone) they are never decoupled
    watch = OutlierWatch(10)
    for _ in range(2 * IMAGE_PERSISTENCE):
        assert not watch.update(np.zeros(10), scale, np.linalg.norm(images, axis=0), scale,
                                ones).any()


def test_coupling_weights_are_the_off_diagonal_column_sums():
    M = np.array([[2.0, -0.5, 0.1], [-0.5, 1.0, 0.0], [0.1, 0.0, 3.0]])
    assert np.allclose(coupling_weights(M), [0.6, 0.5, 0.1])
    mask = np.array([False, True, False])
    assert coupling_weights(decoupled_inverse(M, mask))[1] == 0.0  # a decoupled task pulls 0


def test_a_task_pulling_the_others_through_its_coupling_must_persist_to_be_decoupled():
    """A task of typical size (no size or consensus outlier) whose coupling to the others is
    strong, so that its pull (normalised |b_s| times sum_t |M_ts|) is PULL_FENCE_FACTOR times
    the federation's median or more, three rounds running, is decoupled; an honest hub
    coupled twice as strongly as the others, or the same pull retreating, are not."""
    rng = np.random.default_rng(0)
    images = 0.5 + 0.05 * rng.standard_normal((4, 10))  # alike: no image nor consensus outlier
    scale, ones = np.ones(10), np.ones(10, dtype=bool)
    size = np.linalg.norm(images, axis=0)
    coupling = np.full(10, 0.1)

    def step(watch: OutlierWatch) -> list[int]:
        return np.flatnonzero(watch.update(np.zeros(10), scale, size, scale, ones,
                                           images=images, coupling=coupling)).tolist()
    coupling[4] = 0.2  # an honest hub: twice the others (under the coupling fence too)
    coupling[[3, 7]] = 1.2 * PULL_FENCE_FACTOR * 0.1
    watch = OutlierWatch(10)
    for _ in range(IMAGE_PERSISTENCE - 1):
        assert step(watch) == []
    assert step(watch) == [3, 7]
    assert watch.update(np.zeros(10), scale, size, scale, ones, images=images).sum() == 0
    watch = OutlierWatch(10)  # beyond the fence but retreating by 10 % a round: never
    coupling[[3, 7]] = 3.0 * PULL_FENCE_FACTOR * 0.1
    for _ in range(2 * IMAGE_PERSISTENCE):  # 3 x 0.9^6 > 1.5 times the fence at the end
        coupling[[3, 7]] *= 0.9
        assert step(watch) == []


def test_the_coupling_fence_is_a_factor_of_the_median_widened_by_a_wide_spread():
    """COUPLING_FENCE_FACTOR times the reference tasks' median coupling weight (those with an
    image and not decoupled), more where their logarithms spread (5 scaled MADs); ``inf``
    when fewer than 3 tasks are references or most are uncoupled (a sparse learned Omega)."""
    alike = np.array([1.0, 1.1, 0.9, 1.0, 1.05, 0.95, 1.0, 1.0, 7.0, 7.0])
    imaged, none = np.ones(10, dtype=bool), np.zeros(10, dtype=bool)
    assert coupling_fence(alike, imaged, none) == pytest.approx(COUPLING_FENCE_FACTOR)
    excluded = none.copy()
    excluded[:4] = True  # the decoupled are no reference: the median is that of the rest
    assert coupling_fence(alike, imaged, excluded) == pytest.approx(
        COUPLING_FENCE_FACTOR * np.exp(np.median(np.log(alike[4:]))))  # the log scale's
    spread = np.exp(np.random.default_rng(0).normal(scale=0.6, size=10))
    assert coupling_fence(spread, imaged, none) > 3.3 * np.median(spread)
    sparse = np.zeros(10)
    sparse[[2, 5, 8]] = [0.1, 0.3, 0.2]
    assert coupling_fence(sparse, imaged, none) == np.inf
    few = imaged.copy()
    few[2:] = False
    assert coupling_fence(alike, few, none) == np.inf


def test_a_task_coupled_to_the_others_far_more_strongly_must_persist_to_be_decoupled():
    """Two tasks of typical image (their pull under PULL_FENCE_FACTOR times the median) whose
    coupling weights are 3 times the others' (what a learned Omega gave two colluders with
    identical, never-shrinking b_t) are decoupled after IMAGE_PERSISTENCE rounds; 2.4 times,
    or 3 times but retreating, is not. A task with no image is judged too (no reference for
    the median, but it cannot reset its streak by emptying its b_t for a round)."""
    rng = np.random.default_rng(0)
    images = 0.5 + 0.05 * rng.standard_normal((4, 10))
    scale, ones = np.ones(10), np.ones(10, dtype=bool)
    size = np.linalg.norm(images, axis=0)
    coupling = np.full(10, 0.1)

    def step(watch: OutlierWatch) -> list[int]:
        return np.flatnonzero(watch.update(np.zeros(10), scale, size, scale, ones,
                                           images=images, coupling=coupling)).tolist()
    coupling[[3, 7]] = 0.24
    watch = OutlierWatch(10)
    for _ in range(2 * IMAGE_PERSISTENCE):
        assert step(watch) == []
    coupling[[3, 7]] = 0.3
    for _ in range(IMAGE_PERSISTENCE - 1):
        assert step(watch) == []
    assert step(watch) == [3, 7]
    assert watch.pulling.max() == 0  # the pull fence alone would not have
    watch = OutlierWatch(10)
    for _ in range(2 * IMAGE_PERSISTENCE):
        coupling[[3, 7]] *= 0.9  # retreating by 10 % a round: never
        assert step(watch) == []
    watch, coupling[[3, 7]] = OutlierWatch(10), 0.3
    images[:, 3] = 0.0
    size = np.linalg.norm(images, axis=0)
    for _ in range(IMAGE_PERSISTENCE - 1):
        assert step(watch) == []
    assert step(watch) == [3, 7]


def test_the_watch_state_keeps_the_coupling_streaks():
    """A checkpoint holds the coupling fence's streaks and last values; one written before
    them restores with fresh (zero) streaks."""
    watch = OutlierWatch(4)
    watch.bonding[:] = [0, 2, 0, 1]
    watch.bond[:] = [0.1, 0.5, 0.1, 0.3]
    arrays = watch.state_arrays()
    fresh = OutlierWatch(4)
    fresh.restore(arrays)
    assert fresh.bonding.tolist() == [0, 2, 0, 1] and fresh.bond.tolist() == [0.1, 0.5, 0.1, 0.3]
    old = OutlierWatch(4)
    old.restore({k: v for k, v in arrays.items() if "bond" not in k})
    assert not old.bonding.any() and not old.bond.any()


def random_factor(m: int, r: int, rng: np.random.Generator, negative: bool) -> FactoredMatrix:
    V = np.linalg.qr(rng.normal(size=(m, r)))[0] if r else np.zeros((m, 0))
    s = rng.uniform(0.01, 2.0, size=r)
    if negative:
        s[: r // 2] *= -0.1
    return FactoredMatrix(V, s, rng.uniform(0.5, 1.0))


@pytest.mark.parametrize("which", [[2], [0, 5], "all"])
@pytest.mark.parametrize("m, r, negative", [(7, 0, False), (7, 3, False), (7, 7, False),
                                            (40, 5, False), (40, 5, True)])
def test_the_factored_decoupled_inverse_is_the_dense_one(m, r, negative, which):
    """M' in factored form (the factored server path) is the dense path's M' to rounding:
    same c, orthonormal columns (one more per decoupled task), no decoupled coupling, and
    the same coupling weights; s stays >= 0 where it was."""
    M = random_factor(m, r, np.random.default_rng(m + r), negative)
    mask = np.ones(m, dtype=bool) if which == "all" else np.isin(np.arange(m), which)
    F = decoupled_factor(M, mask)
    F.check()
    assert F.c == M.c and F.rank <= m
    expected = decoupled_inverse(M.dense(), mask)
    np.testing.assert_allclose(F.dense(), expected, rtol=0, atol=1e-12)
    np.testing.assert_allclose(coupling_weights(F), coupling_weights(expected), rtol=0,
                               atol=1e-12)
    assert np.all(coupling_weights(F)[mask] <= 1e-12)
    if not negative:
        assert np.all(F.s >= 0)
    assert decoupled_factor(M, np.zeros(m, dtype=bool)) is M


def test_a_task_the_federation_catches_up_with_is_not_decoupled():
    """Early in a run (the benchmark's digits split, seed 0, logistic loss) one honest task's
    image is 4 times the others' after round 1 and holds still while theirs grow toward it:
    beyond the consensus fence in rounds 1 to 3 by a shrinking multiple of it (2.0, 1.4,
    1.1), it used to be decoupled in round 3. A round in which it holds still and the fence
    closes in on it by :data:`IMAGE_RETREAT` no longer counts. A task that holds still while
    the others hold still too, or that keeps moving away as they grow, is still decoupled in
    :data:`IMAGE_PERSISTENCE` rounds."""
    scale, ones = np.ones(10), np.ones(10, dtype=bool)

    def run(ahead: list[float], growth: float) -> list[int]:
        """Task 4 at ``ahead[r]`` along e_2 in round r, the others along +-e_1 and +-e_3
        (the consensus stays at 0) growing by the factor ``growth`` a round; the round each
        task is decoupled in (0: never)."""
        watch = OutlierWatch(10)
        sizes = np.array([0.48, 0.45, 0.46, 0.48, 0.0, 0.56, 0.43, 0.40, 0.37, 0.34])
        axes = np.array([0, 0, 0, 0, 1, 0, 2, 2, 2, 2])
        signs = np.array([1, -1, 1, -1, 1, 1, 1, -1, 1, -1])
        rounds = np.zeros(10, dtype=int)
        for r, size in enumerate(ahead, start=1):
            images = np.zeros((3, 10))
            images[axes, np.arange(10)] = signs * sizes * growth ** (r - 1)
            images[1, 4] = size
            new = watch.update(np.zeros(10), scale, np.linalg.norm(images, axis=0), scale,
                               ones, images=images)
            rounds[new] = r
        return rounds.tolist()

    held = [4.0] * 6
    assert run(held, 1.45) == [0] * 10  # they catch up: forgiven, then within the fence
    assert run(held, 1.0) == [0] * 4 + [IMAGE_PERSISTENCE] + [0] * 5  # nobody moves
    moving_away = [4.0 * 1.5 ** r for r in range(6)]  # grows as fast as the fence
    assert run(moving_away, 1.45) == [0] * 4 + [IMAGE_PERSISTENCE] + [0] * 5
