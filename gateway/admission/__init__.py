"""Who may ask and what they may ask (docs/architecture.md, "Module map"): keys, tiers,
rate limits, stream and speech slots, and the one validation path of every door."""
