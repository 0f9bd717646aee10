"""The published M2PO variants as named settings (`configs/arith.py` presets use them).

`ACTOR[name]` holds the `actor.*` config values of a variant; `MASK[name]` the matching
keyword arguments of `masking.m2po_mask_with_stats`. "paper_final" is the ICLR 2026 M2PO as
ModelScope's trainers implement it:

- candidates: the tokens in PPO's two active quadrants, A > 0 with log r > 0 or A < 0 with
  log r < 0, where log r = current - behaviour log-prob;
- the largest m2 = (log r)^2 among them are dropped while their mean exceeds tau (the <=
  rule), over the whole batch and every device (one minibatch, global scope);
- the loss is -exp(log r) * A on the kept tokens: no ratio clip, no proximal policy.
"""

from __future__ import annotations

MASK = {
    "areal": dict(second_moment="behav_prox", stop_rule="lt", candidates="all"),
    "paper": dict(second_moment="current_behav", stop_rule="le", candidates="all"),
    "paper_final": dict(second_moment="current_behav", stop_rule="le", candidates="harmful"),
}

ACTOR = {
    # The paper's Algorithm 1: m2 of the current policy against the behaviour one, the <=
    # rule over all tokens, the loss -A * r without a ratio clip over all valid tokens.
    "paper": dict(
        m2po_second_moment="current_behav",
        m2po_stop_rule="le",
        eps_clip=None,
        loss_denominator="valid",
    ),
    # The authors' code: the harmful tokens' capped mean, turned into a PPO clip range.
    "authors": dict(m2po_candidates="harmful", m2po_stop_rule="capped_clip"),
    "paper_final": dict(
        m2po_second_moment="current_behav",
        m2po_stop_rule="le",
        m2po_candidates="harmful",
        m2po_scope="global",
        ppo_n_minibatches=1,  # the batch is the set: one update per step
        use_decoupled_loss=False,  # log r against the behaviour policy, rho = 1
        eps_clip=None,  # no ratio clip: -exp(log r) * A
        eps_clip_higher=None,
        c_clip=None,
        loss_denominator="valid",
    ),
}


def configure(actor, name: str) -> None:
    """Sets variant `name`'s settings (`ACTOR[name]`) on a config's `actor` section; the
    final paper's has no proximal policy, so its behaviour correction is off too."""
    for key, value in ACTOR[name].items():
        actor[key] = value
    if name == "paper_final":
        actor.rejection_sampling.enabled = False  # no proximal policy: nothing to correct
