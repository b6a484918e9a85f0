"""The OpenAI-compatible gateway: auth, rate limits, priority tiers, load- and prefix-aware routing, canary weights, retries."""
