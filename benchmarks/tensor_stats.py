"""Per-tensor statistics of a bundled task's gradients during an uncompressed (dense) run.

What a compressed method could measure during its dense phase to decide, per tensor, what to
compress: for every parameter tensor, at a few steps,

- ``err_g``: relative compression error ``||g - C(g)|| / ||g||`` of each worker's gradient with
  the codec (mean over workers), the real codec from :func:`gradpress.compress.build`;
- ``err_u``: the same for what OneBitLANS sends, each worker's ``m / (sqrt(v) + eps)``;
- ``zero_rows``: the fraction of rows (first dimension) whose averaged gradient is all zero;
- ``agree``: cosine similarity of two workers' gradients (how much of a gradient is signal);
- ``agree_sum``: the agreement from sums over all steps so far,
  ``(W^2 sum||avg||^2 - sum_r ||g_r||^2) / ((W-1) sum_r ||g_r||^2)``: the mean inner product of
  two workers' gradients over their mean squared norm, which a cluster gets from one exact
  ``push_pull`` of each worker's summed squared norms;
- ``agree_q``: the same from the per-step ratio ``q_t = mean_r ||g_r||^2 / ||avg||^2``
  (each worker sums its own ratio, one exact ``push_pull`` adds them; every step weighs the
  same): ``(W - q) / ((W - 1) q)`` with ``q`` the mean of ``q_t``;
- ``agree_r``: the same from ``r_t = ||avg||^2 / ||g_r||^2`` (bounded below, unlike
  ``q_t``, which blows up when a noisy tensor's average is small by chance):
  ``(W r - 1) / (W - 1)`` with ``r`` the mean of ``r_t`` over workers and steps;
- ``persist``: mean cosine similarity of consecutive averaged gradients since the last row
  (what one worker can measure alone);
- ``share``: the tensor's share of the model's fp32 bytes;
- ``v_move``: how far the second moment moved over the last ``--window`` steps,
  ``||v_t - v_{t-w}|| / ||v_t||`` (per tensor and for the whole model).

Workers are emulated in one process (rank r's batches, gradients averaged by hand), LANS steps
on the averaged gradient with the task's lr and schedule, so the run is the dense phase of
``gradpress train --task T --optimizer onebit-lans``.

    python benchmarks/tensor_stats.py --task stdlib-mlm --steps 200 --codec onebit
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from gradpress.compress import build
from gradpress.optim import LANS, weight_decay_groups
from gradpress.tasks import get_task


def rel_error(x: torch.Tensor, codec_spec: str) -> float:
    """``||x - D(C(x))|| / ||x||`` with the real codec (0 for a zero tensor)."""
    flat = x.detach().reshape(-1).float().contiguous()
    n = float(flat.norm())
    if n == 0.0:
        return 0.0
    codec = build(codec_spec, flat.numel())
    return float((flat - codec.decompress(codec.compress(flat))).norm()) / n


def lr_at(step: int, peak: float, warmup: int, total: int) -> float:
    """Linear warm-up then cosine decay to 0, as ``gradpress train``'s default schedule."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return peak * 0.5 * (1.0 + math.cos(math.pi * min(1.0, t)))


def run(args: argparse.Namespace) -> dict:
    task = get_task(args.task)
    d = task.defaults
    torch.manual_seed(args.seed)
    model = task.build_model(args.seed)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    total_bytes = sum(p.numel() for _, p in named) * 4
    opt = LANS(weight_decay_groups([p for _, p in named], 0.01), lr=d.lr_for("lans"))
    b1, b2 = 0.9, 0.999
    m = [{n: torch.zeros_like(p) for n, p in named} for _ in range(args.workers)]
    v = [{n: torch.zeros_like(p) for n, p in named} for _ in range(args.workers)]
    v_hist: list[dict[str, torch.Tensor]] = []
    batches = [task.train_batches(r, args.workers, d.batch_size, args.seed, 0)
               for r in range(args.workers)]
    rows = []
    prev: dict[str, torch.Tensor] = {}
    persist = {n: 0.0 for n, _ in named}  # sum of cos(avg_t, avg_{t-1}) since the last row
    sums = {n: [0.0, 0.0] for n, _ in named}  # sum over steps of ||avg||^2, sum_r ||g_r||^2
    qsum = {n: 0.0 for n, _ in named}  # sum over steps of mean_r ||g_r||^2 / ||avg||^2
    rsum = {n: 0.0 for n, _ in named}  # sum over steps of mean_r ||avg||^2 / ||g_r||^2
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, d.lr_for("lans"), d.warmup_steps, args.total)
        grads = []
        for r in range(args.workers):
            model.zero_grad()
            batch = next(batches[r], None)
            if batch is None:  # next epoch
                epoch = step // task.steps_per_epoch(args.workers, d.batch_size)
                batches[r] = task.train_batches(r, args.workers, d.batch_size, args.seed, epoch)
                batch = next(batches[r])
            task.loss(model, batch).backward()
            grads.append({n: p.grad.detach().clone() for n, p in named})
        avg = {n: sum(gr[n] for gr in grads) / args.workers for n, _ in named}
        for n, _ in named:
            if n in prev:
                persist[n] += float(torch.nn.functional.cosine_similarity(
                    avg[n].reshape(-1), prev[n].reshape(-1), dim=0))
        prev = avg
        for n, _ in named:
            sums[n][0] += float(avg[n].double().pow(2).sum())
            sums[n][1] += sum(float(g[n].double().pow(2).sum()) for g in grads)
            a2 = float(avg[n].double().pow(2).sum())
            qsum[n] += (sum(float(g[n].double().pow(2).sum()) for g in grads)
                        / args.workers / a2) if a2 > 0 else 1.0
            rsum[n] += sum(a2 / max(float(g[n].double().pow(2).sum()), 1e-300)
                           for g in grads) / args.workers
        for r in range(args.workers):  # each worker's own moments (OneBitLANS's local v)
            for n, _ in named:
                m[r][n].mul_(b1).add_(grads[r][n], alpha=1 - b1)
                v[r][n].mul_(b2).addcmul_(grads[r][n], grads[r][n], value=1 - b2)
        v_hist.append({n: v[0][n].clone() for n, _ in named})
        v_hist = v_hist[-(args.window + 1):]
        if (step + 1) % args.every == 0:
            rows.append(measure(step + 1, named, grads, avg, m, v, v_hist, total_bytes, args))
            w = args.workers
            for n in persist:
                rows[-1]["tensors"][n]["persist"] = persist[n] / args.every
                persist[n] = 0.0
                a, b = sums[n]  # agreement of the sums so far (what gradpress measures)
                rows[-1]["tensors"][n]["agree_sum"] = (w * w * a - b) / ((w - 1) * b) \
                    if w > 1 and b > 0 else 1.0
                q = qsum[n] / (step + 1)
                rows[-1]["tensors"][n]["agree_q"] = (w - q) / ((w - 1) * q) if w > 1 else 1.0
                rm = rsum[n] / (step + 1)
                rows[-1]["tensors"][n]["agree_r"] = (w * rm - 1) / (w - 1) if w > 1 else 1.0
        for n, p in named:
            p.grad = avg[n]
        opt.step()
    return {"args": vars(args), "rows": rows}


