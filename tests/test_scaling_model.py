#!/usr/bin/python3
"""Checks that bench/scaling_model.py computes what it says: the cost formulas against values
worked out by hand, no communication on one rank, efficiencies in (0, 1] that grow with the link
speed, and the bucketing of a training step.

Run: /usr/bin/python3 tests/test_scaling_model.py   (Meson test `scaling_model`, suite unit)
"""

import math
import os
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import scaling_model as model  # noqa: E402

MIB = 2**20


class CostFormulas(unittest.TestCase):
    def test_flat_ring_by_hand(self):
        # N = 4 on one host, alpha 10 µs, beta 1 GB/s, 8 MB: 6 steps of 10 µs, 6/4 * 8 ms = 12 ms.
        link = model.Link(10e-6, 1e9)
        self.assertAlmostEqual(model.flat_ring(8e6, 1, 4, None, link), 6 * 10e-6 + 12e-3)
        # 2 hosts x 2 ranks: the edges between hosts are the slowest, 4 ranks in all.
        slow = model.Link(100e-6, 0.125e9)
        self.assertAlmostEqual(model.flat_ring(8e6, 2, 2, slow, link), 6 * 100e-6 + 1.5 * 8e6 / 0.125e9)
        # An edge inside a host slower than the link: it sets the pace instead.
        self.assertAlmostEqual(model.flat_ring(8e6, 2, 2, link, slow), 6 * 100e-6 + 1.5 * 8e6 / 0.125e9)
        # N = 2: 2 steps, the whole buffer once.
        self.assertAlmostEqual(model.ring_allreduce(1e6, 2, link), 2 * 10e-6 + 1e-3)

    def test_small_buffer_schedules_by_hand(self):
        inter = model.Link(100e-6, 1e9)
        intra = model.Link(10e-6, 10e9)
        # 2 hosts x 2, host by host: one exchange inside the hosts, one between them with two
        # buffers on each host's link.
        self.assertAlmostEqual(model.recursive_doubling(1e6, [0, 0, 1, 1], inter, intra),
                               10e-6 + 1e-4 + 100e-6 + 2e-3)
        # The same through the leaders: gather and fan-out inside, one exchange between.
        self.assertAlmostEqual(model.leaders(1e6, 2, 2, inter, intra),
                               2 * (10e-6 + 1e-4) + 100e-6 + 1e-3)
        # 2 hosts x 3: the fold (4 -> 0, 5 -> 1) and the final send cross with two buffers on each
        # link, and both exchanges have one pair across, (2, 3) and (1, 3): four steps between
        # hosts against one.
        self.assertAlmostEqual(model.recursive_doubling(8, [0, 0, 0, 1, 1, 1], inter, intra),
                               4 * 100e-6 + (2 + 1 + 1 + 2) * 8 / 1e9, places=12)
        self.assertAlmostEqual(model.leaders(8, 2, 3, inter, intra),
                               2 * (10e-6 + 2 * 8 / 10e9) + 100e-6 + 8 / 1e9, places=12)

    def test_one_rank_costs_nothing(self):
        link = model.Link(10e-6, 1e9)
        for schedule in model.SCHEDULES.values():
            self.assertEqual(schedule(64 * MIB, 1, 1, link, link), 0.0)
        self.assertEqual(model.log_depth_allreduce(MIB, 1, link), 0.0)
        self.assertEqual(model.ring_half(MIB, 1, link), 0.0)

    def test_hierarchical_by_hand(self):
        inter = model.Link(20e-6, 10e9)
        intra = model.Link(5e-6, 20e9)
        size, hosts, local = 80e6, 4, 8
        inside = 2 * (7 * 5e-6 + 7 / 8 * size / 20e9)
        # Ring between hosts: L shards of S/L share the link, which costs as one flow of S.
        ring = 6 * 20e-6 + 6 / 4 * size / 10e9
        self.assertAlmostEqual(model.hierarchical(size, hosts, local, inter, intra, "ring"),
                               inside + ring)
        # Tree between 4 hosts: 2 log2(4) = 4 steps, the same bytes as the ring.
        tree = 4 * 20e-6 + 6 / 4 * size / 10e9
        self.assertAlmostEqual(model.hierarchical(size, hosts, local, inter, intra, "tree"),
                               inside + tree)
        # One host: just the ring inside it.
        self.assertAlmostEqual(model.hierarchical(size, 1, local, inter, intra),
                               model.ring_allreduce(size, local, intra))

    def test_log_depth_not_a_power_of_two(self):
        link = model.Link(1e-6, 1e9)
        # 6 ranks: 4 in the halving and doubling (4 steps, 2 * 3/4 S) plus 2 steps of S to fold.
        self.assertAlmostEqual(model.log_depth_allreduce(1e6, 6, link),
                               6 * 1e-6 + (1.5 + 2) * 1e6 / 1e9)

    def test_bad_link_is_refused(self):
        with self.assertRaises(ValueError):
            model.Link(1e-6, 0)
        with self.assertRaises(ValueError):
            model.hierarchical(1, 2, 2, model.Link(0, 1), model.Link(0, 1), "star")


