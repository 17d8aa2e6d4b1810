"""Client-level DP for ``fsvrg`` (its feature statistics released once, privately, then the
gradient and the A-scaled model each round) and ``cocoa-plus`` (``client-clip``: each
device scales its dual step to the clip, the server adds noise to the sum of ``d_w``):
equality with the run without DP when nothing is clipped or noised, the noise's
calibration, clipping that binds and that does not, the account (the setup release
included) against the closed form, resume, the certificate of a well-defined pair, and
hostile replies."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from flwr.app import ArrayRecord, Context, Message
from flwr.serverapp import Grid, ServerApp

from fmtl_flower.clients.fsvrg import make_fsvrg_client_app
from fmtl_flower.clients.mocha import default_task_id
from fmtl_flower.core.fsvrg import (
    FeatureCountAccumulator,
    cocoa_plus_local_sdca,
    dual_objective,
    logistic_dual_sum,
    logistic_objective,
    primal_from_dual,
)
from fmtl_flower.data.sparse_federated import SparseFederatedDataset, make_sparse_federated
from fmtl_flower.engine import InProcessGrid, run_inprocess
from fmtl_flower.settings import ConfigError, DPSettings
from fmtl_flower.strategies.fsvrg import FSVRG
from fmtl_flower.strategies.privacy import FSVRGDP, enable_client_dp
from fmtl_flower.wire import from_array, to_array

from ..core.test_privacy import closed_form_rdp_epsilon
from .hostile import HostileGrid
from .test_fsvrg_strategy import committed_alphas, optimum

pytest.importorskip("dp_accounting")

K = 20
DELTA = 1e-5


@pytest.fixture(scope="module")
def data() -> SparseFederatedDataset:
    return make_sparse_federated(num_tasks=K, dim=500, seed=0)


def federate(data: SparseFederatedDataset, strategy: FSVRG, rounds: int,
             grid_cls: type = InProcessGrid, tamper: Any = None) -> tuple[FSVRG, Any]:
    app = make_fsvrg_client_app(lambda ctx: data.task(default_task_id(ctx)).arrays())
    if grid_cls is InProcessGrid:
        server = ServerApp()

        @server.main()
        def main(grid: Grid, context: Context) -> None:
            strategy.start(grid=grid, num_rounds=rounds, timeout=60.0)

        return strategy, run_inprocess(server, app, data.num_tasks)
    grid = grid_cls(app, data.num_tasks)
    grid.tamper = tamper
    strategy.start(grid=grid, num_rounds=rounds, timeout=60.0)
    return strategy, grid


def fsvrg(method: str, **kwargs: Any) -> FSVRG:
    return FSVRG(K, method=method, discovery_timeout=5.0, **{"robust": False, **kwargs})


def private(method: str, noise_seed: int | None = None, **dp: Any) -> FSVRG:
    mechanism = "client-clip" if method == "cocoa-plus" else "central"
    return enable_client_dp(fsvrg(method), noise_seed=noise_seed,
                            **{"mechanism": mechanism, **dp})


# ------------------------------------------------------------------ equality without noise
@pytest.mark.parametrize(("method", "dp"), [
    ("fsvrg", {"weighting": "rows", "stats_clip": 1e9}),
    ("cocoa-plus", {}),
])
def test_no_noise_and_a_clip_that_never_binds_equals_the_run_without_dp(data, method, dp):
    """z = 0 and clips no device reaches: fsvrg (its statistics, every round's gradient and
    A-scaled model) and cocoa-plus (device-side scaling, server clip, the sum) give every
    round's w, objective and gap bit for bit as without DP."""
    plain = federate(data, fsvrg(method), 3)[0]
    dp_run = federate(data, private(method, clip=1e9, noise_multiplier=0.0, **dp), 3)[0]
    np.testing.assert_array_equal(dp_run.w, plain.w)
    for a, b in zip(plain.results()["rounds"], dp_run.results()["rounds"], strict=True):
        assert b["objective"] == a["objective"] and b.get("gap") == a.get("gap")
    final = dp_run.results()["final"]
    assert final["dp_clipped"] == 0 and final["epsilon"] == float("inf")
    if method == "fsvrg":
        np.testing.assert_array_equal(dp_run.stats.phi, plain.stats.phi)
        np.testing.assert_array_equal(dp_run.stats.a, plain.stats.a)