def measure(step, named, grads, avg, m, v, v_hist, total_bytes, args) -> dict:
    t = step  # bias corrections of the moments
    out = {"step": step, "tensors": {}}
    num, den = 0.0, 0.0
    for n, p in named:
        err_g = sum(rel_error(g[n], args.codec) for g in grads) / len(grads)
        err_u = sum(rel_error((mr[n] / (1 - 0.9 ** t)) / ((vr[n] / (1 - 0.999 ** t)).sqrt()
                                                         + 1e-6), args.codec)
                    for mr, vr in zip(m, v, strict=True)) / len(m)
        a = avg[n]
        zero_rows = float((a.reshape(a.shape[0], -1).abs().sum(1) == 0).float().mean()) \
            if a.dim() > 1 else 0.0
        old, new = v_hist[0][n], v_hist[-1][n]
        move = float((new - old).norm() / new.norm().clamp_min(1e-30))
        num += float((new - old).norm()) ** 2
        den += float(new.norm()) ** 2
        agree = float(torch.nn.functional.cosine_similarity(
            grads[0][n].reshape(-1), grads[1][n].reshape(-1), dim=0)) if len(grads) > 1 else 1.0
        out["tensors"][n] = {"numel": p.numel(), "share": p.numel() * 4 / total_bytes,
                             "err_g": err_g, "err_u": err_u, "zero_rows": zero_rows,
                             "v_move": move, "agree": agree}
    out["v_move_model"] = math.sqrt(num / max(den, 1e-300))
    return out


RESULTS = Path(__file__).resolve().parent / "results"


def summary_row(path: Path, step: int) -> list[str]:
    """One row of the results table: a record's agreement at ``step``, lowest first."""
    res = json.loads(path.read_text())
    row = next(r for r in res["rows"] if r["step"] == step)
    ags = sorted(((t["agree_r"], n) for n, t in row["tensors"].items()))
    a = res["args"]
    low = ", ".join(f"`{n}` {v:.2f}" for v, n in ags[:2])
    return [a["task"], str(a["workers"]), str(a["seed"]), str(step), low,
            ", ".join(f"`{n}`" for v, n in ags if v < 0.2) or "none"]


def update_results(files: list[Path], step: int) -> None:
    """Write the table ``which-exact`` of benchmarks/results/accuracy.json from records."""
    target = RESULTS / "accuracy.json"
    data = json.loads(target.read_text())
    table = next(t for t in data["tables"] if t["id"] == "which-exact")
    table["rows"] = [summary_row(f, step) for f in files]
    target.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", default="stdlib-mlm")
    p.add_argument("--codec", default="onebit")
    p.add_argument("--steps", type=int, default=200, help="dense steps to run")
    p.add_argument("--total", type=int, default=800, help="run length of the lr schedule")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--every", type=int, default=20, help="measure every this many steps")
    p.add_argument("--window", type=int, default=20, help="steps over which v_move is taken")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--update-results", nargs="+", type=Path, metavar="RECORD",
                   help="only rewrite the results table from these --json records")
    p.add_argument("--at", type=int, default=100, help="with --update-results: the step shown")
    args = p.parse_args()
    if args.update_results:
        update_results(args.update_results, args.at)
        return
    res = run(args)
    for row in res["rows"]:
        print(f"step {row['step']}: v_move (model) {row['v_move_model']:.4f}")
        for n, s in row["tensors"].items():
            print(f"  {n:40s} {s['numel']:>8d} share {s['share']:.3f} err_g {s['err_g']:.3f} "
                  f"err_u {s['err_u']:.3f} zero_rows {s['zero_rows']:.2f} v_move {s['v_move']:.3f} "
                  f"agree {s['agree']:+.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
