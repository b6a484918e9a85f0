"""The kopf operator process: observe the cluster, call `controllers`, execute the plan. Thin by design."""
