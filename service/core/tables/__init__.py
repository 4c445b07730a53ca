"""The core's tables: sequences, the admission queue and its fair orders, the workers'
ledger, the tenants' service, the transitions between them (lifecycle), the steady step
kept from a worker's last report (steady) and the read side (reads), handed around as one
`tables.Tables`. Mechanism: they read no config, and import nothing of deciding or of
reports."""