# ------------------------------------------------------------------ fsvrg's statistics
def stats_problem(dim: int = 50_000) -> tuple[list[np.ndarray], list[int], np.ndarray]:
    """40 devices of 2 rows: 0-19 have every feature in one row (phi_k = 0.5), 20-39 none:
    omega = 20 (K / 2), phi = 0.25 either weighting; |[p_k; phi_k]| = sqrt(1.25 d) = 250."""
    counts = [np.ones(dim, dtype=np.int64) if k < 20 else np.zeros(dim, dtype=np.int64)
              for k in range(40)]
    n = [2] * 40
    return counts, n, np.array(n)


@pytest.mark.parametrize("weighting", ["uniform", "rows"])
def test_the_statistics_noise_has_the_calibrated_variance(weighting):
    """omega's noise has std z C_s, phi's z C_s w_max / w_k... in phi units: z C_s / K
    (uniform) or z C_s n_max / n (rows); both 0.025 here, far inside the clamps (omega 20
    +- 1 in [1, 40], phi 0.25 +- 0.025 in [0, 1]): 50 000 coordinates, relative standard
    error 0.6 %."""
    z, stats_clip = 0.002, 500.0  # the clip does not bind (250 < 500)
    counts, n, n_all = stats_problem()
    dp = FSVRGDP(DPSettings(mechanism="central", clip=1.0, noise_multiplier=z,
                            weighting=weighting, stats_clip=stats_clip), noise_seed=7)
    stats = dp.feature_stats(counts, n, n_all, [], 10)
    assert np.var(stats.omega - 20.0) == pytest.approx((z * stats_clip) ** 2, rel=0.03)
    phi_std = z * stats_clip / 40 if weighting == "uniform" else z * stats_clip * 2 / 80
    assert np.var(stats.phi - 0.25) == pytest.approx(phi_std ** 2, rel=0.03)
    assert abs(np.mean(stats.omega - 20.0)) < 5 * z * stats_clip / np.sqrt(len(counts[0]))
    fields = dp.record_fields([])
    assert fields["dp_releases"] == 1 and fields["dp_clip_stats"] == stats_clip
    assert fields["dp_noise_std_stats"] == z * stats_clip


def test_the_statistics_clip_binds_and_does_not():
    """A device whose [p_k; phi_k] exceeds the clip counts s = C_s / norm in omega and phi
    (z = 0); one within it counts fully."""
    dim = 4
    counts = [np.array([3, 0, 0, 0]), np.array([1, 2, 2, 2])]  # norms sqrt(1 + 0.5625) and
    n = [4, 2]                                                  # sqrt(4 + 0.25 + 3)
    dp = FSVRGDP(DPSettings(mechanism="central", clip=1.0, noise_multiplier=0.0,
                            stats_clip=2.0))
    stats = dp.feature_stats(counts, n, np.array(n), [], 10)
    s = 2.0 / np.sqrt(4 + 0.25 + 3 * 1.0)  # device 1: phi_1 = [0.5, 1, 1, 1]
    np.testing.assert_allclose(stats.omega, [1 + s, s, s, s], rtol=1e-14)
    np.testing.assert_allclose(stats.phi, (np.array([0.75, 0, 0, 0])
                                           + s * np.array([0.5, 1, 1, 1])) / 2, rtol=1e-14)
    assert dp.record_fields([])["dp_clipped"] == 1
    assert dim == len(stats.omega)


def test_noisy_statistics_are_clamped_to_valid_ranges():
    """Post-processing: phi in [0, 1], omega in [max(1, z C_s), K], so A = K / omega is at
    most K / max(1, z C_s)."""
    counts, n, n_all = stats_problem(dim=20_000)
    dp = FSVRGDP(DPSettings(mechanism="central", clip=1.0, noise_multiplier=0.05,
                            stats_clip=500.0), noise_seed=3)  # noise std 25 on omega = 20
    stats = dp.feature_stats(counts, n, n_all, [], 10)
    assert stats.omega.min() == 25.0 and stats.omega.max() == 40.0
    assert stats.phi.min() == 0.0 and stats.phi.max() <= 1.0
    assert stats.a.max() == pytest.approx(40 / 25)


