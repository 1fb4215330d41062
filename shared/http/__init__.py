"""HTTP plumbing both servers (the verifier and the gateway) use: API keys, body limits, the
connection guard and request metrics; the gateway's cross-site guards (``cross_site``)."""
