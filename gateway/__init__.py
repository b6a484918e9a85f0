"""The OpenAI-compatible gateway: auth, rate limits, priority tiers, load- and prefix-aware routing, canary weights, retries.

Pure decisions (table-tested): `routing` (model -> variant -> revision -> pod), `discovery` (routing tables from
static backends or from InferenceDeployments + pods), `tiers` (tier resolution, admit/queue/shed), `ratelimit`
(token buckets, time passed in), `auth` (key parsing, constant-time checks). Shells: `proxy` (the streaming
ASGI endpoint), `transport` (an O(1) httpx connection pool), `sources` (health checks, Kubernetes list+watch),
`admission` (priority queue and scale-from-zero hold), `metrics`, `state`, `app` (the app factory), `cli`
(`llmfleet gateway`), `settings`. `stub` and `testing` serve tests and benchmarks only.
"""
