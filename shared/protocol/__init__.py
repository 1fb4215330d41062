"""The protocol both sides speak: the wire schema, the sampling settings and logit processing,
the acceptance rule, and the binary codec for rows. Pure: no HTTP, no model, no engine."""
