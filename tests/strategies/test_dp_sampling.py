"""Client-level DP with Poisson sampling (``dp.sampling=poisson``,
fmtl_flower.strategies.privacy): the secret sample's law, the fixed denominator q N, the
amplified account against independent computations, zero-device rounds, adaptive
clipping's count, resume, packing, the settings, and ``fixed`` left as it was."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
from scipy.special import gammaln

from fmtl_flower.config import RunConfig
from fmtl_flower.core.privacy import gaussian_event, rdp_epsilon
from fmtl_flower.settings import ConfigError, DPSettings
from fmtl_flower.strategies.privacy import ClientLevelDP, enable_client_dp
from tests.strategies.test_privacy import NUM_TASKS, equal_size_problem, fedem, run

pytest.importorskip("dp_accounting")

DELTA = 1e-5


def poisson(z: float = 1.0, clip: float = 1.0, **kwargs) -> ClientLevelDP:
    return ClientLevelDP(DPSettings(mechanism="central", clip=clip, noise_multiplier=z,
                                    sampling="poisson", **kwargs), noise_seed=11)


@pytest.fixture(scope="module")
def problem():
    return equal_size_problem()


# ------------------------------------------------------------------ the account
def closed_form_poisson_epsilon(z: float, q: float, steps: int, delta: float) -> float:
    """Epsilon of ``steps`` Poisson-subsampled Gaussian releases from the closed form of
    their RDP at the integer orders (Mironov, Talwar and Zhang 2019, Sec. 3.3): A_alpha =
    sum_k C(alpha, k) (1 - q)^(alpha - k) q^k exp((k^2 - k) / (2 z^2)), RDP
    log(A_alpha) / (alpha - 1) per release, composed by addition, converted by Canonne,
    Kamath and Steinke (2020, Prop. 12), minimised over the orders 2..63 (in log space)."""
    best = math.inf
    for a in range(2, 64):
        k = np.arange(a + 1)
        terms = (gammaln(a + 1) - gammaln(k + 1) - gammaln(a - k + 1)
                 + (a - k) * math.log1p(-q) + k * math.log(q) + (k * k - k) / (2 * z * z))
        rdp = steps * np.logaddexp.reduce(terms) / (a - 1)
        best = min(best, rdp + math.log1p(-1 / a) - math.log(delta * a) / (a - 1))
    return max(best, 0.0)


@pytest.mark.parametrize(("z", "q", "steps"),
                         [(1.0, 0.1, 50), (1.0, 0.3, 50), (2.0, 0.05, 500), (0.8, 0.01, 1000)])
def test_the_poisson_account_against_pld_and_the_closed_form(z, q, steps):
    """The epsilon the records report for Poisson-sampled releases (RDP) is between
    dp-accounting's near-exact PLD accountant (a second, independent accountant) and the
    closed form of the subsampled Gaussian's RDP at integer orders (the accountant also
    minimises over fractional orders, so it may only be lower), and well below the
    unamplified epsilon."""
    from dp_accounting.pld import pld_privacy_accountant

    eps = rdp_epsilon([(z, q, steps)], DELTA)
    pld = pld_privacy_accountant.PLDAccountant()
    pld.compose(gaussian_event(z, q, steps))
    closed = closed_form_poisson_epsilon(z, q, steps, DELTA)
    assert pld.get_epsilon(DELTA) <= eps <= 1.3 * pld.get_epsilon(DELTA)
    assert 0.9 * closed <= eps <= closed * (1 + 1e-9)
    assert eps < 0.7 * rdp_epsilon([(z, 1.0, steps)], DELTA)


def test_a_poisson_run_records_the_amplified_account(problem):
    """Every round is one Poisson-subsampled release (zero-device rounds included): the
    records carry q, q N and the epsilon of k such releases after round k."""
    z, q = 1.3, 0.25
    strategy = run(problem, enable_client_dp(fedem(fraction=q), mechanism="central",
                                             clip=0.5, noise_multiplier=z,
                                             sampling="poisson"), rounds=5)
    rounds = strategy.results()["rounds"]
    assert [r["epsilon"] for r in rounds] == pytest.approx(
        [rdp_epsilon([(z, q, k)], DELTA) for k in range(1, 6)], rel=1e-12)
    assert all(r["dp_sampling_rate"] == q and r["dp_expected_sampled"] == q * NUM_TASKS
               and r["dp_noise_std"] == z * 0.5 / (q * NUM_TASKS) for r in rounds)
    assert rounds[-1]["epsilon"] < 0.5 * rdp_epsilon([(z, 1.0, 5)], DELTA)


def test_a_target_epsilon_is_calibrated_with_the_sampling_rate(problem):
    strategy = run(problem, enable_client_dp(fedem(fraction=0.5), mechanism="central",
                                             clip=0.5, epsilon=2.0, sampling="poisson"),
                   rounds=3)
    final = strategy.results()["final"]
    assert 1.99 < final["epsilon"] <= 2.0
    fixed = run(problem, enable_client_dp(fedem(fraction=0.5), mechanism="central",
                                          clip=0.5, epsilon=2.0), rounds=3)
    assert final["dp_noise_multiplier"] < fixed.results()["final"]["dp_noise_multiplier"]


# ------------------------------------------------------------------ the sample
def test_each_device_is_included_with_probability_q_independently():
    """2000 rounds of 40 devices at q = 0.3: every device's inclusion frequency is q
    within 5 standard errors (0.0102), and the sample's size has the binomial variance
    N q (1 - q) (not 0: no fixed size)."""
    q, n, rounds = 0.3, 40, 2000
    dp = poisson()
    counts = np.zeros(n)
    sizes = []
    for _ in range(rounds):
        sampled = dp.sample(range(n), q, n)
        assert sampled == sorted(set(sampled))
        counts[sampled] += 1
        sizes.append(len(sampled))
    se = math.sqrt(q * (1 - q) / rounds)
    assert np.all(np.abs(counts / rounds - q) < 5 * se)
    assert np.var(sizes) == pytest.approx(n * q * (1 - q), rel=0.15)
    assert dp.expected_count == q * n


def test_the_sample_is_not_the_runs_seed():
    """Without noise_seed two samplers draw different samples (OS entropy)."""
    settings = DPSettings(mechanism="central", clip=1.0, noise_multiplier=1.0,
                          sampling="poisson")
    draws = [ClientLevelDP(settings).sample(range(200), 0.5, 200) for _ in range(2)]
    assert draws[0] != draws[1]


def test_the_run_trains_exactly_the_sampled_devices(problem):
    """The train messages go to the Poisson sample: per round, the devices that trained
    are the record's num_sampled, each round's count varies, and rounds of nobody happen."""
    trained: dict[int, list[int]] = {}

    def spy(app):
        def handler(msg, context):
            if msg.metadata.message_type == "train":
                config = msg.content["config"]
                trained.setdefault(int(config["server-round"]), []).append(
                    int(config["task-id"]))
            return app(msg, context)
        return handler

    strategy = run(problem, enable_client_dp(fedem(fraction=0.3), mechanism="central",
                                             clip=0.5, noise_multiplier=1.0,
                                             sampling="poisson", noise_seed=2), 12, wrap=spy)
    rounds = strategy.results()["rounds"]
    assert [len(trained.get(r["round"], [])) for r in rounds] == \
        [r["num_sampled"] for r in rounds]
    assert len({r["num_sampled"] for r in rounds}) > 1


# ------------------------------------------------------------------ the release
def test_the_mean_divides_by_q_n_and_the_noise_std_is_z_clip_over_q_n():
    """The release is current + (sum of clipped updates) / (q N) + N(0, (z C / (q N))^2):
    exact with z = 0, and the noise's empirical variance over 200 000 coordinates
    (relative standard error 0.3 %)."""
    q, n, clip = 0.4, 20, 0.7
    current = np.zeros((2, 100_000))
    for z in (0.0, 1.3):
        dp = poisson(z=z, clip=clip)
        sampled = dp.sample(range(n), q, n)
        rng = np.random.default_rng(0)
        returned = [current + 1e-4 * rng.normal(size=current.shape) for _ in sampled[1:]]
        out = dp.aggregate(current, returned, len(sampled), [], 10)
        mean = np.sum(returned, axis=0) / (q * n)
        fields = dp.record_fields([])
        assert fields["dp_clipped"] == 0 and fields["dp_noise_std"] == z * clip / (q * n)
        if z == 0:
            np.testing.assert_array_equal(out, current + mean)
        else:
            noise = out - mean
            assert np.var(noise) == pytest.approx((z * clip / (q * n)) ** 2, rel=0.02)


def test_a_round_that_samples_nobody_still_releases_noise(problem):
    """Nobody sampled (or heard from): the components move by the noise around the
    current model, N(0, (z C / (q N))^2), and the round is one release in the account
    (a noise-free model would show that nobody took part)."""
    q, z, clip = 0.01, 1.0, 0.5
    seed = next(s for s in range(1000) if not ClientLevelDP(DPSettings(
        mechanism="central", clip=clip, noise_multiplier=z, sampling="poisson"),
        noise_seed=s).sample(range(NUM_TASKS), q, NUM_TASKS))
    kwargs = {"model": "mlp", "hidden": 64, "fraction": q}
    plain = run(problem, fedem(**kwargs), rounds=1)  # no DP: nobody moves the components
    noisy = run(problem, enable_client_dp(fedem(**kwargs), mechanism="central", clip=clip,
                                          noise_multiplier=z, sampling="poisson",
                                          noise_seed=seed), rounds=1)
    final = noisy.results()["final"]
    assert final["num_sampled"] == 0 and final["epsilon"] == rdp_epsilon([(z, q, 1)], DELTA)
    noise = noisy.components - plain.components
    assert noise.size == 2 * 514
    assert np.var(noise) == pytest.approx((z * clip / (q * NUM_TASKS)) ** 2, rel=0.2)


def test_adaptive_clippings_count_uses_the_fixed_denominator():
    """With adaptive clipping the noisy fraction of updates that fit is 1/2 + (centred
    count + noise) / (q N), a silent sampled device counting as fitting; the clip moves
    geometrically on it (z = 0 and no count noise: exact)."""
    q, n, clip, lr, target = 0.5, 12, 1.0, 0.2, 0.5
    dp = ClientLevelDP(DPSettings(mechanism="central", clip=clip, noise_multiplier=0.0,
                                  sampling="poisson", adaptive=True, clipped_count_stddev=0.0,
                                  clip_learning_rate=lr, target_quantile=target),
                       noise_seed=5)
    sampled = dp.sample(range(n), q, n)
    assert len(sampled) >= 3
    current = np.zeros((1, 3))
    returned = [current + 3.0, current + 0.1]  # one clipped, one fits, the rest silent
    dp.aggregate(current, returned, len(sampled), [], 10)
    fields = dp.record_fields([])
    fits = 1 + len(sampled) - 2
    fraction = 0.5 + (fits - 0.5 * len(sampled)) / (q * n)
    assert fields["dp_unclipped_fraction"] == pytest.approx(fraction, rel=1e-14)
    assert fields["dp_clip_next"] == pytest.approx(clip * math.exp(-lr * (fraction - target)),
                                                   rel=1e-14)


def test_the_log_says_which_accounting_is_used(caplog):
    current = np.zeros((1, 3))
    with caplog.at_level(logging.INFO, logger="flwr"):
        dp = poisson()
        dp.aggregate(current, [], len(dp.sample(range(10), 0.2, 10)), [], 5)
    assert "PoissonSampledDpEvent(q, Gaussian(z))" in caplog.text
    assert "add/remove-one-device" in caplog.text and "q=0.2" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="flwr"):
        ClientLevelDP(DPSettings(mechanism="central", clip=1.0, noise_multiplier=1.0)
                      ).aggregate(current, [current], 1, [], 5)
    assert "no amplification by sampling" in caplog.text
    assert "Poisson" not in caplog.text


# ------------------------------------------------------------------ resume
# (a resumed poisson run: test_privacy.py::test_a_resumed_run_continues_the_account)
def test_a_fixed_checkpoint_does_not_resume_as_poisson(problem, tmp_path):
    from fmtl_flower.checkpoint import CheckpointError

    settings = {"mechanism": "central", "clip": 0.5, "noise_multiplier": 1.2}
    first = enable_client_dp(fedem(fraction=0.5), **settings)
    first.enable_checkpoints(tmp_path)
    run(problem, first, 2)
    other = enable_client_dp(fedem(fraction=0.5), **settings, sampling="poisson")
    other.enable_checkpoints(tmp_path)
    with pytest.raises(CheckpointError, match="dp"):
        run(problem, other, 3)


# ------------------------------------------------------------------ fixed, packing, settings
def test_fixed_is_the_default_and_changes_nothing(problem):
    """``dp.sampling=fixed`` (the default) is the mechanism as it was: the same components
    for the same noise stream, no sampling keys in the records, the unamplified account."""
    kwargs = {"mechanism": "central", "clip": 0.5, "noise_multiplier": 1.1}
    default = run(problem, enable_client_dp(fedem(fraction=0.5), **kwargs, noise_seed=3), 3)
    fixed = run(problem, enable_client_dp(fedem(fraction=0.5), **kwargs, sampling="fixed",
                                          noise_seed=3), 3)
    np.testing.assert_array_equal(fixed.components, default.components)
    rounds = fixed.results()["rounds"]
    assert not any("dp_sampling_rate" in r for r in rounds)
    assert [r["num_sampled"] for r in rounds] == [NUM_TASKS // 2] * 3
    assert rounds[-1]["epsilon"] == rdp_epsilon([(1.1, 1.0, 3)], DELTA)
    assert DPSettings().sampling == "fixed"


def test_packed_nodes_sample_each_task():
    """``fmtl run`` / ``flwr run`` with three tasks on a node: each task is the unit,
    sampled on its own; the replies of the sampled tasks come back in the nodes' stacked
    replies and the account is the Poisson one."""
    from fmtl_flower.apps.common import make_client_app, make_server_app
    from fmtl_flower.engine import run_inprocess

    q = 0.5
    cfg = RunConfig.from_mapping({
        "strategy": "fedavg", "dataset": "synthetic", "num-tasks": 12, "dim": 5,
        "samples-per-task": 30, "num-server-rounds": 3, "tasks-per-node": 3,
        "fedem.fraction": q, "dp.mechanism": "central", "dp.clip": 0.2,
        "dp.noise-multiplier": 1.5, "dp.sampling": "poisson"})
    box: dict = {}
    run_inprocess(make_server_app(cfg, on_done=box.update), make_client_app(cfg), 4)
    final = box["final"]
    assert final["epsilon"] == rdp_epsilon([(1.5, q, 3)], DELTA)
    assert final["dp_noise_std"] == pytest.approx(1.5 * 0.2 / (q * 12))
    assert final["num_replies"] == final["num_sampled"]


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"sampling": "poisson"}, "dp.mechanism=none"),
    ({"mechanism": "record", "clip": 1.0, "noise_multiplier": 1.0, "sampling": "poisson"},
     "record-level"),
    ({"mechanism": "central", "clip": 1.0, "noise_multiplier": 1.0, "sampling": "shuffle"},
     "dp.sampling"),
])
def test_bad_sampling_settings_are_refused(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        DPSettings(**kwargs)


def test_the_run_config_key_builds_the_setting():
    cfg = RunConfig.from_mapping({"strategy": "fedavg", "dp.mechanism": "central",
                                  "dp.clip": "0.5", "dp.epsilon": "8",
                                  "dp.sampling": "poisson"})
    assert DPSettings.from_run_config(cfg.to_dict(every_family=True)).sampling == "poisson"


def test_poisson_is_refused_where_it_does_not_hold():
    from fmtl_flower.strategies.fsvrg import FSVRG

    settings = {"mechanism": "central", "clip": 1.0, "noise_multiplier": 1.0,
                "sampling": "poisson"}
    with pytest.raises(ConfigError, match="FedEM's family"):
        enable_client_dp(FSVRG(4, method="gd"), **settings)
    with pytest.raises(ConfigError, match="min_train_nodes"):
        enable_client_dp(fedem(fraction=0.5, min_train_nodes=3), **settings)
    with pytest.raises(ConfigError, match="min_train_nodes"):
        poisson().sample(range(4), 0.5, 4, min_train_nodes=2)


def test_the_privacy_guide_quotes_what_the_benchmark_prints(capsys):
    """docs/guides/privacy.md's table is what ``benchmarks/dp_sampling_epsilon.py`` prints."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location(
        "dp_sampling_epsilon", root / "benchmarks" / "dp_sampling_epsilon.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main()
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    guide = (root / "docs" / "guides" / "privacy.md").read_text()
    assert len(rows) == 3
    for q, *eps in rows:
        assert f"| {q} | {' | '.join(eps)} |" in guide