# ------------------------------------------------------------------ fsvrg's model release
@pytest.mark.parametrize("weighting", ["uniform", "rows"])
def test_the_model_release_has_the_calibrated_variance(weighting):
    z, clip, n_all = 1.3, 0.7, np.array([50, 100, 150, 200, 500])
    dp = FSVRGDP(DPSettings(mechanism="central", clip=clip, noise_multiplier=z,
                            weighting=weighting), noise_seed=11)
    w = np.zeros(200_000)
    noise = dp.mean_update(w, [w] * 4, list(n_all[:4]), n_all, [], 10)  # one silent
    expected = z * clip / 5 if weighting == "uniform" else z * clip * 500 / 1000
    assert np.var(noise) == pytest.approx(expected ** 2, rel=0.02)


def test_the_model_release_clips_what_binds_and_weights_by_a_fixed_denominator():
    dp = FSVRGDP(DPSettings(mechanism="central", clip=1.0, noise_multiplier=0.0,
                            weighting="rows"))
    w = np.array([1.0, 1.0])
    models = [w + np.array([0.0, 4.0]), w + np.array([0.3, 0.0])]  # |update| 4 (bound), 0.3
    out = dp.mean_update(w, models, [10, 20], np.array([10, 20, 70]), [], 10)
    np.testing.assert_allclose(out, (10 * np.array([0.0, 1.0]) + 20 * np.array([0.3, 0.0]))
                               / 100, rtol=1e-15)
    assert dp.record_fields([])["dp_clipped"] == 1


# ------------------------------------------------------------------ cocoa-plus
def test_a_devices_scaled_dual_step_stays_feasible_and_its_image(data):
    """clip_dual_step: |s d_w| = C when it binds, y (alpha + s d_alpha) in [0, 1], and
    s d_w = X^T (s d_alpha) / (lam n) (the device's share stays w(alpha)'s); unchanged
    when it does not bind."""
    from fmtl_flower.core.fsvrg import clip_dual_step

    task = data.task(0)
    X, y = task.X_train, task.y_train
    n, lam = int(data.n_train.sum()), 1e-3
    alpha = np.zeros(X.shape[0])
    d_alpha, d_w = cocoa_plus_local_sdca(X, y, alpha, np.zeros(X.shape[1]), lam=lam, n=n,
                                         sigma_prime=float(K),
                                         order=np.arange(X.shape[0]))
    clip = 0.25 * float(np.linalg.norm(d_w))
    a2, w2, scale = clip_dual_step(d_alpha, d_w, clip)
    assert scale == pytest.approx(0.25) and np.linalg.norm(w2) == pytest.approx(clip)
    yalpha = y * (alpha + a2)
    assert yalpha.min() >= 0.0 and yalpha.max() <= 1.0
    np.testing.assert_allclose(w2, primal_from_dual(X, a2, lam, n), rtol=0, atol=1e-15)
    a3, w3, scale = clip_dual_step(d_alpha, d_w, 2 * float(np.linalg.norm(d_w)))
    assert scale == 1.0 and a3 is d_alpha and w3 is d_w
    with pytest.raises(ValueError, match="dp-clip"):
        clip_dual_step(d_alpha, d_w, float("nan"))


def test_the_dual_step_sum_is_clipped_and_calibrated():
    """The server clips again (a reply the device did not scale is scaled) and adds
    N(0, (z C)^2) to the sum."""
    z, clip = 0.9, 0.4
    dp = FSVRGDP(DPSettings(mechanism="client-clip", clip=clip, noise_multiplier=z),
                 noise_seed=13)
    zero = np.zeros(200_000)
    _, noise = dp.dual_step_sum([zero] * 3, K, [], 10)
    assert np.var(noise) == pytest.approx((z * clip) ** 2, rel=0.02)
    dp = FSVRGDP(DPSettings(mechanism="client-clip", clip=clip, noise_multiplier=0.0))
    honest, hostile = np.array([0.0, 0.4]), np.array([3.0, 4.0])
    clipped, total = dp.dual_step_sum([honest, hostile], K, [], 10)
    assert clipped[0] is honest
    np.testing.assert_allclose(clipped[1], [0.24, 0.32], rtol=1e-15)
    np.testing.assert_allclose(total, [0.24, 0.72], rtol=1e-15)


