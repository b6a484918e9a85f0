"""Pure planning for the operator: (resource, observed, now) -> Plan of typed actions. No I/O, no clocks, no kopf."""
