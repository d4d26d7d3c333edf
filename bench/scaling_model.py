#!/usr/bin/python3
"""scaling_model.py: an alpha-beta model of kolo's allreduce across hosts, and of the scaling
efficiency of a data-parallel training step built on it.

A message of S bytes over a link costs alpha + S / beta: alpha is the latency of one step of a
schedule (the wire, the kernel, the wake-up of the process), beta the bandwidth in bytes per
second. There are two kinds of link: between hosts (each host has one link to the switch, shared
by all its ranks) and inside a host (shared memory or loopback). A job has H hosts of L ranks
each, N = H * L ranks, numbered host by host. The schedules modelled, for S bytes per rank:

  flat ring     kolo's ring allreduce over all N ranks (reduce-scatter, then allgather):
                2(N-1) steps, each moving S/N bytes over every ring edge at once, so a step lasts
                as long as its slowest edge (between hosts, as a rule). Numbered host by host,
                each host's link carries exactly one ring edge each way, never two:
                    2(N-1) alpha_inter + 2(N-1)/N * S / beta_inter
                (or the same with alpha_intra and beta_intra, if an edge inside a host is slower).
  hierarchical  a ring reduce-scatter inside each host (rank l then holds 1/L of the host's sum),
                an allreduce of those shards between hosts, all L local ranks at once, each with
                its own peers on the other hosts, so that L flows of S/L bytes share the host's
                link (each gets beta_inter / L), then a ring allgather inside each host:
                    2 [(L-1) alpha_intra + (L-1)/L * S / beta_intra]  +  between(S),
                between = ring:  2(H-1) alpha_inter + 2(H-1)/H * S / beta_inter;
                between = tree:  a log-depth schedule, recursive halving then recursive doubling
                (Rabenseifner): 2 log2(H) alpha_inter + 2(H-1)/H * S / beta_inter when H is a
                power of two; otherwise the hosts beyond the largest power of two P first hand
                their whole shard to a partner and get the result back at the end:
                    2 (log2(P) + 1) alpha_inter + (2(P-1)/P + 2) * S / beta_inter.

Small buffers, where kolo runs latency schedules instead (every message holds the whole buffer,
and `small` prints them beside the flat ring):

  recursive doubling   over all N ranks (below 32 KiB x N): log2 P exchanges between r and r XOR d,
                the ranks beyond the largest power of two P folded in first and served last. A
                step lasts as long as its slowest pair: between hosts when any pair of it is, and
                then as many whole buffers share the host's link as the host has ranks in such
                pairs.
  leaders       kolo's hierarchical allreduce: every rank sends its buffer to its host's leader,
                the leaders run recursive doubling among themselves, the leaders send the result
                back: 2 (alpha_intra + (L-1) S / beta_intra) + the leaders' recursive doubling.

A training step: the model's gradients (float32 unless told otherwise) taken from
`fusion_perf --list-gradients`, so that the layers are defined once, in bench/fusion_perf.cpp.
The step computes for C seconds, a third forward and two thirds backward (a backward pass costs
about twice the forward's arithmetic). Gradients become ready in backward order (last layer
first); within backward, a gradient is taken to be ready once a share of the backward time equal
to the share of parameters up to it has passed. That is pessimistic for convolutional networks,
whose late layers hold most parameters but not most arithmetic, so real gradients come earlier.
Gradients are grouped as kolo's fusion engine groups them: every cycle (5 ms, or as soon as the
collectives it started are done, if later) it takes every gradient that is ready, runs each of
1 MiB or more alone and packs the smaller ones into buffers of up to the fusion threshold
(64 MiB); the collectives run one after another. With overlap, the step lasts max(C, end of the
last collective); without, every collective runs after backward: C plus all of them. The scaling
efficiency is C / step time: 1 on one rank, less as communication shows.

How to run it (a Python 3 from Debian, standard library only; the plot needs matplotlib:
`apt-get install -y python3-matplotlib`):

  /usr/bin/python3 bench/scaling_model.py predict [options]     efficiency table (and --plot PNG)
  /usr/bin/python3 bench/scaling_model.py fit --ranks N TABLE    alpha and beta from all_reduce_perf
  /usr/bin/python3 bench/scaling_model.py check --inter-alpha-us A --inter-gbit B TSV...
                                        predictions (flat ring, hierarchical) against cluster_perf.sh medians
  /usr/bin/python3 bench/scaling_model.py small --hosts H --ranks-per-host L [options]
                                        kolo's small-buffer schedules: time of each, per size
  /usr/bin/python3 bench/scaling_model.py startup --scheme LABEL=SCHEME... [--mpirun TSV] TSV...
                                        kolo_comm_init: a fit to startup_perf.sh's runs, the
                                        store's requests and bytes, and a prediction at 1,024;
                                        with --mpirun, what PMIx adds (startup_mpirun.sh's runs)

`--help` after each command lists its options and defaults.
"""

import argparse
import math
import os
import subprocess
import sys

GIGA = 1e9


class Link:
    """One kind of link: alpha seconds per message, beta bytes per second."""

    def __init__(self, alpha, beta):
        if not alpha >= 0 or not beta > 0:
            raise ValueError(f"a link needs alpha >= 0 and beta > 0 (got {alpha}, {beta})")
        self.alpha = alpha
        self.beta = beta

    def __repr__(self):
        return f"Link(alpha={self.alpha * 1e6:.1f} us, beta={self.beta / GIGA:.3f} GB/s)"


def ring_allreduce(size, ranks, link):
    """A ring allreduce of `size` bytes over `ranks` ranks whose slowest edge is `link`."""
    if ranks <= 1:
        return 0.0
    steps = 2 * (ranks - 1)
    return steps * link.alpha + steps / ranks * size / link.beta


def ring_half(size, ranks, link):
    """A ring reduce-scatter (or allgather) of `size` bytes over `ranks` ranks: half a ring."""
    if ranks <= 1:
        return 0.0
    return (ranks - 1) * link.alpha + (ranks - 1) / ranks * size / link.beta


def log_depth_allreduce(size, ranks, link):
    """Recursive halving then recursive doubling (Rabenseifner) of `size` bytes over `ranks`."""
    if ranks <= 1:
        return 0.0
    power = 1 << (ranks.bit_length() - 1)  # the largest power of two <= ranks
    steps = 2 * int(math.log2(power))
    volume = 2 * (power - 1) / power * size
    if power != ranks:  # the ranks beyond `power` fold into partners first, and get the result back
        steps += 2
        volume += 2 * size
    return steps * link.alpha + volume / link.beta


def flat_ring(size, hosts, per_host, inter, intra):
    """kolo's ring over all ranks, numbered host by host (one ring edge per host link each way);
    a step lasts as long as its slowest edge."""
    ranks = hosts * per_host
    if hosts == 1 or per_host == 1:
        return ring_allreduce(size, ranks, inter if hosts > 1 else intra)
    return max(ring_allreduce(size, ranks, inter), ring_allreduce(size, ranks, intra))