def test_private_cocoa_plus_keeps_w_of_alpha_and_a_certified_gap(data):
    """client-clip with a clip that binds and noise: the devices' committed alphas stay
    feasible and the server's ledger holds their image X_k^T alpha_k / (lam n); the
    broadcast w is w(alpha) plus the noise (so not w(alpha)); the reported dual is
    D(alpha) (recomputed here from the devices' alphas) and the gap P(w) - D(alpha) bounds
    the released model's suboptimality P(w) - P* (P* by scikit-learn)."""
    z, clip = 0.5, 0.05
    strategy, grid = federate(data, private("cocoa-plus", noise_seed=21, clip=clip,
                                            noise_multiplier=z), 4)
    n, lam = int(data.n_train.sum()), strategy.lam
    alphas = committed_alphas(strategy, grid)
    shares = []
    for k, alpha in enumerate(alphas):
        task = data.task(k)
        yalpha = task.y_train * alpha
        assert yalpha.min() >= 0.0 and yalpha.max() <= 1.0 + 1e-12
        shares.append(primal_from_dual(task.X_train, alpha, lam, n))
        np.testing.assert_allclose(strategy.ledger.share(k), shares[-1], rtol=0, atol=1e-12)
    w_alpha = np.sum(shares, axis=0)
    noise = strategy.w - w_alpha
    assert np.linalg.norm(noise) > 0.5 * z * clip * np.sqrt(4 * len(noise))  # 4 releases
    final = strategy.results()["final"]
    dual_sum = sum(logistic_dual_sum(data.task(k).y_train, a) for k, a in enumerate(alphas))
    assert final["dual"] == pytest.approx(dual_objective(w_alpha, dual_sum, n, lam),
                                          rel=1e-12)
    X, y = data.pooled_train()
    assert final["objective"] == pytest.approx(logistic_objective(X, y, strategy.w, lam),
                                               rel=1e-12)
    assert final["gap"] >= final["objective"] - optimum(data, lam) >= 0
    assert final["gap_certified"] and final["dp_clipped"] > 0
    rounds = strategy.results()["rounds"]
    assert [r["dp_releases"] for r in rounds] == [0, 1, 1, 1, 1]
    assert all(r["dp_clip_d_w"] == clip for r in rounds[1:])


# ------------------------------------------------------------------ the account and resume
def test_fsvrgs_setup_release_and_two_a_round_are_accounted(data):
    """Record 0 holds the statistics' release, each round a gradient and a model: epsilon
    of record r is that of 2 r + 1 Gaussian releases (the closed form of the Gaussian
    mechanism's RDP, tests/core/test_privacy.py)."""
    z = 3.0
    strategy = federate(data, private("fsvrg", clip=0.5, noise_multiplier=z), 3)[0]
    rounds = strategy.results()["rounds"]
    assert [r["dp_releases"] for r in rounds] == [1, 2, 2, 2]
    assert rounds[0]["dp_noise_std_stats"] == z * 20.0  # the default stats clip
    for r, record in enumerate(rounds):
        assert record["epsilon"] == pytest.approx(
            closed_form_rdp_epsilon(z, 2 * r + 1, DELTA, improved=True), rel=1e-9)


def test_a_target_epsilon_covers_the_setup_release(data):
    strategy = federate(data, private("fsvrg", clip=0.5, epsilon=4.0), 2)[0]
    final = strategy.results()["final"]
    assert 3.99 < final["epsilon"] <= 4.0  # 5 releases: 2 R + 1
    z = final["dp_noise_multiplier"]
    assert closed_form_rdp_epsilon(z, 5, DELTA, improved=True) == pytest.approx(
        final["epsilon"], rel=1e-9)


