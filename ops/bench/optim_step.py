"""Optimizer step time on a GPT-shaped parameter set, as ratios measured in one run.

Parameters: token and position embeddings, `blocks` of four d x d attention matrices, a 4d x d
and a d x 4d MLP matrix and two LayerNorms each, a final LayerNorm and a vocab x d head. Every
parameter gets a fixed random gradient; a "step" is one optimizer step on those gradients.

Two comparisons, each timed by alternating its contenders step by step (so drift in a shared
machine's load hits all of them alike) and reporting medians:
1. Muon on the block matrices alone, at each Newton-Schulz dtype: ours (optim.muon, default
   batching) against `torch.optim.Muon` (stock, which always runs Newton-Schulz in bfloat16; and
   at float32, its own NS function with its one cast made a float32 copy, see `torch_ns_in`),
   plus the reference rule's plain per-matrix Muon (the team's seed, below, verbatim) and ours
   with every same-shape group batched. Targets: ours / torch.optim.Muon <= 1.0 at the same NS
   dtype; ours / reference <= 1.0.
   Then Newton-Schulz alone in float32 on each distinct block-matrix shape, ours
   (`optim.newton_schulz`) against torch's (`torch_ns_in(float32)`): where the fp32 row's
   difference comes from (tall matrices iterate on a transposed view to keep the reference's
   bits; docs/bench-optim.md).
2. Every arm of optim.build: the bundle's `step()` against calling its optimizers' `step()`
   directly. Target: bundle / direct within 1.02. On a shared machine those ratios carry a few
   percent of noise either way, so the bundle's own cost is also measured alone: MultiOpt.step
   against the same loop inline, over optimizers that do no work.

    PYTHONPATH=. python ops/bench/optim_step.py                      # d=256, 4 blocks, CPU
    PYTHONPATH=. python ops/bench/optim_step.py --d 768 --blocks 12 --device cuda --reps 50  # a GPU
Prints a markdown table (record it in docs/bench-optim.md).
"""

import argparse
import inspect
import statistics
import time
from contextlib import contextmanager

import torch
import torch.optim._muon as torch_muon

from optim.build import build_bundle
from optim.bundle import MultiOpt
from optim.config import parse_optim_config
from optim.muon import Muon
from optim.newton_schulz import NS_COEFFICIENTS, NS_EPS, newton_schulz

ARMS = ["adamw", "muon", "lion", "olion", "adafactor", "sgdm"]


class ReferenceMuon(torch.optim.Optimizer):
    """The team's seed Muon (reference_optim.py), verbatim in its ops: the baseline to beat."""

    def __init__(self, params, lr=0.02, momentum=0.95, ns_steps=5, nesterov=True):
        defaults = dict(lr=lr, momentum=momentum, ns_steps=ns_steps, nesterov=nesterov)
        super().__init__(params, defaults)

    @staticmethod
    def newton_schulz(G, steps=5, eps=1e-7):
        a, b, c = 3.4445, -4.7750, 2.0315
        X = G / (G.norm() + eps)
        transposed = X.size(0) > X.size(1)
        if transposed:
            X = X.T
        for _ in range(steps):
            A = X @ X.T
            B = b * A + c * (A @ A)
            X = a * X + B @ X
        return X.T if transposed else X

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                st = self.state[p]
                if "mom" not in st:
                    st["mom"] = torch.zeros_like(g)
                buf = st["mom"]
                buf.mul_(group["momentum"]).add_(g)
                u = g.add(buf, alpha=group["momentum"]) if group["nesterov"] else buf
                if u.ndim == 2:
                    u = self.newton_schulz(u, group["ns_steps"])
                    u = u * max(1.0, u.size(0) / u.size(1)) ** 0.5
                p.add_(u, alpha=-group["lr"])


class GPTShapes(torch.nn.Module):
    """The parameters of a GPT (no forward: only shapes and names matter here)."""

    def __init__(self, d: int, n_blocks: int, vocab: int, ctx: int):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Embedding(ctx, d)
        self.blocks = torch.nn.ModuleList()
        for _ in range(n_blocks):
            block = torch.nn.Module()
            block.ln1, block.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
            for name in ("q", "k", "v", "o"):
                setattr(block, name, torch.nn.Linear(d, d, bias=False))
            block.fc = torch.nn.Linear(d, 4 * d, bias=False)
            block.proj = torch.nn.Linear(4 * d, d, bias=False)
            self.blocks.append(block)
        self.ln_f = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)