def hierarchical(size, hosts, per_host, inter, intra, between="ring"):
    """Reduce-scatter in each host, allreduce of 1/L shards between hosts (L flows share the host
    link), allgather in each host."""
    inside = 2 * ring_half(size, per_host, intra)
    # L shards of size/L at once, each flow with beta/L: the same time as one flow of size.
    shared = Link(inter.alpha, inter.beta / per_host)
    shard = size / per_host
    if between == "ring":
        across = ring_allreduce(shard, hosts, shared)
    elif between == "tree":
        across = log_depth_allreduce(shard, hosts, shared)
    else:
        raise ValueError(f"between must be ring or tree, not {between!r}")
    return inside + across


def recursive_doubling(size, host_of, inter, intra):
    """kolo's recursive doubling over len(host_of) ranks, rank r on host host_of[r]: each step as
    slow as its slowest pair; a step between hosts shares each host's link among that host's
    ranks that cross in it (each sends the whole buffer)."""
    ranks = len(host_of)
    if ranks <= 1:
        return 0.0
    power = 1 << (ranks.bit_length() - 1)

    def step(pairs):
        crossing = [pair for pair in pairs if host_of[pair[0]] != host_of[pair[1]]]
        if not crossing:
            return intra.alpha + size / intra.beta
        per_host = {}
        for a, b in crossing:
            for rank in (a, b):
                per_host[host_of[rank]] = per_host.get(host_of[rank], 0) + 1
        # Each crossing pair sends one buffer each way: a host's link carries one buffer per rank
        # of it in such a pair.
        return inter.alpha + max(per_host.values()) * size / inter.beta

    total = 0.0
    fold = [(r, r - power) for r in range(power, ranks)]
    if fold:
        total += 2 * step(fold)  # the fold, and the result sent back at the end
    distance = 1
    while distance < power:
        total += step([(r, r ^ distance) for r in range(power) if r < r ^ distance])
        distance *= 2
    return total


def leaders(size, hosts, per_host, inter, intra):
    """kolo's hierarchical allreduce (src/ring/allreduce_hierarchical.cpp): gather to the host's
    leader, recursive doubling among the leaders, fan out."""
    inside = 2 * (intra.alpha + (per_host - 1) * size / intra.beta) if per_host > 1 else 0.0
    return inside + recursive_doubling(size, list(range(hosts)), inter, intra)


SCHEDULES = {
    "flat ring": lambda s, h, l, inter, intra: flat_ring(s, h, l, inter, intra),
    "hierarchical, ring between hosts": lambda s, h, l, inter, intra: hierarchical(
        s, h, l, inter, intra, "ring"),
    "hierarchical, tree between hosts": lambda s, h, l, inter, intra: hierarchical(
        s, h, l, inter, intra, "tree"),
}


class Fusion:
    """How kolo's fusion engine groups gradients: every `cycle` seconds while work is pending (and
    once the collectives it started are done) it takes every gradient that is ready; one of
    `alone` bytes or more runs by itself, the smaller ones are packed into buffers of at most
    `threshold` bytes. Defaults: kolo's (KOLO_CYCLE_TIME_MS 5, 1 MiB, KOLO_FUSION_THRESHOLD 64M)."""

    def __init__(self, threshold=64 * 2**20, alone=2**20, cycle=0.005):
        if not threshold > 0 or not alone > 0 or not cycle >= 0:
            raise ValueError(f"bad fusion settings: {threshold}, {alone}, {cycle}")
        self.threshold, self.alone, self.cycle = threshold, alone, cycle


def batches(gradient_bytes, fusion):
    """The collectives (their bytes) that one negotiation makes of these ready gradients, in
    backward order: large ones alone, the others packed in order into buffers up to the
    threshold; each collective sits where its first gradient does."""
    result, open_batch = [], None
    for size in gradient_bytes:
        if size >= fusion.alone:
            result.append(size)
        elif open_batch is not None and result[open_batch] + size <= fusion.threshold:
            result[open_batch] += size
        else:
            result.append(size)
            open_batch = len(result) - 1
    return result


def step_time(gradient_bytes, compute, allreduce, fusion, overlap=True):
    """One training step: `gradient_bytes` in backward order, `compute` seconds of forward and
    backward, `allreduce(bytes)` the time of one collective. Returns seconds."""
    if not overlap:
        return compute + sum(allreduce(size) for size in batches(gradient_bytes, fusion))
    forward = compute / 3
    backward = compute - forward
    total = sum(gradient_bytes)
    ready, done = [], 0
    for size in gradient_bytes:  # a gradient is ready once its share of backward has passed
        done += size
        ready.append(forward + backward * done / total if total else compute)
    # The engine: woken by the first gradient, then a negotiation each cycle (or, when its
    # collectives outlast a cycle, as soon as they are done) taking everything ready by then.
    now, end, first = ready[0] if ready else compute, 0.0, 0
    while first < len(ready):
        if ready[first] > now:
            cycles = math.ceil((ready[first] - now) / fusion.cycle) if fusion.cycle else 1
            now = max(now + cycles * fusion.cycle, ready[first])
        last = first
        while last < len(ready) and ready[last] <= now:
            last += 1
        spent = sum(allreduce(size) for size in batches(gradient_bytes[first:last], fusion))
        if spent > 0:  # on one rank there is nothing to wait for
            end = now + spent
        first = last
        now = max(now + fusion.cycle, end)
    return max(compute, end)


def efficiency(gradient_bytes, compute, allreduce, fusion, overlap=True):
    """Scaling efficiency of a step: compute time / step time, in (0, 1]."""
    return compute / step_time(gradient_bytes, compute, allreduce, fusion, overlap)


# Arithmetic per sample, forward pass, in multiply-adds (10^9): torchvision's figures for
# ResNet-101 (7.80) and VGG-16 (15.47) at 224x224; BERT-base on a 128-token sequence: 85 million
# encoder weights used once per token (10.9) plus attention's two 128x128x768 products in each of
# 12 layers (0.3). A training step costs about three forward passes.
FORWARD_GMAC = {"resnet101": 7.80, "vgg16": 15.47, "bert-base": 11.2}
BATCH = {"resnet101": 64, "vgg16": 64, "bert-base": 32}


def default_compute_seconds(model, flops):
    """Compute time of one step of `model` on one rank reaching `flops` FLOP/s."""
    return 3 * 2 * FORWARD_GMAC[model] * GIGA * BATCH[model] / flops


def load_gradients(fusion_perf, models):
    """{model: [bytes of float32 gradient, ...] in forward order} from fusion_perf."""
    try:
        listing = subprocess.run([fusion_perf, "--list-gradients", "--model", ",".join(models)],
                                 check=True, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError) as error:
        sys.exit(f"scaling_model.py: could not list gradients with {fusion_perf} "
                 f"(build it: sh scripts/build.sh): {error}")
    gradients = {model: [] for model in models}
    for line in listing.splitlines():
        model, _, count = line.split("\t")
        gradients[model].append(int(count))
    return gradients