def test_a_resumed_fsvrg_run_keeps_its_private_statistics_and_its_account(data, tmp_path):
    """Killed in round 3, resumed from round 2's checkpoint: the noisy statistics come back
    as released (floats, not re-released nor truncated to integers), 2 releases are charged
    for the round the checkpoint does not hold: 1 + 2 + 2 + (2 + 2) + 2 = 11 at round 4."""
    from tests.strategies.helpers import ServerKilled, killed_in

    z = 2.5
    first = enable_client_dp(killed_in(FSVRG, 3)(K, method="fsvrg", robust=False,
                                                 discovery_timeout=5.0),
                             mechanism="central", clip=0.5, noise_multiplier=z)
    first.enable_checkpoints(tmp_path)
    with pytest.raises(ServerKilled):
        federate(data, first, 4)
    resumed = private("fsvrg", clip=0.5, noise_multiplier=z)
    resumed.enable_checkpoints(tmp_path)
    federate(data, resumed, 4)
    assert resumed.resumed_from == 2
    np.testing.assert_array_equal(resumed.stats.phi, first.stats.phi)
    np.testing.assert_array_equal(resumed.stats.a, first.stats.a)
    assert resumed.stats.omega.dtype == np.float64
    rounds = resumed.results()["rounds"]
    assert [r["dp_releases"] for r in rounds] == [1, 2, 2, 4, 2]
    assert rounds[3]["dp_charged_on_resume"] == 2
    assert rounds[-1]["epsilon"] == pytest.approx(
        closed_form_rdp_epsilon(z, 11, DELTA, improved=True), rel=1e-9)


# ------------------------------------------------------------------ hostile replies
HOSTILE = 3


def _tamper(edit_stats: bool):
    def tamper(message: Message, reply: Message | None) -> list[Message]:
        if reply is None or reply.has_error() or "metrics" not in reply.content:
            return [] if reply is None else [reply]
        if reply.content["metrics"]["task-id"] != HOSTILE:
            return [reply]
        kind = message.metadata.message_type
        if edit_stats and kind == "query.fsvrg_stats":  # counts far above n-train
            counts = from_array(reply.content["arrays"]["counts"]) + 10 ** 6
            reply.content["arrays"] = ArrayRecord({"counts": to_array(counts)})
        if not edit_stats and kind == "train":  # d-w not scaled, 10x the clip, NaN next
            d_w = from_array(reply.content["arrays"]["d-w"])
            bad = d_w * (10 * 0.01 / np.linalg.norm(d_w)) if message.content["config"][
                "server-round"] == 1 else np.full_like(d_w, np.nan)
            reply.content["arrays"] = ArrayRecord({"d-w": to_array(bad)})
        return [reply]
    return tamper


def test_a_hostile_stats_reply_is_rejected_and_counts_as_silent(data):
    """fsvrg under DP: counts above n-train fail the reply's own check (trust boundary);
    the statistics are the others' with the fixed denominators (K devices, the
    federation's n), exactly (z = 0, rows, no clip binds)."""
    strategy, _ = federate(data, private("fsvrg", clip=1e9, noise_multiplier=0.0,
                                         weighting="rows", stats_clip=1e9), 2,
                           grid_cls=HostileGrid, tamper=_tamper(edit_stats=True))
    acc = FeatureCountAccumulator(strategy.dim)
    for k in range(K):
        if k != HOSTILE:
            acc.add(int(data.n_train[k]), _counts(data, k))
    honest = acc.result()
    np.testing.assert_array_equal(strategy.stats.omega, honest.omega.astype(float))
    np.testing.assert_array_equal(strategy.stats.phi,
                                  honest.n_j / float(data.n_train.sum()))
    assert strategy.stats.num_nodes == K and np.all(np.isfinite(strategy.w))
    assert strategy.results()["final"]["dp_releases"] == 2


def _counts(data: SparseFederatedDataset, k: int) -> np.ndarray:
    from fmtl_flower.core.fsvrg import node_feature_counts

    return node_feature_counts(data.task(k).X_train)[1]


def test_a_hostile_cocoa_reply_is_clipped_by_the_server_or_rejected(data):
    """cocoa-plus under DP: a d-w the device did not scale (10 x the clip) is clipped to
    the clip by the server, and its ledger share is the clipped one; a NaN d-w is rejected
    at the trust boundary (the device rolls back). w stays finite."""
    clip = 0.01
    strategy, _ = federate(data, private("cocoa-plus", clip=clip, noise_multiplier=0.0), 2,
                           grid_cls=HostileGrid, tamper=_tamper(edit_stats=False))
    share = strategy.ledger.share(HOSTILE)
    assert np.linalg.norm(share) == pytest.approx(clip, rel=1e-12)
    assert strategy.ledger.last_accepted[HOSTILE] == 1  # round 2's NaN reply rejected
    assert np.all(np.isfinite(strategy.w))
    rounds = strategy.results()["rounds"]
    assert rounds[1]["num_replies"] == K and rounds[2]["num_replies"] == K - 1


