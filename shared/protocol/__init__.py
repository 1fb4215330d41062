"""The protocol both sides speak: the wire schema, the sampling settings and logit processing,
the acceptance rule, and the binary codec for rows. Pure: no HTTP, no model, no engine."""

# The neutral sampling settings, written once (SamplingConfig, the wire's SamplingParams and
# the client's Sampling default to them): greedy, no top-k, no top-p.
GREEDY_TEMPERATURE = 0.0
NO_TOP_K = 0
NO_TOP_P = 1.0