def open_input(path):
    try:
        return open(path)
    except OSError as error:
        sys.exit(f"scaling_model.py: cannot read {path}: {error.strerror}")


def parse_table(path):
    """Rows of an all_reduce_perf table: (bytes, out-of-place microseconds, in-place µs)."""
    rows = []
    with open_input(path) as table:
        for line in table:
            fields = line.split()
            if fields and fields[0].startswith("["):  # kolorun's "[rank] " prefix
                fields = fields[1:]
            if len(fields) >= 13 and fields[0].isdigit():
                rows.append((int(fields[0]), float(fields[5]), float(fields[9])))
    if not rows:
        sys.exit(f"scaling_model.py: no all_reduce_perf rows in {path}")
    return rows


def fit(points, ranks):
    """Least-squares fit of t = 2(N-1) alpha + 2(N-1)/N S / beta to (bytes, seconds) points,
    weighted by 1/t so that every size counts alike. Returns (Link, largest relative error)."""
    steps = 2 * (ranks - 1)
    # t = a + b x with x = steps/N * S; minimise sum ((a + b x - t) / t)^2.
    xs = [steps / ranks * size for size, _ in points]
    ts = [seconds for _, seconds in points]
    ws = [1 / t**2 for t in ts]
    sw = sum(ws)
    sx = sum(w * x for w, x in zip(ws, xs))
    st = sum(w * t for w, t in zip(ws, ts))
    sxx = sum(w * x * x for w, x in zip(ws, xs))
    sxt = sum(w * x * t for w, x, t in zip(ws, xs, ts))
    b = (sw * sxt - sx * st) / (sw * sxx - sx * sx)
    a = (st - b * sx) / sw
    link = Link(max(a, 0.0) / steps, 1 / b)
    worst = max(abs(ring_allreduce(size, ranks, link) - t) / t for size, t in points)
    return link, worst


def read_times(path, ranks, transport):
    """(bytes, seconds) of each row of an all_reduce_perf table, or of a cluster_perf.sh --tsv
    file (its flat rows of `transport` with `ranks` ranks in all; time from the median busbw).
    The time is the mean of out of place and in place."""
    with open_input(path) as first:
        header = first.readline().rstrip("\n").split("\t")
    if "busbw_out" not in header:
        return [(size, (out + inside) / 2 * 1e-6) for size, out, inside in parse_table(path)]
    points = []
    with open_input(path) as tsv:
        tsv.readline()
        for line in tsv:
            row = dict(zip(header, line.rstrip("\n").split("\t")))
            if (row["variant"] == "flat" and row["transport"] == transport
                    and int(row["hosts"]) * int(row["ranks_per_host"]) == ranks):
                size = int(row["bytes"])
                bus = size * 2 * (ranks - 1) / ranks / GIGA
                points.append((size, (bus / float(row["busbw_out"]) + bus / float(row["busbw_in"])) / 2))
    return points


