"""Guards and reliability: process-group start-up and layout agreement (launch), the per-step batch agreement, failure
propagation and the frozen-rank heartbeat, the optimizer guard, the clean exit."""