class TrainingStep(unittest.TestCase):
    def test_batches(self):
        # Large (>= 5) alone where they are; small ones packed in order up to 10.
        fusion = model.Fusion(threshold=10, alone=5, cycle=0)
        self.assertEqual(model.batches([4, 12, 1, 1, 6, 3, 4], fusion), [9, 12, 6, 4])
        self.assertEqual(model.batches([], fusion), [])
        # Nothing alone: 4+4, then 4, then 12 by itself, then 1+1.
        fusion = model.Fusion(threshold=10, alone=math.inf, cycle=0)
        self.assertEqual(model.batches([4, 4, 4, 12, 1, 1], fusion), [8, 4, 12, 2])

    def test_step_by_hand(self):
        # compute 3 s: forward 1 s, backward 2 s; gradients of 1 and 3 bytes ready at 1.5 s and
        # 3 s; an allreduce costs 1 s per byte; threshold 1, so never fused.
        cost = lambda size: float(size)  # noqa: E731
        fusion = model.Fusion(threshold=1, alone=math.inf, cycle=0)
        self.assertAlmostEqual(model.step_time([1, 3], 3.0, cost, fusion, overlap=True), 6.0)
        self.assertAlmostEqual(model.step_time([1, 3], 3.0, cost, fusion, overlap=False), 7.0)
        # Free communication: the step is its compute time.
        self.assertAlmostEqual(model.step_time([1, 3], 3.0, lambda size: 0.0, fusion), 3.0)
        # A cycle of 1 s: woken at 1.5 s, the first runs to 2.5 s; the engine looks again at
        # 2.5 s (nothing), then at 3.5 s, and the second ends at 6.5 s.
        fusion = model.Fusion(threshold=1, alone=math.inf, cycle=1.0)
        self.assertAlmostEqual(model.step_time([1, 3], 3.0, cost, fusion), 6.5)
        # Fused (threshold 4) and waiting for both: one collective of 4 bytes from 3 s.
        fusion = model.Fusion(threshold=4, alone=math.inf, cycle=0)
        self.assertAlmostEqual(model.step_time([1, 3], 3.0, cost, fusion, overlap=False), 7.0)

    def test_efficiency_bounds_and_monotonic_in_link_speed(self):
        gradients = [4 * MIB] * 20 + [256 * 1024] * 50
        intra = model.Link(5e-6, 20e9)
        for name, schedule in model.SCHEDULES.items():
            for overlap in (True, False):
                previous = 0.0
                for gbit in (1, 10, 25, 100, 400):
                    inter = model.Link(25e-6, gbit * 1e9 / 8)
                    value = model.efficiency(gradients, 0.05,
                                             lambda s: schedule(s, 16, 8, inter, intra),
                                             model.Fusion(), overlap)
                    self.assertGreater(value, 0.0, name)
                    self.assertLessEqual(value, 1.0, name)
                    self.assertGreaterEqual(value, previous, f"{name}: {gbit} Gbit/s")
                    previous = value
                one_rank = model.efficiency(gradients, 0.05,
                                            lambda s: schedule(s, 1, 1, inter, intra),
                                            model.Fusion())
                self.assertEqual(one_rank, 1.0)

    def test_overlap_never_hurts(self):
        gradients = [MIB] * 100
        link = model.Link(25e-6, 1e9)
        cost = lambda s: model.flat_ring(s, 8, 8, link, link)  # noqa: E731
        fusion = model.Fusion(threshold=16 * MIB)
        self.assertGreaterEqual(model.efficiency(gradients, 0.1, cost, fusion, True),
                                model.efficiency(gradients, 0.1, cost, fusion, False))