def command_fit(arguments):
    if arguments.ranks < 2:
        sys.exit("scaling_model.py: fit: --ranks must be at least 2")
    # Several files: the median time of each size over them (runs of one configuration).
    by_size = {}
    for path in arguments.table:
        for size, seconds in read_times(path, arguments.ranks, arguments.transport):
            if size >= arguments.min_bytes:
                by_size.setdefault(size, []).append(seconds)
    if len(by_size) < 2:
        sys.exit(f"scaling_model.py: fit: need two sizes of at least {arguments.min_bytes} bytes")
    points = [(size, sorted(times)[len(times) // 2]) for size, times in sorted(by_size.items())]
    link, worst = fit(points, arguments.ranks)
    print(f"# fit of t = 2(N-1) alpha + 2(N-1)/N S / beta, N = {arguments.ranks}, "
          f"{len(points)} sizes from {points[0][0]} to {points[-1][0]} bytes "
          f"(mean of out of place and in place, median over {len(arguments.table)} file(s))")
    print(f"alpha_us {link.alpha * 1e6:.1f}")
    print(f"beta_gbit {link.beta * 8 / GIGA:.4f}")
    print(f"# beta = {link.beta / GIGA:.4f} GB/s; largest error of the fit {worst * 100:.1f}%")


def command_check(arguments):
    inter = Link(arguments.inter_alpha_us * 1e-6, arguments.inter_gbit * GIGA / 8)
    intra = Link(arguments.intra_alpha_us * 1e-6, arguments.intra_gbit * GIGA / 8)
    print(f"# predicted with inter-host {inter}, intra-host {intra}")
    print(f"# {'hosts':>5} {'x':>3} {'transport':>9} {'schedule':>12} {'bytes':>10} "
          f"{'measured':>9} {'predicted':>9} {'error':>7}")
    print("# busbw in GB/s, out of place, counted as the flat ring's over all ranks; rows of "
          "variant flat or ring: the flat ring; hierarchical: by shards (ring between hosts), "
          "above 32 KiB x N where kolo runs it")
    errors = []
    for path in arguments.tsv:
        with open_input(path) as tsv:
            header = tsv.readline().rstrip("\n").split("\t")
            if "busbw_out" not in header:
                sys.exit(f"scaling_model.py: {path} is not a table written by cluster_perf.sh -o")
            for line in tsv:
                row = dict(zip(header, line.rstrip("\n").split("\t")))
                hosts, per_host = int(row["hosts"]), int(row["ranks_per_host"])
                size, ranks = int(row["bytes"]), hosts * per_host
                schedule = {"flat": "flat ring", "ring": "flat ring",
                            "hierarchical": "hierarchical"}.get(row["variant"])
                if (schedule is None or row["transport"] != arguments.transport
                        or size < arguments.min_bytes
                        or (schedule == "hierarchical" and size <= 32 * 1024 * ranks)):
                    continue
                factor = 2 * (ranks - 1) / ranks
                model = flat_ring if schedule == "flat ring" else hierarchical
                predicted = size * factor / model(size, hosts, per_host, inter, intra) / GIGA
                measured = float(row["busbw_out"])
                error = (predicted - measured) / measured
                errors.append(abs(error))
                print(f"  {hosts:>5} {per_host:>3} {row['transport']:>9} {schedule:>12} "
                      f"{size:>10} {measured:>9.4f} {predicted:>9.4f} {error * 100:>+6.1f}%")
    if errors:
        print(f"# largest |error| {max(errors) * 100:.1f}%, median "
              f"{sorted(errors)[len(errors) // 2] * 100:.1f}%")


def command_predict(arguments):
    inter = Link(arguments.inter_alpha_us * 1e-6, arguments.link_gbit * GIGA / 8)
    intra = Link(arguments.intra_alpha_us * 1e-6, arguments.intra_gbytes * GIGA)
    models = arguments.model.split(",")
    for model in models:
        if model not in FORWARD_GMAC:
            sys.exit(f"scaling_model.py: unknown model {model!r} ({', '.join(FORWARD_GMAC)})")
    gradients = load_gradients(arguments.fusion_perf, models)
    hosts_list = [2**k for k in range(1, 11)]
    fusion = Fusion(arguments.fusion_mib * 2**20,
                    arguments.alone_mib * 2**20 if arguments.alone_mib > 0 else math.inf,
                    arguments.cycle_ms * 1e-3)
    per_host = arguments.ranks_per_host
    print(f"# {per_host} ranks per host; between hosts {arguments.link_gbit:g} Gbit/s, "
          f"alpha {arguments.inter_alpha_us:g} us; inside a host {arguments.intra_gbytes:g} GB/s, "
          f"alpha {arguments.intra_alpha_us:g} us;\n#   fusion: {arguments.fusion_mib:g} MiB buffers, "
          f"cycle {arguments.cycle_ms:g} ms"
          f"{f', gradients of {arguments.alone_mib:g} MiB or more alone' if arguments.alone_mib > 0 else ''}; "
          f"{arguments.bytes_per_element}-byte gradients; "
          f"{'overlapped with backward' if not arguments.no_overlap else 'no overlap'}")
    results = {}
    for model in models:
        sizes = [count * arguments.bytes_per_element for count in reversed(gradients[model])]
        compute = (arguments.compute_ms * 1e-3 if arguments.compute_ms
                   else default_compute_seconds(model, arguments.tflops * 1e12))
        print(f"\n# {model}: {len(sizes)} gradients, {sum(sizes) / 1e6:.1f} MB, compute "
              f"{compute * 1e3:.1f} ms per step ({len(batches(sizes, fusion))} collectives without overlap); "
              f"scaling efficiency at H hosts:")
        print(f"# {'schedule':<34}" + "".join(f"{h:>7}" for h in hosts_list))
        for name, schedule in SCHEDULES.items():
            row = []
            for hosts in hosts_list:
                row.append(efficiency(
                    sizes, compute,
                    lambda s, h=hosts, f=schedule: f(s, h, per_host, inter, intra),
                    fusion, not arguments.no_overlap))
            results[(model, name)] = row
            print(f"  {name:<34}" + "".join(f"{e * 100:>6.1f}%" for e in row))
        explain(arguments, sizes, compute, inter, intra, fusion)
    if arguments.plot:
        plot(arguments, hosts_list, results, models)


def explain(arguments, sizes, compute, inter, intra, fusion, hosts=128, target=0.9):
    """What the step is made of at `hosts` hosts with the best schedule, and the link between
    hosts that the target efficiency needs."""
    per_host, overlap = arguments.ranks_per_host, not arguments.no_overlap

    def best(link):
        return max((efficiency(sizes, compute, lambda s, f=f: f(s, hosts, per_host, link, intra),
                               fusion, overlap), name) for name, f in SCHEDULES.items())

    value, name = best(inter)
    schedule = SCHEDULES[name]
    plan = batches(sizes, fusion)
    costs = [schedule(size, hosts, per_host, inter, intra) for size in plan]
    step = compute / value
    print(f"# at {hosts} hosts the best is {name}, {value * 100:.1f}%: step {step * 1e3:.1f} ms = "
          f"compute {compute * 1e3:.1f} + exposed communication {(step - compute) * 1e3:.1f}; "
          f"{len(plan)} collectives, one after another, would take {sum(costs) * 1e3:.1f} ms "
          f"(the bandwidth alone {2 * sum(sizes) / inter.beta * 1e3:.1f} ms), against "
          f"{compute * 2 / 3 * 1e3:.1f} ms of backward to hide in")
    if value >= target:
        return
    unlimited = Link(inter.alpha, 1e6 * GIGA)  # 8 Pbit/s: the link's bandwidth no longer counts
    floor, floor_name = best(unlimited)
    if floor < target:
        inside = sum(2 * ring_half(size, per_host, intra) for size in plan)
        rest = sum(SCHEDULES[floor_name](size, hosts, per_host, unlimited, intra)
                   for size in plan) - inside
        print(f"#   {target * 100:.0f}% is out of reach at any link speed: with an unlimited link "
              f"{floor * 100:.1f}% ({floor_name}); what remains per step is {inside * 1e3:.1f} ms "
              f"of reduce-scatter and allgather inside the hosts and {rest * 1e3:.1f} ms of "
              f"latency between them")
        return
    low, high = inter.beta, 1e6 * GIGA
    while high / low > 1.001:
        middle = math.sqrt(low * high)
        if best(Link(inter.alpha, middle))[0] >= target:
            high = middle
        else:
            low = middle
    print(f"#   {target * 100:.0f}% needs {high * 8 / GIGA:.0f} Gbit/s between hosts "
          f"(or fewer gradient bytes, or more compute per step)")


def plot(arguments, hosts_list, results, models):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as pyplot
    except ImportError:
        sys.exit("scaling_model.py: --plot needs matplotlib (apt-get install -y python3-matplotlib)")
    figure, axes = pyplot.subplots(figsize=(8, 5))
    colours = dict(zip(models, ["tab:blue", "tab:orange", "tab:green", "tab:red"]))
    styles = dict(zip(SCHEDULES, [":", "--", "-"]))
    for (model, name), row in results.items():
        axes.plot(hosts_list, [e * 100 for e in row], styles[name], color=colours[model],
                  marker="o", markersize=3, label=f"{model}, {name}")
    axes.axhline(90, color="grey", linewidth=0.8)
    axes.set_xscale("log", base=2)
    axes.set_xticks(hosts_list, [str(h) for h in hosts_list])
    axes.set_ylim(0, 102)
    axes.set_xlabel(f"hosts ({arguments.ranks_per_host} ranks each)")
    axes.set_ylabel("scaling efficiency, %")
    axes.set_title(f"kolo scaling model: {arguments.link_gbit:g} Gbit/s between hosts, "
                   f"{'overlap' if not arguments.no_overlap else 'no overlap'}", fontsize=10)
    axes.grid(True, which="both", linewidth=0.3)
    axes.legend(fontsize=7, loc="upper right")
    figure.tight_layout()
    figure.savefig(arguments.plot, dpi=110)
    print(f"# plot written to {arguments.plot}")


# ---- start-up: kolo_comm_init ------------------------------------------------------------------
#
# A world communicator's start-up over TCP, ranks numbered host by host, rank 0's host reaching
# the store over loopback (KOLO_ADDR's host name resolves to 127.0.1.1 there, as on Debian). Three
# schemes: "get-per-key", where each exchange was one SET and a GET per other rank (the host
# discovery, the tcp and lifeline listen routes, the tcp and lifeline addresses); "get-many",
# where each is one SET and one GET_MANY and the host records carry the routes, from which every
# rank decides where its transport and lifeline listen; and "one-exchange", where every rank
# listens first and one record per rank (host, both addresses, KOLO_TRANSPORT=auto's facts) goes
# in one SET and comes back in one GET_MANY, with no ready round (src/comm/communicator.cpp).

STARTUP_SCHEMES = ("get-per-key", "get-many", "one-exchange")


def startup_requests(ranks, per_host, scheme):
    """The mean number of store requests per rank. Rank r of N with L per host:
    get-per-key: host N (a SET, N-1 GETs); each of the two listen routes 1, plus on rank 0's host
    L GETs until the first address that is not loopback (rank L's); tcp addresses 1 + (N-1-r)
    (the higher ranks, which r connects to); lifeline N; ready 1, plus rank 0's WAIT. The mean:
    3N + 3 - (N-1)/2 + 2L^2/N + 1/N.
    get-many: host and route 2; tcp 2 (1 for the last rank, which connects to no one); lifeline 2;
    ready 1, plus rank 0's WAIT: 7 (startup_perf.sh saw rank 0 make 8, the last rank 6).
    one-exchange: one SET and one GET_MANY: 2."""
    n, l = ranks, per_host
    if n == 1:
        return 0.0
    if scheme == "get-per-key":
        return 3 * n + 3 - (n - 1) / 2 + 2 * l * l / n + 1 / n
    if scheme == "get-many":
        return 7.0
    if scheme == "one-exchange":
        return 2.0
    raise ValueError(f"unknown start-up scheme {scheme!r}")


def startup_store_bytes(ranks, per_host, scheme, host_bytes=44, address_bytes=20, key_bytes=18,
                        route_bytes=10, facts_bytes=46):
    """Bytes rank 0's store moves for one start-up, requests in and replies out: every rank reads
    every other rank's host record (host_bytes: KOLO_ALLREDUCE and the host identity) and lifeline
    address and the higher ranks' tcp addresses (address_bytes each); the routes (an IP address,
    route_bytes) are read, one GET each, by the ranks on rank 0's host under get-per-key, and
    under get-many by every rank, inside the host records. A GET costs a request of 5 + key_bytes
    and a reply of 5 + value; a GET_MANY 9 bytes plus 4 + key_bytes per key in, 5 bytes plus
    5 + value per key out. SETs and the ready barrier are small beside these and left out.
    Under one-exchange every rank reads every other rank's whole record, both addresses and the
    auto facts (facts_bytes: "0 host/boot-id") included, in one GET_MANY."""
    n, l = ranks, per_host
    pairs = n * (n - 1)                  # (reader, other) pairs of one all-to-all exchange
    values = pairs * (host_bytes + address_bytes) + pairs / 2 * address_bytes
    keys = pairs * 2 + pairs / 2
    if scheme == "get-per-key":
        # The routes: each rank on rank 0's host reads the others' until one is not loopback
        # (the first rank of the next host), twice (tcp and lifeline).
        routes = 2 * l * l
        return values + routes * route_bytes + (keys + routes) * (5 + 5 + key_bytes)
    if scheme == "get-many":
        exchanges = 3 * n
        return (values + pairs * route_bytes + keys * (4 + key_bytes + 5)
                + exchanges * (9 + 5))
    if scheme == "one-exchange":
        return (pairs * (host_bytes + 2 * address_bytes + facts_bytes + 3)
                + pairs * (4 + key_bytes + 5) + n * (9 + 5))
    raise ValueError(f"unknown start-up scheme {scheme!r}")


class StartupModel:
    """kolo_comm_init's time at N ranks, L per host: a fixed part (processes, the store's
    handshake, the slow derivation of the job key), a part per peer (a connection and its
    handshake to each, which on one shared machine also carries the CPU contention of N
    processes), and rank 0's store: each request it serves costs per_request_s, and its bytes
    go at store_bytes_per_s:
        fixed + per_peer (N-1) + per_request N requests(N) + bytes(N) / store_bytes_per_s."""

    def __init__(self, fixed_s, per_peer_s, per_request_s, store_bytes_per_s=math.inf):
        self.fixed_s = fixed_s
        self.per_peer_s = per_peer_s
        self.per_request_s = per_request_s
        self.store_bytes_per_s = store_bytes_per_s

    def store_requests(self, ranks, per_host, scheme):
        return ranks * startup_requests(ranks, per_host, scheme)

    def terms(self, ranks, per_host, scheme):
        """(fixed, peers, store requests, store bytes) in seconds."""
        return (self.fixed_s, self.per_peer_s * (ranks - 1),
                self.per_request_s * self.store_requests(ranks, per_host, scheme),
                startup_store_bytes(ranks, per_host, scheme) / self.store_bytes_per_s)

    def time(self, ranks, per_host, scheme):
        return sum(self.terms(ranks, per_host, scheme))


def solve(matrix, vector):
    """Solves a small linear system by Gaussian elimination with partial pivoting."""
    size = len(vector)
    rows = [list(row) + [value] for row, value in zip(matrix, vector)]
    for column in range(size):
        pivot = max(range(column, size), key=lambda r: abs(rows[r][column]))
        rows[column], rows[pivot] = rows[pivot], rows[column]
        if rows[column][column] == 0:
            raise ValueError("singular system: the points do not determine the model")
        for r in range(size):
            if r != column:
                factor = rows[r][column] / rows[column][column]
                rows[r] = [a - factor * b for a, b in zip(rows[r], rows[column])]
    return [rows[r][size] / rows[r][r] for r in range(size)]


def fit_startup(points):
    """Least-squares fit of StartupModel's fixed, per-peer and per-request terms (bytes left out:
    the points come from unshaped links, where they are microseconds) to (ranks, per_host, scheme,
    seconds) points, weighted by 1/t so that every job size counts alike. Returns (model, largest
    relative error)."""
    xs = [(1.0, n - 1.0, n * startup_requests(n, l, scheme)) for n, l, scheme, _ in points]
    ts = [t for *_, t in points]
    ws = [1 / t**2 for t in ts]
    normal = [[sum(w * x[i] * x[j] for w, x in zip(ws, xs)) for j in range(3)] for i in range(3)]
    right = [sum(w * x[i] * t for w, x, t in zip(ws, xs, ts)) for i in range(3)]
    model = StartupModel(*solve(normal, right))
    worst = max(abs(model.time(n, l, scheme) - t) / t for n, l, scheme, t in points)
    return model, worst


def read_startup(path, schemes):
    """startup_perf.sh --tsv rows: {(label, shape): {"ranks", "per_host", "init" (list of s),
    "requests" (list of mean requests per rank)}} for the labels named in schemes (label ->
    scheme)."""
    runs = {}
    with open_input(path) as tsv:
        header = tsv.readline().rstrip("\n").split("\t")
        for line in tsv:
            row = dict(zip(header, line.rstrip("\n").split("\t")))
            if row["label"] not in schemes:
                continue
            hosts, per_host = (int(part) for part in row["shape"].split("x"))
            run = runs.setdefault((row["label"], row["shape"]), {
                "ranks": hosts * per_host, "per_host": per_host, "init": [], "requests": []})
            run["init"].append(float(row["init_max_s"]))
            run["requests"].append(float(row["requests_mean"]))
    return runs


def median(values):
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


# ---- start-up through PMIx (mpirun) -------------------------------------------------------------
#
# Under mpirun, kolo's ranks exchange their start-up records through PMIx (src/bootstrap/pmix.cpp)
# in one put, commit and fence, and no rank asks a store anything: start-up is the store's model
# above without its store terms (the fixed part and the connections to the peers stay), plus
# PMIx_Init (the rank's connection to the Open MPI daemon on its host; the ranks of a host connect
# at once) and the fence that collects the records. (Before the one-fence start-up the fence
# handed out rank 0's store address only, and the store's requests followed; the PMIx_Init and
# fence terms are fitted to runs of that code, bench/results/startup_mpirun.tsv, whose fence
# carried one small value where it now carries a record of about 100 bytes per rank.) Open MPI
# 4.1's fence (grpcomm "direct" over the routed "radix" tree, radix 64 by default): each daemon
# waits for its local ranks, sends its bucket up the tree to its parent, mpirun (the root, itself
# the daemon of the first host) waits for all of them and sends the whole bucket down the same
# tree. So its time grows with the depth of the tree (one level up and one down per level) and,
# through the bucket that every daemon receives and hands to its ranks, with the number of ranks.

OMPI_ROUTED_RADIX = 64


def daemon_tree_depth(hosts, radix=OMPI_ROUTED_RADIX):
    """Levels below mpirun in a radix tree of `hosts` daemons (mpirun counted as the first): the
    smallest d with 1 + radix + ... + radix^d >= hosts. 1 host: 0; 2..65: 1; 66..4161: 2."""
    if hosts < 1 or radix < 1:
        raise ValueError(f"hosts and radix must be at least 1: {hosts}, {radix}")
    depth, reached, level = 0, 1, 1
    while reached < hosts:
        level *= radix
        reached += level
        depth += 1
    return depth


class PmixModel:
    """What PMIx adds to kolo_comm_init's slowest rank at N ranks on H hosts, L per host:
        PMIx_Init: init_s + init_per_local_s (L - 1)
        fence:     per_level_s depth(H) + per_rank_s N
    The fence term is the shortest fence of any rank (the last rank to arrive waits for the
    collective alone); the slowest rank's PMIx_Init is what the others' fences wait for."""

    def __init__(self, init_s, init_per_local_s, per_level_s, per_rank_s,
                 radix=OMPI_ROUTED_RADIX):
        self.init_s = init_s
        self.init_per_local_s = init_per_local_s
        self.per_level_s = per_level_s
        self.per_rank_s = per_rank_s
        self.radix = radix

    def init_time(self, per_host):
        return self.init_s + self.init_per_local_s * (per_host - 1)

    def fence_time(self, hosts, ranks):
        return self.per_level_s * daemon_tree_depth(hosts, self.radix) + self.per_rank_s * ranks

    def time(self, hosts, per_host):
        return self.init_time(per_host) + self.fence_time(hosts, hosts * per_host)


def fit_non_negative(rows, ys):
    """Least squares of y = sum_i c_i x_i with every c_i >= 0, weighted by 1/y^2 (every point
    counts alike relatively), for a few columns: the best of the unconstrained fits on each subset
    of the columns whose coefficients are all >= 0 (the constrained optimum is one of them), the
    others 0. rows: one tuple of x per point. Returns the coefficients."""
    columns = len(rows[0])
    ws = [1 / y**2 for y in ys]
    best, best_residual = None, math.inf
    for mask in range(1, 2**columns):
        used = [i for i in range(columns) if mask >> i & 1]
        normal = [[sum(w * x[i] * x[j] for w, x in zip(ws, rows)) for j in used] for i in used]
        right = [sum(w * x[i] * y for w, x, y in zip(ws, rows, ys)) for i in used]
        try:
            solution = solve(normal, right)
        except ValueError:
            continue
        if min(solution) < 0:
            continue
        coefficients = [0.0] * columns
        for i, c in zip(used, solution):
            coefficients[i] = c
        residual = sum(w * (y - sum(c * x for c, x in zip(coefficients, row))) ** 2
                       for w, row, y in zip(ws, rows, ys))
        if residual < best_residual - 1e-15:
            best, best_residual = coefficients, residual
    if best is None:
        raise ValueError("no fit with non-negative terms: the points do not determine the model")
    return best


def fit_pmix(points, radix=OMPI_ROUTED_RADIX):
    """PmixModel from (hosts, per_host, init_s, fence_s) points, every term >= 0: PMIx_Init a line
    in L - 1, the fence a line in depth(H) and N. Points all on one tree depth (as on 2 to 65
    hosts) cannot tell the per-level term from a constant part of the fence: it is all put on the
    level, which a deeper tree then counts once per level, an upper bound. Returns (model,
    largest relative error of PMIx_Init, of the fence)."""
    if all(daemon_tree_depth(h, radix) == 0 for h, *_ in points):
        raise ValueError("every point is on one host: no fence across daemons to fit")
    init_s, init_per_local_s = fit_non_negative([(1.0, l - 1.0) for _, l, _, _ in points],
                                                [init for *_, init, _ in points])
    per_level_s, per_rank_s = fit_non_negative(
        [(float(daemon_tree_depth(h, radix)), float(h * l)) for h, l, *_ in points],
        [fence for *_, fence in points])
    model = PmixModel(init_s, init_per_local_s, per_level_s, per_rank_s, radix)
    worst_init = max(abs(model.init_time(l) - init) / init for _, l, init, _ in points)
    worst_fence = max(abs(model.fence_time(h, h * l) - fence) / fence for h, l, _, fence in points)
    return model, worst_init, worst_fence


def read_startup_mpirun(path):
    """startup_mpirun.sh -o rows: {(way, shape): {"hosts", "per_host", "init" (s), "pmix",
    "pmix_init", "fence", "fence_min" (ms, PMIx runs only)}}. Exits naming the file and the
    columns if it is not such a file."""
    needed = ("way", "shape", "init_max_s", "pmix_max_ms", "pmix_init_max_ms", "fence_max_ms",
              "fence_min_ms")
    runs = {}
    with open_input(path) as tsv:
        header = tsv.readline().rstrip("\n").split("\t")
        missing = [column for column in needed if column not in header]
        if missing:
            sys.exit(f"scaling_model.py: {path} is not written by startup_mpirun.sh -o: it has no "
                     f"column {', '.join(missing)}")
        for line in tsv:
            row = dict(zip(header, line.rstrip("\n").split("\t")))
            hosts, per_host = (int(part) for part in row["shape"].split("x"))
            run = runs.setdefault((row["way"], row["shape"]), {
                "hosts": hosts, "per_host": per_host, "init": [], "pmix": [], "pmix_init": [],
                "fence": [], "fence_min": []})
            run["init"].append(float(row["init_max_s"]))
            if row["way"] == "pmix":
                for key, column in (("pmix", "pmix_max_ms"), ("pmix_init", "pmix_init_max_ms"),
                                    ("fence", "fence_max_ms"), ("fence_min", "fence_min_ms")):
                    run[key].append(float(row[column]))
    return runs


def pmix_points(runs):
    """(hosts, per_host, init_s, fence_s) per shape of startup_mpirun.sh's PMIx runs: the medians
    of the slowest PMIx_Init and of the shortest fence."""
    return [(run["hosts"], run["per_host"], median(run["pmix_init"]) / 1e3,
             median(run["fence_min"]) / 1e3)
            for (way, _), run in sorted(runs.items(), key=lambda item: item[1]["hosts"] *
                                        item[1]["per_host"]) if way == "pmix"]


def command_startup(arguments):
    schemes = {}
    for text in arguments.scheme:
        label, _, scheme = text.partition("=")
        if scheme not in STARTUP_SCHEMES:
            sys.exit(f"scaling_model.py: --scheme {text}: the scheme is one of "
                     f"{', '.join(STARTUP_SCHEMES)}")
        schemes[label] = scheme
    runs = {}
    for path in arguments.tsv:
        runs.update(read_startup(path, schemes))
    if not runs:
        sys.exit("scaling_model.py: no startup_perf.sh rows with the labels of --scheme")
    points = [(run["ranks"], run["per_host"], schemes[label], median(run["init"]))
              for (label, _), run in runs.items()]
    model, worst = fit_startup(points)
    model.store_bytes_per_s = arguments.store_gbit * GIGA / 8
    print(f"# fit: fixed {model.fixed_s * 1e3:.1f} ms, per peer {model.per_peer_s * 1e3:.2f} ms, "
          f"per store request {model.per_request_s * 1e6:.1f} µs; largest error {worst:.0%}")
    print("label\tscheme\tshape\tranks\tinit ms (median)\tmodel ms\trequests/rank measured\t"
          "model")
    for (label, shape), run in sorted(runs.items(), key=lambda item: (item[0][0], item[1]["ranks"])):
        scheme = schemes[label]
        print(f"{label}\t{scheme}\t{shape}\t{run['ranks']}\t{median(run['init']) * 1e3:.1f}\t"
              f"{model.time(run['ranks'], run['per_host'], scheme) * 1e3:.1f}\t"
              f"{median(run['requests']):.2f}\t"
              f"{startup_requests(run['ranks'], run['per_host'], scheme):.2f}")
    ranks, per_host = arguments.ranks, arguments.ranks_per_host
    print(f"\n# at {ranks} ranks, {per_host} per host; rank 0's store at "
          f"{arguments.store_gbit:g} Gbit/s")
    print("scheme\trequests/rank\tstore requests\tstore MB\tfixed s\tpeers s\tstore requests s\t"
          "store bytes s\ttotal s")
    for scheme in STARTUP_SCHEMES:
        fixed, peers, requests, moved = model.terms(ranks, per_host, scheme)
        print(f"{scheme}\t{startup_requests(ranks, per_host, scheme):.1f}\t"
              f"{model.store_requests(ranks, per_host, scheme):.0f}\t"
              f"{startup_store_bytes(ranks, per_host, scheme) / 1e6:.1f}\t{fixed:.3f}\t"
              f"{peers:.3f}\t{requests:.3f}\t{moved:.3f}\t{fixed + peers + requests + moved:.3f}")
    if arguments.mpirun:
        command_startup_pmix(arguments, model)


def command_startup_pmix(arguments, store):
    runs = {}
    for path in arguments.mpirun:
        runs.update(read_startup_mpirun(path))
    points = pmix_points(runs)
    if not points:
        sys.exit("scaling_model.py: no PMIx rows in the --mpirun files")
    pmix, worst_init, worst_fence = fit_pmix(points)
    print(f"\n# PMIx under mpirun: PMIx_Init {pmix.init_s * 1e3:.1f} ms + "
          f"{pmix.init_per_local_s * 1e3:.2f} ms per other rank on the host; fence "
          f"{pmix.per_level_s * 1e3:.2f} ms per level of the daemon tree (radix {pmix.radix}) + "
          f"{pmix.per_rank_s * 1e3:.2f} ms per rank; largest errors {worst_init:.0%}, "
          f"{worst_fence:.0%}")
    print("shape\tranks\tinit ms PMIx\tinit ms KOLO_ADDR\tdifference\tPMIx ms (slowest)\t"
          "PMIx_Init ms\tmodel\tfence ms (shortest)\tmodel")
    for hosts, per_host, init, fence in points:
        shape = f"{hosts}x{per_host}"
        with_pmix = median(runs[("pmix", shape)]["init"])
        given = runs.get(("kolo_addr", shape))
        addr = f"{median(given['init']) * 1e3:.1f}" if given else "-"
        difference = f"{(with_pmix - median(given['init'])) * 1e3:.1f}" if given else "-"
        print(f"{shape}\t{hosts * per_host}\t{with_pmix * 1e3:.1f}\t{addr}\t{difference}\t"
              f"{median(runs[('pmix', shape)]['pmix']):.1f}\t{init * 1e3:.1f}\t"
              f"{pmix.init_time(per_host) * 1e3:.1f}\t{fence * 1e3:.1f}\t"
              f"{pmix.fence_time(hosts, hosts * per_host) * 1e3:.1f}")
    ranks, per_host = arguments.ranks, arguments.ranks_per_host
    hosts = -(-ranks // per_host)
    base = store.time(ranks, per_host, "get-many")
    fixed, peers, *_ = store.terms(ranks, per_host, "get-many")
    print(f"\n# at {ranks} ranks on {hosts} hosts ({per_host} per host): the daemon tree has "
          f"{daemon_tree_depth(hosts, pmix.radix)} levels; times in s")
    print("rendezvous\tstore (get-many)\tfixed + peers\tPMIx_Init\tfence\ttotal")
    print(f"KOLO_ADDR\t{base:.3f}\t{fixed + peers:.3f}\t-\t-\t{base:.3f}")
    print(f"PMIx\t0\t{fixed + peers:.3f}\t{pmix.init_time(per_host):.3f}\t"
          f"{pmix.fence_time(hosts, ranks):.3f}\t"
          f"{fixed + peers + pmix.time(hosts, per_host):.3f}")


def positive(text):
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0: {text}")
    return value


def non_negative(text):
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0: {text}")
    return value


def command_small(arguments):
    inter = Link(arguments.inter_alpha_us * 1e-6, arguments.inter_gbit * GIGA / 8)
    intra = Link(arguments.intra_alpha_us * 1e-6, arguments.intra_gbit * GIGA / 8)
    hosts, per_host = arguments.hosts, arguments.ranks_per_host
    host_of = [rank // per_host for rank in range(hosts * per_host)]
    print(f"# {hosts} hosts x {per_host} ranks, ranks host by host; between hosts {inter}, "
          f"inside {intra}; times in µs")
    print("bytes\tflat ring\trecursive doubling\thierarchical\thierarchical / recursive doubling")
    for size in arguments.sizes:
        ring = flat_ring(size, hosts, per_host, inter, intra)
        doubling = recursive_doubling(size, host_of, inter, intra)
        tree = leaders(size, hosts, per_host, inter, intra)
        print(f"{size}\t{ring * 1e6:.1f}\t{doubling * 1e6:.1f}\t{tree * 1e6:.1f}\t"
              f"{tree / doubling:.2f}")


def main(argv=None):
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(
        description="kolo's allreduce and training-step scaling model (see the file's top)")
    commands = parser.add_subparsers(dest="command", required=True)

    predict = commands.add_parser("predict", help="scaling efficiency from 2 to 1024 hosts")
    predict.add_argument("--model", default="resnet101,vgg16,bert-base",
                         help="models, comma-separated (default: %(default)s)")
    predict.add_argument("--ranks-per-host", type=int, default=8, help="default: %(default)s")
    predict.add_argument("--link-gbit", type=positive, default=100,
                         help="link between hosts, Gbit/s (default: %(default)s)")
    predict.add_argument("--inter-alpha-us", type=non_negative, default=25,
                         help="latency of a step between hosts, µs (default: %(default)s)")
    predict.add_argument("--intra-gbytes", type=positive, default=20,
                         help="bandwidth inside a host, GB/s (default: %(default)s)")
    predict.add_argument("--intra-alpha-us", type=non_negative, default=5,
                         help="latency of a step inside a host, µs (default: %(default)s)")
    predict.add_argument("--tflops", type=positive, default=60,
                         help="arithmetic one rank reaches, TFLOP/s, for the default compute "
                              "time (default: %(default)s)")
    predict.add_argument("--compute-ms", type=positive,
                         help="compute time of a step, ms (default: from --tflops and the model)")
    predict.add_argument("--fusion-mib", type=positive, default=64,
                         help="fusion threshold, MiB (KOLO_FUSION_THRESHOLD; default: "
                              "%(default)s)")
    predict.add_argument("--cycle-ms", type=non_negative, default=5,
                         help="the fusion engine's cycle (KOLO_CYCLE_TIME_MS; default: "
                              "%(default)s)")
    predict.add_argument("--alone-mib", type=non_negative, default=1,
                         help="gradients of this size or more are sent alone, as kolo's engine "
                              "does; 0: never (default: %(default)s)")
    predict.add_argument("--bytes-per-element", type=int, choices=[2, 4], default=4,
                         help="gradient element size (default: %(default)s)")
    predict.add_argument("--no-overlap", action="store_true",
                         help="communicate after backward, not during it")
    predict.add_argument("--fusion-perf", default=os.path.join(here, "..", "build", "bench",
                                                                "fusion_perf"),
                         help="the fusion_perf that lists the gradients (default: build/bench/)")
    predict.add_argument("--plot", help="write a PNG of efficiency against hosts here")

    fit_parser = commands.add_parser("fit", help="alpha and beta from an all_reduce_perf table")
    fit_parser.add_argument("table", nargs="+",
                            help="all_reduce_perf's output (rank 0's table) or cluster_perf.sh's "
                                 "--tsv file")
    fit_parser.add_argument("--transport", default="tcp",
                            help="a --tsv file's rows of this KOLO_TRANSPORT (default: tcp)")
    fit_parser.add_argument("--ranks", type=int, required=True, help="N of that run")
    fit_parser.add_argument("--min-bytes", type=int, default=256 * 1024,
                            help="fit sizes from this up: where the ring runs (default: "
                                 "%(default)s; below 32 KiB x N kolo uses recursive doubling)")

    check = commands.add_parser("check", help="predictions against cluster_perf.sh's medians")
    check.add_argument("tsv", nargs="+", help="files written by cluster_perf.sh --tsv")
    check.add_argument("--inter-alpha-us", type=non_negative, required=True,
                       help="between hosts, from `fit` on a 2-host run")
    check.add_argument("--inter-gbit", type=positive, required=True,
                       help="between hosts, Gbit/s, from `fit` on a 2-host run")
    check.add_argument("--intra-alpha-us", type=non_negative, default=50,
                       help="inside a host (used by the flat ring only on one host)")
    check.add_argument("--intra-gbit", type=positive, default=16)
    check.add_argument("--transport", default="tcp", help="rows of this KOLO_TRANSPORT (default: "
                                                          "%(default)s)")
    check.add_argument("--min-bytes", type=int, default=256 * 1024,
                       help="rows from this size up (default: %(default)s)")

    small = commands.add_parser("small", help="kolo's small-buffer schedules across hosts")
    small.add_argument("--hosts", type=int, required=True)
    small.add_argument("--ranks-per-host", type=int, required=True)
    small.add_argument("--inter-alpha-us", type=non_negative, default=349.0,
                       help="default: %(default)s, fitted on the simulated cluster "
                            "(docs/performance.md)")
    small.add_argument("--inter-gbit", type=positive, default=0.9066)
    small.add_argument("--intra-alpha-us", type=non_negative, default=7.6)
    small.add_argument("--intra-gbit", type=positive, default=6.8929)
    small.add_argument("--sizes", type=int, nargs="+", default=[8, 512, 4096, 32768])

    startup = commands.add_parser("startup", help="kolo_comm_init's time: a fit to "
                                  "startup_perf.sh's runs and a prediction")
    startup.add_argument("tsv", nargs="+", help="files written by startup_perf.sh --tsv")
    startup.add_argument("--scheme", action="append", required=True,
                         help="LABEL=SCHEME: the rows of LABEL ran SCHEME (get-per-key or "
                              "get-many); repeat for each label")
    startup.add_argument("--ranks", type=int, default=1024, help="default: %(default)s")
    startup.add_argument("--ranks-per-host", type=int, default=8, help="default: %(default)s")
    startup.add_argument("--mpirun", action="append", default=[], metavar="TSV",
                         help="a file written by startup_mpirun.sh -o: also fit what PMIx adds "
                              "under mpirun and predict it; repeatable")
    startup.add_argument("--store-gbit", type=positive, default=10,
                         help="rank 0's link, Gbit/s, for the store's bytes (default: "
                              "%(default)s)")

    arguments = parser.parse_args(argv)
    if arguments.command == "startup":
        command_startup(arguments)
    elif arguments.command == "small":
        command_small(arguments)
    elif arguments.command == "predict":
        if arguments.ranks_per_host < 1:
            parser.error("--ranks-per-host must be at least 1")
        command_predict(arguments)
    elif arguments.command == "fit":
        command_fit(arguments)
    else:
        command_check(arguments)


if __name__ == "__main__":
    main()
