"""How many soft-label entries the feature cache needs: top-k labels against the full distribution.

On held-out records (the validation split, seed 0, of the self-distillation corpus: never trained on
by the shipped head) and the shipped head, for each k: the target's probability mass outside its
top k draft tokens, KL(p_k || p) = -log(top-k mass) of the renormalised labels, the change of the
weighted TTT loss (decay 0.8, K steps) from full to top-k labels (mostly the labels' lower entropy,
which does not move the head), and the cosine and relative distance between the head's gradients
under the two labels (what training sees).

    python scripts/label_topk.py --tokens 4000 --threads 1
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--distilled", type=Path, default=None, help="distilled records (default: DATA_ROOT/distill/smollm2-135m-instruct.jsonl)")
    p.add_argument("--head", default="embedded")
    p.add_argument("--tokens", type=int, default=4000, help="held-out tokens evaluated")
    p.add_argument("--batch-tokens", type=int, default=2048)
    p.add_argument("--ttt-steps", type=int, default=6)
    p.add_argument("--ks", default="4,8,16,32,64,128,256")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    torch.set_num_threads(a.threads)

    from adaptivespec.drafter import Eagle3Drafter
    from adaptivespec.models import load_target
    from adaptivespec.training.data import DATA_ROOT, collate, plan_batches, read_records, split
    from adaptivespec.training.ttt import Features, target_features, ttt_loss

    distilled = a.distilled or DATA_ROOT / "distill" / "smollm2-135m-instruct.jsonl"
    target, tok = load_target("smollm2-135m-instruct", "bfloat16")
    head = Eagle3Drafter.from_pretrained(a.head, target, dtype=torch.float32).train()
    vocab = head.t2d.nonzero().squeeze(-1)
    _, val = split(read_records(distilled), 0.025, 0)
    recs, total = [], 0
    for r in val:
        if total >= a.tokens:
            break
        recs.append(r)
        total += r.length
    ks = [int(x) for x in a.ks.split(",")]
    k_steps = a.ttt_steps
    acc = {k: {"tail": 0.0, "kl": 0.0, "rows": 0, "loss": 0.0, "cos": 0.0, "gerr": 0.0} for k in ks}
    full_loss, n_batches = 0.0, 0

    def grads(feats, batch):
        head.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            st = ttt_loss(head, batch, feats, k_steps, 0.8)
        st.loss.backward()
        return float(st.loss.detach()), torch.cat([q.grad.flatten() for q in head.parameters() if q.grad is not None]).double()

    for group in plan_batches(recs, a.batch_tokens, 1024):
        batch = collate([recs[i] for i in group], 1024, tok.eos_token_id)
        full = target_features(target, head.aux_layers, batch, vocab, head.t2d, k_steps)
        lf, gf = grads(full, batch)
        full_loss += lf
        n_batches += 1
        for k in ks:
            pk, idx = full.probs.topk(k, dim=-1)
            mass = pk.sum(-1)
            lk, gk = grads(Features(full.states, pk / mass[:, None], full.row, idx), batch)
            s = acc[k]
            s["tail"] += float((1 - mass).sum())
            s["kl"] += float((-mass.log()).sum())
            s["rows"] += mass.numel()
            s["loss"] += lk
            s["cos"] += float(gk @ gf / (gk.norm() * gf.norm()))
            s["gerr"] += float((gk - gf).norm() / gf.norm())
        print(f"batch {n_batches}: {list(batch.ids.shape)} full loss {lf:.4f}", flush=True)
    rows = []
    for k in ks:
        s = acc[k]
        rows.append({"k": k, "tail_mass": s["tail"] / s["rows"], "kl_nats": s["kl"] / s["rows"],
                     "loss_full": full_loss / n_batches, "loss_topk": s["loss"] / n_batches,
                     "loss_gap_rel": (s["loss"] - full_loss) / full_loss, "grad_cosine": s["cos"] / n_batches, "grad_rel_error": s["gerr"] / n_batches,
                     "label_bytes_per_token": 4 * k})
    print(f"held-out records {len(recs)}, tokens {total}, label rows {acc[ks[0]]['rows']}, batches {n_batches}, K={k_steps}")
    print("| k | tail mass | KL(p_k‖p) nats | weighted TTT loss (full → top-k) | relative gap | grad cosine | grad rel. error | label bytes/token |")
    print("|---:|---:|---:|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['k']} | {r['tail_mass']:.4f} | {r['kl_nats']:.4f} | {r['loss_full']:.4f} → {r['loss_topk']:.4f} | "
              f"{r['loss_gap_rel']:+.4f} | {r['grad_cosine']:.5f} | {r['grad_rel_error']:.4f} | {r['label_bytes_per_token']} |")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
