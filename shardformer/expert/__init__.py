"""Expert parallelism: which experts a rank holds (sharding.py), the token exchange around them (dispatch.py) and the
router logits carried across pipeline stages and sequence shards for the router loss (router_logits.py)."""