def model_with_grads(args) -> torch.nn.Module:
    torch.manual_seed(0)
    model = GPTShapes(args.d, args.blocks, args.vocab, args.ctx).to(args.device)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    return model


def alternate(contenders: dict, reps: dict, device: str) -> dict[str, list[float]]:
    """Seconds per call of each contender, calls interleaved round-robin.

    On CPU the clock is this thread's CPU time (torch runs one thread here), so time the OS gives
    to other processes on a shared machine is not counted; on a GPU it is wall time between
    synchronisations.
    """
    clock = time.thread_time if device == "cpu" else time.perf_counter

    def timed(fn):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = clock()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        return clock() - t0

    for fn in contenders.values():
        fn()  # first step allocates state
    times = {name: [] for name in contenders}
    names = list(contenders)
    for r in range(max(reps.values())):
        # Rotate who goes first: the first call of a round measurably pays for the others' cache
        # evictions, which would otherwise bias every ratio by a few percent.
        for name in names[r % len(names):] + names[:r % len(names)]:
            if r < reps[name]:
                times[name].append(timed(contenders[name]))
    return times


def ratio(times: dict, a: str, b: str) -> float:
    """Median over rounds of a's time / b's time in the same round (neighbours in time share
    the machine's load, so the ratio is steadier than a ratio of medians)."""
    return statistics.median(x / y for x, y in zip(times[a], times[b], strict=False))


def torch_ns_in(dtype: torch.dtype):
    """torch.optim.Muon's own Newton-Schulz function, computing in `dtype`: torch offers no NS
    dtype, so its source is taken as installed and its one cast (`grad.bfloat16()`, a copy that
    the function then divides in place) made a copy in `dtype`. Everything else is torch's."""
    source = inspect.getsource(torch_muon._zeropower_via_newtonschulz)
    if source.count("grad.bfloat16()") != 1:
        raise SystemExit("torch.optim.Muon's Newton-Schulz changed; update torch_ns_in")
    namespace: dict = {}
    exec(source.replace("grad.bfloat16()", f"grad.to({dtype}, copy=True)"), vars(torch_muon).copy(), namespace)
    return namespace["_zeropower_via_newtonschulz"]


@contextmanager
def torch_muon_ns(fn):
    """torch.optim.Muon steps with `fn` as its Newton-Schulz function."""
    stock = torch_muon._zeropower_via_newtonschulz
    torch_muon._zeropower_via_newtonschulz = fn
    try:
        yield
    finally:
        torch_muon._zeropower_via_newtonschulz = stock


def muon_comparison(args) -> tuple[list[tuple[str, float, float]], list[tuple[str, float, float, float]]]:
    """(every contender's ms/step and ratio to the reference; per NS dtype: ours, torch, ours/torch)."""
    def matrices():
        model = model_with_grads(args)
        return [p for n, p in model.named_parameters() if n.startswith("blocks.") and p.ndim == 2]

    def torch_step(dtype: torch.dtype):
        opt = torch.optim.Muon(matrices(), lr=0.02, weight_decay=0.0, adjust_lr_fn="original")
        ns = torch_ns_in(dtype)

        def step():
            with torch_muon_ns(ns):
                opt.step()
        return step if dtype != torch.bfloat16 else opt.step

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    contenders = {}
    for tag, dtype in dtypes.items():
        contenders[f"ours, {tag} NS"] = Muon(matrices(), ns_dtype=str(dtype)[6:]).step
        contenders[f"torch.optim.Muon, {tag} NS"] = torch_step(dtype)
    contenders["ours, fp32 NS, every same-shape group batched"] = Muon(matrices(), ns_dtype="float32",
                                                                      ns_batched=True).step
    contenders["reference per-matrix Muon (fp32)"] = ReferenceMuon(matrices()).step
    times = alternate(contenders, {name: args.reps for name in contenders}, args.device)
    base = "reference per-matrix Muon (fp32)"
    rows = [(name, statistics.median(t), ratio(times, name, base)) for name, t in times.items()]
    side = [(tag, statistics.median(times[f"ours, {tag} NS"]), statistics.median(times[f"torch.optim.Muon, {tag} NS"]),
             ratio(times, f"ours, {tag} NS", f"torch.optim.Muon, {tag} NS")) for tag in dtypes]
    return rows, side