class Fit(unittest.TestCase):
    def test_fit_recovers_alpha_and_beta(self):
        link = model.Link(80e-6, 0.12e9)
        points = [(size, model.ring_allreduce(size, 2, link)) for size in (MIB, 4 * MIB, 16 * MIB)]
        fitted, worst = model.fit(points, 2)
        self.assertAlmostEqual(fitted.alpha, link.alpha, delta=1e-9)
        self.assertAlmostEqual(fitted.beta / link.beta, 1.0, places=6)
        self.assertLess(worst, 1e-9)


class StartUp(unittest.TestCase):
    """The start-up model against values worked out by hand and against the measured runs of
    bench/startup_perf.sh in bench/results/startup_perf.tsv (docs/performance.md, "Start-up")."""

    TSV = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench", "results",
                       "startup_perf.tsv")
    SCHEMES = {"get-per-key": "get-per-key", "get-many": "get-many"}

    def test_requests_by_hand(self):
        # 2 ranks, one per host. get-per-key: rank 0 host 2 + routes 1+1 and 1+1 (rank 1 is
        # not loopback, found at once) + tcp 2 + lifeline 2 + ready 1 + wait 1 = 12; rank 1: host 2
        # + routes 1 + 1 + tcp 1 + lifeline 2 + ready 1 = 8; mean 10.
        self.assertAlmostEqual(model.startup_requests(2, 1, "get-per-key"), 10.0)
        # get-many (the routes ride in the host records): rank 0 host 2 + tcp 2 + lifeline 2 +
        # ready 2 = 8; rank 1: 2 + 1 + 2 + 1 = 6; mean 7.
        self.assertAlmostEqual(model.startup_requests(2, 1, "get-many"), 7.0)
        self.assertEqual(model.startup_requests(1, 1, "get-many"), 0.0)
        with self.assertRaises(ValueError):
            model.startup_requests(4, 1, "no-such-scheme")
        # At 1,024 ranks the folded start-up is constant per rank, the old one grows with N.
        self.assertAlmostEqual(model.startup_requests(1024, 8, "get-many"), 7.0)
        self.assertGreater(model.startup_requests(1024, 8, "get-per-key"), 2500)

    def test_store_bytes_by_hand(self):
        # N = 2, L = 1: 2 host records of 44 and 2 lifeline addresses of 20, one tcp address
        # (rank 0 reads rank 1's): 2*64 + 20 = 148 bytes of values under 5 keys of 18 bytes.
        # get-per-key: rank 0 (loopback) reads rank 1's route of 10 bytes twice, 2 more GETs,
        # each 5 + key in and 5 + value out. get-many: both ranks read the other's route in its
        # host record; 6 GET_MANYs (3 exchanges per rank), each 9 in and 5 out, and per key 4 +
        # key in and 5 + value out.
        self.assertAlmostEqual(model.startup_store_bytes(2, 1, "get-per-key"),
                               148 + 2 * 10 + 7 * 28)
        self.assertAlmostEqual(model.startup_store_bytes(2, 1, "get-many"),
                               148 + 2 * 10 + 5 * 27 + 6 * 14)

    def test_requests_match_every_measured_run(self):
        # The count is exact: the TSV's mean (one decimal) is within rounding of the model's.
        runs = model.read_startup(self.TSV, self.SCHEMES)
        self.assertEqual(len(runs), 8, "two schemes at 2, 4, 8 and 16 ranks")
        for (label, shape), run in runs.items():
            expected = model.startup_requests(run["ranks"], run["per_host"], self.SCHEMES[label])
            for measured in run["requests"]:
                self.assertAlmostEqual(measured, expected, delta=0.06, msg=f"{label} {shape}")

    def test_one_exchange_by_hand(self):
        # One record per rank, one SET and one GET_MANY, no ready round: 2 on every rank.
        self.assertAlmostEqual(model.startup_requests(2, 1, "one-exchange"), 2.0)
        self.assertAlmostEqual(model.startup_requests(1024, 8, "one-exchange"), 2.0)
        self.assertEqual(model.startup_requests(1, 1, "one-exchange"), 0.0)
        # N = 2: each rank reads the other's record (44 host + 2 * 20 addresses + 46 facts + 3
        # line breaks) under one key (4 + 18 in, 5 out) in one GET_MANY (9 in, 5 out).
        self.assertAlmostEqual(model.startup_store_bytes(2, 1, "one-exchange"),
                               2 * 133 + 2 * 27 + 2 * 14)

    def test_one_exchange_requests_match_every_measured_run(self):
        # bench/results/startup_fold.tsv: main (7 requests) against the one exchange (2).
        path = os.path.join(os.path.dirname(self.TSV), "startup_fold.tsv")
        schemes = {"main": "get-many", "fold": "one-exchange"}
        runs = model.read_startup(path, schemes)
        self.assertEqual(len(runs), 8, "two builds at 2, 4, 8 and 16 ranks")
        for (label, shape), run in runs.items():
            expected = model.startup_requests(run["ranks"], run["per_host"], schemes[label])
            for measured in run["requests"]:
                self.assertAlmostEqual(measured, expected, delta=0.06, msg=f"{label} {shape}")

    def test_fitted_time_within_twenty_percent_of_every_measured_median(self):
        runs = model.read_startup(self.TSV, self.SCHEMES)
        points = [(run["ranks"], run["per_host"], self.SCHEMES[label], model.median(run["init"]))
                  for (label, _), run in runs.items()]
        fitted, worst = model.fit_startup(points)
        self.assertLess(worst, 0.20)
        self.assertGreater(fitted.per_request_s, 0)
        self.assertGreater(fitted.per_peer_s, 0)
        for ranks, per_host, scheme, seconds in points:
            self.assertLess(abs(fitted.time(ranks, per_host, scheme) - seconds) / seconds, 0.20)
        # At 1,024 ranks the store's requests cost the old scheme over 300 times the new one's.
        old = fitted.terms(1024, 8, "get-per-key")[2]
        new = fitted.terms(1024, 8, "get-many")[2]
        self.assertGreater(old / new, 300)

    def test_fit_recovers_a_known_model(self):
        truth = model.StartupModel(0.02, 0.003, 50e-6)
        points = [(n, l, scheme, truth.time(n, l, scheme))
                  for n, l in ((2, 1), (4, 1), (8, 2), (16, 4)) for scheme in model.STARTUP_SCHEMES]
        fitted, worst = model.fit_startup(points)
        self.assertLess(worst, 1e-9)
        self.assertAlmostEqual(fitted.fixed_s, 0.02)
        self.assertAlmostEqual(fitted.per_peer_s, 0.003)
        self.assertAlmostEqual(fitted.per_request_s, 50e-6)



