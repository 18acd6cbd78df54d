"""Where a stage's time goes: named spans, nested, accumulated per process, with the model's FLOPs.

    with span("generation"):          # a phase of a stage
        with span("sampling"): ...    # an operation inside it
    lm = profiled(lm)                 # every lm.step is a "forward" span (with its FLOPs), every select a "select"

`snapshot()` gives each path's *exclusive* seconds ({"generation/forward": {"seconds", "gflop"}, ...}): a span's
time less its children's, so the parts add up to the whole. `mfu(snap, peak)` is the model forward's FLOP rate as a
share of `peak`, the machine's float32 matmul rate measured by `matmul_flops()` in the same run. Spans cost about a
microsecond each. Once this process has used CUDA, each span synchronises the device when it opens and closes, so
that it times the GPU's work and not its launches (a GPU run then loses the CPU's run-ahead across spans); and
`matmul_flops` measures the rate of the device the stages run on (CUDA when present), synchronised.
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from contextlib import contextmanager

import torch

_SECONDS: dict[str, float] = defaultdict(float)
_FLOPS: dict[str, float] = defaultdict(float)
_STACK: list[list] = []  # [name, children's seconds]


def reset() -> None:
    _SECONDS.clear()
    _FLOPS.clear()
    _STACK.clear()


@contextmanager
def span(name: str, flops: float = 0.0):
    """Times the block as `name` under the spans open around it; `flops`: the work it does, for the FLOP rate."""
    _STACK.append([name, 0.0])
    path = "/".join(s[0] for s in _STACK)
    sync = torch.cuda.is_initialized()  # CUDA in use: time the device's work, not the launches
    if sync:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    try:
        yield
    finally:
        if sync:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        _, children = _STACK.pop()
        _SECONDS[path] += dt - children
        _FLOPS[path] += flops
        if _STACK:
            _STACK[-1][1] += dt


def add_flops(flops: float) -> None:
    """Counts `flops` of work to the innermost open span (for work whose size is known only inside it)."""
    if _STACK:
        _FLOPS["/".join(s[0] for s in _STACK)] += flops


def snapshot() -> dict[str, dict[str, float]]:
    """{path: {"seconds": exclusive seconds, "gflop": GFLOP done there}}, largest first."""
    return {p: {"seconds": s, "gflop": _FLOPS[p] / 1e9} for p, s in sorted(_SECONDS.items(), key=lambda kv: -kv[1])}


def by_operation(snap: dict[str, dict[str, float]]) -> dict[str, float]:
    """Seconds per innermost operation (forward, select, sampling, entropy, lookahead, scoring, io, ...), summed over
    the phases they ran in; a phase's own (exclusive) time counts under the phase's name."""
    out: dict[str, float] = defaultdict(float)
    for path, v in snap.items():
        out[path.rsplit("/", 1)[-1]] += v["seconds"]
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def mfu(snap: dict[str, dict[str, float]], peak_flops: float) -> float | None:
    """The model forward's FLOP rate (all "forward" spans) as a share of `peak_flops`; None without forward FLOPs."""
    fwd = [v for p, v in snap.items() if p.rsplit("/", 1)[-1] == "forward"]
    seconds, gflop = sum(v["seconds"] for v in fwd), sum(v["gflop"] for v in fwd)
    return gflop * 1e9 / seconds / peak_flops if seconds > 0 and gflop > 0 and peak_flops > 0 else None


def flops_per_token(lm) -> float:
    """2 x the parameters of the network behind a StepLM (a multiply-add per weight per token; the tied embedding is
    the output layer's), 0 where there is none (the Markov oracles). Attention's own FLOPs are left out."""
    net = getattr(lm, "net", None) or getattr(lm, "model", None)
    return 2.0 * sum(p.numel() for p in net.parameters()) if isinstance(net, torch.nn.Module) else 0.0


class _Profiled:
    """A StepLM whose step and select are timed (step as "forward", with its FLOPs); every other attribute is the
    wrapped model's."""

    def __init__(self, lm):
        self._lm, self._fpt = lm, flops_per_token(lm)

    def step(self, tokens, state):
        with span("forward", self._fpt * tokens.numel()):
            return self._lm.step(tokens, state)

    def select(self, state, index):
        with span("select"):
            return self._lm.select(state, index)

    def __getattr__(self, name):
        attr = getattr(self._lm, name)  # AttributeError where the model has none (features, prefill are optional)
        if name not in ("features", "prefill") or (name == "features" and self._lm.head is None):
            return attr
        # the output layer's FLOPs per decoded row (0 where unknown: prefill then counts it for every token)
        out = 2.0 * self._lm.head[0].numel() if self._lm.head is not None else 0.0

        def forward(tokens, state):  # features decodes no row (the caller times its head), prefill one per sequence
            rows = tokens.size(0) if name == "prefill" else 0
            with span("forward", (self._fpt - out) * tokens.numel() + out * rows):
                return attr(tokens, state)
        return forward


def profiled(lm):
    """`lm` with its steps timed (see the module's docstring); a model already profiled is returned as it is."""
    return lm if isinstance(lm, _Profiled) else _Profiled(lm)


def matmul_flops(n: int = 1024, seconds: float = 1.0, device: str | None = None) -> float:
    """The float32 matmul rate (FLOP/s) of `device` (None: CUDA when present, the device the stages run on, else the
    CPU with torch's current threads): n x n products for about `seconds`, synchronised on CUDA."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    a @ b  # warm-up
    sync()
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        reps += 1
        if reps % 16 == 0:
            sync()  # queued products count only once done
    sync()
    return 2.0 * n**3 * reps / (time.perf_counter() - t0)


def peak_flops(device: str | None = None, n: int = 2048) -> float:
    """The best of three float32 matmul rates of `device` (n x n products): a shared machine's rate varies by a third,
    and a benchmark's MFU is against what the machine can do (None: CUDA when present, as matmul_flops)."""
    return max(matmul_flops(n, 0.5, device) for _ in range(3))


def machine_line(device: str | None = None, n: int = 2048) -> str:
    """The line a benchmark prints beside its figures: threads (or GPU), torch and peak_flops, so that the figures are
    read against this machine's rate, on any machine."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    where = torch.cuda.get_device_name(device) if device.startswith("cuda") else f"{torch.get_num_threads()} threads"
    return f"{where}, torch {torch.__version__}; float32 matmul {peak_flops(device, n) / 1e9:.1f} GFLOP/s ({n}^3)"


def best_of(fn, repeats: int) -> float:
    """The shortest of `repeats` timed calls of fn() in seconds, after one untimed warm-up call (the benchmarks)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def timed(name: str):
    """Decorator: every call of the function is a span `name`."""
    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            with span(name):
                return fn(*args, **kwargs)
        return inner
    return wrap
