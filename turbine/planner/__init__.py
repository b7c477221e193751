"""The SLA planner: predicts load, sizes the fleet per role to meet TTFT/ITL targets, and tells a
`Connector` (turbine/planner/connector.py) to apply it."""