class StartUpThroughPmix(unittest.TestCase):
    """What PMIx adds to start-up under mpirun: the model's terms against values worked out by
    hand, and the fit against bench/startup_mpirun.sh's runs in bench/results/startup_mpirun.tsv
    (docs/performance.md, "Start-up through PMIx")."""

    RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench", "results")
    TSV = os.path.join(RESULTS, "startup_mpirun.tsv")

    def test_daemon_tree_depth_by_hand(self):
        # Radix 64: mpirun alone; mpirun and up to 64 children; then 64 * 64 grandchildren.
        for hosts, depth in ((1, 0), (2, 1), (4, 1), (65, 1), (66, 2), (128, 2), (4161, 2),
                             (4162, 3)):
            self.assertEqual(model.daemon_tree_depth(hosts), depth, f"{hosts} hosts")
        # Radix 2: 1 | 2, 3 | 4..7 | 8..15.
        for hosts, depth in ((1, 0), (3, 1), (4, 2), (7, 2), (8, 3), (15, 3), (16, 4)):
            self.assertEqual(model.daemon_tree_depth(hosts, radix=2), depth, f"{hosts} hosts")
        with self.assertRaises(ValueError):
            model.daemon_tree_depth(0)

    def test_pmix_model_by_hand(self):
        pmix = model.PmixModel(0.05, 0.01, 0.02, 0.001)
        # 8 per host: 50 ms + 7 * 10 ms; 128 hosts are 2 levels: 2 * 20 ms + 1024 * 1 ms.
        self.assertAlmostEqual(pmix.init_time(8), 0.12)
        self.assertAlmostEqual(pmix.fence_time(128, 1024), 1.064)
        self.assertAlmostEqual(pmix.time(128, 8), 1.184)
        # 4 hosts x 2: one level.
        self.assertAlmostEqual(pmix.time(4, 2), 0.06 + 0.02 + 0.008)

    def test_fit_non_negative_by_hand(self):
        rows = [(1.0, 1.0), (1.0, 2.0), (1.0, 3.0)]
        # y = 3 + 2x exactly.
        fitted = model.fit_non_negative(rows, [5.0, 7.0, 9.0])
        self.assertAlmostEqual(fitted[0], 3.0)
        self.assertAlmostEqual(fitted[1], 2.0)
        # y = -1 + 2x would need a negative constant: the line through 0 instead, weighted by
        # 1/y^2: slope = sum(x y / y^2) / sum(x^2 / y^2) = (1 + 6/9 + 15/25) / (1 + 4/9 + 9/25).
        fitted = model.fit_non_negative(rows, [1.0, 3.0, 5.0])
        self.assertEqual(fitted[0], 0.0)
        self.assertAlmostEqual(fitted[1], (1 + 6 / 9 + 15 / 25) / (1 + 4 / 9 + 9 / 25))

    def test_fit_recovers_a_known_model(self):
        # Radix 2, so that the points lie on several depths and the level is told apart.
        truth = model.PmixModel(0.03, 0.01, 0.002, 0.0005, radix=2)
        shapes = ((2, 1), (4, 1), (4, 2), (8, 2), (16, 1))
        points = [(h, l, truth.init_time(l), truth.fence_time(h, h * l)) for h, l in shapes]
        fitted, worst_init, worst_fence = model.fit_pmix(points, radix=2)
        self.assertLess(max(worst_init, worst_fence), 1e-9)
        for name in ("init_s", "init_per_local_s", "per_level_s", "per_rank_s"):
            self.assertAlmostEqual(getattr(fitted, name), getattr(truth, name), msg=name)

    def test_one_depth_puts_the_constant_on_the_level(self):
        # 2 to 4 hosts are one level under radix 64: a fence of 2 ms + 0.5 ms per rank fits as
        # 2 ms per level, which 128 hosts (2 levels) count twice.
        points = [(h, l, 0.03, 0.002 + 0.0005 * h * l) for h, l in ((2, 1), (4, 1), (4, 2), (4, 4))]
        fitted, _, worst_fence = model.fit_pmix(points)
        self.assertLess(worst_fence, 1e-9)
        self.assertAlmostEqual(fitted.per_level_s, 0.002)
        self.assertAlmostEqual(fitted.fence_time(128, 1024), 2 * 0.002 + 0.0005 * 1024)
        with self.assertRaises(ValueError):
            model.fit_pmix([(1, 2, 0.03, 0.001), (1, 4, 0.05, 0.002)])

    def test_measured_runs_are_read_as_written(self):
        runs = model.read_startup_mpirun(self.TSV)
        self.assertEqual(sorted(runs), sorted((way, shape) for way in ("kolo_addr", "pmix")
                                              for shape in ("2x1", "4x1", "4x2", "4x4")))
        for (way, shape), run in runs.items():
            self.assertEqual(len(run["init"]), 11, f"{way} {shape}: 11 rounds")
            if way == "kolo_addr":
                self.assertEqual(run["pmix"], [])
                continue
            # Per round, figures that are each the maximum over the ranks of the rank's own:
            # a rank's exchange holds its PMIx_Init and its fence, and its kolo_comm_init holds
            # its exchange; the shortest fence is at most the longest.
            for init, whole, pmix_init, fence, fence_min in zip(
                    run["init"], run["pmix"], run["pmix_init"], run["fence"], run["fence_min"]):
                self.assertLessEqual(pmix_init, whole)
                self.assertLessEqual(fence, whole)
                self.assertLessEqual(fence_min, fence)
                self.assertLessEqual(whole, init * 1e3)

    def test_a_file_of_other_columns_is_refused_by_name(self):
        with self.assertRaises(SystemExit) as caught:
            model.read_startup_mpirun(StartUp.TSV)
        message = str(caught.exception)
        self.assertIn("startup_perf.tsv is not written by startup_mpirun.sh -o", message)
        self.assertIn("no column way, pmix_max_ms", message)

    def test_fit_against_the_measured_runs(self):
        runs = model.read_startup_mpirun(self.TSV)
        points = model.pmix_points(runs)
        self.assertEqual([(h, l) for h, l, *_ in points], [(2, 1), (4, 1), (4, 2), (4, 4)])
        fitted, worst_init, worst_fence = model.fit_pmix(points)
        # PMIx_Init is within 20 % of every median. The fence itself is a few ms at most here,
        # noise beside PMIx_Init; its model is within 60 % of every median.
        self.assertLess(worst_init, 0.20)
        self.assertLess(worst_fence, 0.60)
        for hosts, per_host, init, fence in points:
            self.assertLess(fence, 0.010)
            self.assertGreater(init, 0.025)
        # What the model says PMIx adds, within a factor of 1.7 of what the medians of the
        # slowest rank's kolo_comm_init show, PMIx against KOLO_ADDR, at every shape.
        for hosts, per_host, *_ in points:
            shape = f"{hosts}x{per_host}"
            added = (model.median(runs[("pmix", shape)]["init"]) -
                     model.median(runs[("kolo_addr", shape)]["init"]))
            ratio = fitted.time(hosts, per_host) / added
            self.assertGreater(ratio, 1 / 1.7, shape)
            self.assertLess(ratio, 1.7, shape)
        # At 1,024 ranks, 8 per host, PMIx adds a few tenths of a second, under 10 % of the
        # store's start-up fitted to startup_perf.sh's runs.
        store_runs = model.read_startup(os.path.join(self.RESULTS, "startup_perf.tsv"),
                                        StartUp.SCHEMES)
        store, _ = model.fit_startup([
            (run["ranks"], run["per_host"], StartUp.SCHEMES[label], model.median(run["init"]))
            for (label, _), run in store_runs.items()])
        added = fitted.time(128, 8)
        self.assertGreater(added, 0.1)
        self.assertLess(added / store.time(1024, 8, "get-many"), 0.10)


if __name__ == "__main__":
    unittest.main()