@pytest.mark.parametrize(("method", "mechanism"), [("fsvrg", "central"),
                                                   ("cocoa-plus", "client-clip")])
def test_the_run_config_reaches_fsvrg_and_cocoa_plus_packed_or_not(method, mechanism):
    """`fmtl run` / `flwr run`: the dp.* keys reach fsvrg and cocoa-plus; packed nodes (two
    tasks a node, one message for both: cocoa-plus's devices read dp-clip from the shared
    config) give the unpacked run's numbers bit for bit (z = 0, a clip that binds)."""
    from fmtl_flower.apps.common import make_client_app, make_server_app
    from fmtl_flower.config import RunConfig

    finals = []
    for per_node in (1, 2):
        cfg = RunConfig.from_mapping({
            "strategy": method, "dataset": "sparse-federated", "num-tasks": 10,
            "num-server-rounds": 2, "tasks-per-node": per_node, "dp.mechanism": mechanism,
            "dp.clip": 0.01, "dp.noise-multiplier": 0.0})
        box: dict = {}
        run_inprocess(make_server_app(cfg, on_done=box.update), make_client_app(cfg),
                      10 // per_node)
        finals.append(box["final"])
    assert finals[0]["dp_clipped"] > 0 and finals[0]["epsilon"] == float("inf")
    releases = 2 if method == "fsvrg" else 1
    assert finals[0]["dp_releases"] == releases
    for key in ("objective", "test_error", "dp_clipped"):
        assert finals[1][key] == finals[0][key]


def test_dp_stats_clip_is_a_run_config_key_read_by_the_statistics_release():
    """``dp.stats-clip`` (one home: DPSettings) reaches fsvrg's statistics release from the
    run config; set without a mechanism it is refused like every dp.* knob."""
    from fmtl_flower.config import RunConfig

    values = {"strategy": "fsvrg", "dataset": "sparse-federated", "num-tasks": 10,
              "dp.mechanism": "central", "dp.clip": 1.0, "dp.noise-multiplier": 1.0,
              "dp.stats-clip": 7.5}
    settings = DPSettings.from_run_config(RunConfig.from_mapping(values).to_dict(
        every_family=True))
    assert settings.stats_clip == 7.5
    assert enable_client_dp(fsvrg("fsvrg"), settings).privacy.stats_clip == 7.5
    assert FSVRGDP(DPSettings(mechanism="central", clip=1.0, noise_multiplier=1.0)
                   ).stats_clip == 20.0
    with pytest.raises(ConfigError, match="stats-clip"):
        DPSettings.from_run_config({"dp.stats-clip": 7.5})
    with pytest.raises(ConfigError, match="stats-clip"):
        DPSettings.from_run_config({"dp.mechanism": "central", "dp.clip": 1.0,
                                    "dp.noise-multiplier": 1.0, "dp.stats-clip": 0.0})


def test_cocoa_plus_adaptive_clip_is_the_one_sent_and_moves_up_when_all_devices_clip(data):
    """Adaptive clipping with client-clip: each round's train messages carry the clip that
    round's release uses (dp_clip_d_w), and with every device on its clip (none fits) the
    clip grows (target quantile 0.5)."""
    sent: dict[int, set[float]] = {}

    def record_clip(message: Message, reply: Message | None) -> list[Message]:
        if message.metadata.message_type == "train":
            config = message.content["config"]
            sent.setdefault(int(config["server-round"]), set()).add(float(config["dp-clip"]))
        return [] if reply is None else [reply]

    strategy, _ = federate(data, private("cocoa-plus", noise_seed=5, clip=0.001,
                                         noise_multiplier=0.5, adaptive=True,
                                         clipped_count_stddev=2.0), 3,
                           grid_cls=HostileGrid, tamper=record_clip)
    rounds = strategy.results()["rounds"]
    assert {r: {rounds[r]["dp_clip_d_w"]} for r in (1, 2, 3)} == sent
    assert all(r["dp_clipped"] == K for r in rounds[1:])
    assert rounds[1]["dp_clip_d_w"] < rounds[2]["dp_clip_d_w"] < rounds[3]["dp_clip_d_w"]