def ns_by_shape(args) -> list[tuple[tuple[int, ...], float, float, float]]:
    """Float32 Newton-Schulz alone per distinct block-matrix shape: (shape, ours s, torch's s,
    median same-round ratio)."""
    model = model_with_grads(args)
    shapes = sorted({tuple(p.shape) for n, p in model.named_parameters() if n.startswith("blocks.") and p.ndim == 2})
    theirs = torch_ns_in(torch.float32)
    rows = []
    for shape in shapes:
        G = torch.randn(shape, device=args.device)
        times = alternate({"ours": lambda G=G: newton_schulz(G),
                           "torch": lambda G=G: theirs(G, NS_COEFFICIENTS, 5, NS_EPS)},
                          {"ours": args.reps, "torch": args.reps}, args.device)
        rows.append((shape, statistics.median(times["ours"]), statistics.median(times["torch"]),
                     ratio(times, "ours", "torch")))
    return rows


def bundle_comparison(args) -> list[tuple[str, float, float, float]]:
    rows = []
    adamw_time = None
    for arm in ARMS:
        opt, _ = build_bundle(parse_optim_config({"type": arm}), model_with_grads(args), 0)
        members = tuple(opt.optimizers.values())

        def direct(optimizers=members):
            for o in optimizers:
                o.step()

        times = alternate({"bundle": opt.step, "direct": direct},
                          {"bundle": args.reps, "direct": args.reps}, args.device)
        direct_time = statistics.median(times["direct"])
        adamw_time = adamw_time or direct_time
        rows.append((arm, statistics.median(times["bundle"]), ratio(times, "bundle", "direct"),
                     direct_time / adamw_time))
    return rows


def dispatch_overhead(calls: int = 20000) -> float:
    """Seconds MultiOpt.step adds per step over an inline loop, measured on two optimizers whose
    step does no work (their parameters have no gradient), so nothing else is timed."""
    optimizers = {name: torch.optim.SGD([(name, torch.nn.Parameter(torch.zeros(1)))], lr=0.1)
                  for name in ("matrix", "rest")}
    bundle = MultiOpt(optimizers)
    members = tuple(optimizers.values())

    def direct(optimizers=members):
        for o in optimizers:
            o.step()

    times = alternate({"bundle": lambda: [bundle.step() for _ in range(calls)],
                       "direct": lambda: [direct() for _ in range(calls)]},
                      {"bundle": 5, "direct": 5}, "cpu")
    return (statistics.median(times["bundle"]) - statistics.median(times["direct"])) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--d", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads (torch.set_num_threads)")
    parser.add_argument("--reps", type=int, default=15, help="timed steps per contender")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    print(f"d={args.d} blocks={args.blocks} vocab={args.vocab} ctx={args.ctx} "
          f"device={args.device} threads={args.threads} torch={torch.__version__}\n")
    rows, side = muon_comparison(args)
    print("| Muon on the block matrices | ms/step | / reference |\n|---|---:|---:|")
    for name, t, vs_reference in rows:
        print(f"| {name} | {t * 1e3:.1f} | {vs_reference:.3f} |")
    print("\n| NS dtype | ours ms/step | torch.optim.Muon ms/step | ours / torch (target <= 1.0) |"
          "\n|---|---:|---:|---:|")
    for tag, ours, theirs, vs_torch in side:
        print(f"| {tag} | {ours * 1e3:.1f} | {theirs * 1e3:.1f} | {vs_torch:.3f} |")
    print("\n| float32 Newton-Schulz alone, shape | ours ms | torch's ms | ours / torch |\n|---|---:|---:|---:|")
    for shape, ours, theirs, vs_torch in ns_by_shape(args):
        print(f"| {' x '.join(map(str, shape))} | {ours * 1e3:.2f} | {theirs * 1e3:.2f} | {vs_torch:.3f} |")
    print("\n| arm | bundle ms/step | bundle / direct | direct / adamw |\n|---|---:|---:|---:|")
    rows = bundle_comparison(args)
    for arm, t, overhead, vs_adamw in rows:
        print(f"| {arm} | {t * 1e3:.1f} | {overhead:.3f} | {vs_adamw:.2f} |")
    overhead = dispatch_overhead()
    cheapest = min(t for _, t, _, _ in rows)
    print(f"\nBundle dispatch overhead: {overhead * 1e6:.2f} us per step "
          f"({overhead / cheapest:.4%} of the cheapest arm's step).")


if __name__ == "__main__":
    main()
